from draftsmith.provenance import draft_inputs, record_inputs
from draftsmith.smk import run
from draftsmith.target_model.spec import TargetSpec
from draftsmith.training.sources import OnlineStates, ShardStates
from draftsmith.training.trainer import train_draft
from draftsmith.preflight import gate


def main(smk):
    target = TargetSpec.from_dict(smk.params.target)
    gate(smk.config, target.model, "train")
    online = smk.params.states["mode"] == "online"
    states = list(smk.input.samples if online else smk.input.manifests)
    inputs = draft_inputs(states, smk.input.d2t, smk.input.t2d, target.fingerprint())
    train_draft(
        states=OnlineStates(states, smk.params.states) if online else ShardStates(states),
        d2t=smk.input.d2t,
        t2d=smk.input.t2d,
        target=target,
        training={**smk.params.training, "resume": smk.config["training"]["resume"]},
        state_dir=smk.params.state_dir,
        variant=smk.wildcards.variant,
        gpus=smk.params.gpus,
        out_config=smk.output.config,
        out_weights=smk.output.weights,
        out_metrics=smk.output.metrics,
        out_data=smk.output.data,
    )
    record_inputs(smk.output.data, inputs)


run(main, snakemake)  # noqa: F821

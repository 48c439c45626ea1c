from draftsmith.data.regenerate import regenerate, regeneration_prompts
from draftsmith.devices import resolve_device, resolve_dtype
from draftsmith.smk import run
from draftsmith.target_model.spec import TargetSpec


def main(smk):
    cfg = dict(smk.params.regenerate)
    target = TargetSpec.from_dict(smk.params.target)
    device = resolve_device(cfg["device"])
    dtype = resolve_dtype(target.stage_dtype(cfg["dtype"]), device)
    regenerate(regeneration_prompts(dict(smk.params.spec), smk.params.source), target, smk.output.jsonl,
               max_new_tokens=cfg["max_new_tokens"], batch_size=cfg["batch_size"], temperature=cfg["temperature"],
               top_p=cfg["top_p"], top_k=cfg["top_k"], seed=cfg["seed"], chunk_size=cfg["chunk_size"],
               device=str(device), dtype=str(dtype).removeprefix("torch."), max_prompt_tokens=smk.params.seq_length)


run(main, snakemake)  # noqa: F821

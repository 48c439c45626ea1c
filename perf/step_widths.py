"""What one target step costs at each width the offline benchmark's loops run (1 token: target-only greedy; 2..k+1:
a verification of 1..k drafts, with the auxiliary states EAGLE-3 needs), under each kernel setting the benchmark's
tuning tries (cuBLAS or cuBLASLt GEMMs x SDPA backends, draftsmith.decoding.static_cache.KERNEL_SETTINGS): where a
verification's extra cost over a decode step comes from, and which setting removes it.

On one H100 (docs/BENCHMARKS.md, thirteenth session) SmolLM2-135M's verification over 4 tokens cost 4.50 ms against a
3.21 ms decode step (the benchmark's step_costs): that width penalty, not the draft, is most of the gap between the
cost model's 1.65x and the measured 1.45x. Each setting's steps are captured as CUDA graphs on a CUDA device (as the
benchmark runs them) and run eagerly on a CPU; a setting that cannot run the step is reported as unavailable.

    python perf/step_widths.py --target results-smollm2-50k/target --k 3 --table perf/results/step_widths.md \
        --profile perf/results/step_profile.md --draft-rounds perf/results/draft_rounds.md --spans perf/results/spans.md

`--spans` times the widths with a cache of the benchmark's size (`--cache-slots`), the attention reading all of it
(as the loops did before draftsmith.decoding.static_cache.attention_span) and only the span the sequence needs.
`--profile` also writes what a width-1 step and a width-(k+1) verification run, kernel by kernel (torch.profiler over
eager steps, whose kernels a graph replays; on a CPU the aten operators): calls and device time per step at each
width, the largest differences first, so the width penalty is found where it lies. `--draft-rounds` times a draft
round (the other part of a round's cost) with the draft's modules as built and with fewer kernels
(draftsmith.decoding.draft_kernels), on a fresh draft of the target: a round's kernels do not depend on its weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.benchmark.proposers import Eagle3Proposer
from draftsmith.benchmark.spec_decode import TargetModel, synchronize
from draftsmith.benchmark.step_costs import median_ms
from draftsmith.decoding.static_cache import KERNEL_SETTINGS, attention_span, kernel_setting
from draftsmith.devices import resolve_dtype
from draftsmith.draft_model import build_draft
from draftsmith.io import write_text
from draftsmith.target_model.layers import default_aux_layer_ids, text_config
from draftsmith.target_model.spec import TargetSpec
from draftsmith.vocab import build_vocab_map


def step_ms(runner: TargetModel, width: int, repeats: int) -> float:
    """Median ms of one step of `width` tokens after the prompt (the loops' way: forward, argmax, one host sync)."""
    cached = runner.length
    ids = torch.zeros((1, width), dtype=torch.long, device=runner.device)
    with_aux = width > 1 and bool(runner.aux_layer_ids)
    return median_ms(lambda: runner.forward(ids, keep=width, with_aux=with_aux)[0].argmax(-1).tolist(), runner.device,
                     repeats, reset=lambda: runner.rewind(cached))


TUNED_ROW = "tuned (the benchmark's choice per width)"


@torch.inference_mode()
def widths_table(model, k: int, prompt_tokens: int, repeats: int, settings=KERNEL_SETTINGS) -> list[dict]:
    """One row per kernel setting (the benchmark's tuning candidates): each width's step time, or why it cannot run;
    on CUDA one more with each width captured the benchmark's way, tuned (a failure there fails the script)."""
    device = next(model.parameters()).device
    rows = []
    for name, blas, sdpa in settings:
        try:
            with kernel_setting(blas, sdpa):
                rows.append({"kernel setting": name, **width_times(started(model, k, prompt_tokens,
                                                                         cuda_graphs=device.type == "cuda"), k, repeats)})
        except RuntimeError as e:  # the setting cannot run these shapes (or on this device)
            rows.append({"kernel setting": name, "unavailable": str(e).splitlines()[0][:120]})
    if device.type == "cuda":  # the benchmark's own way (benchmark.tune_kernels): each width's fastest setting
        runner = started(model, k, prompt_tokens, cuda_graphs=True, tune_kernels=True)
        rows.append({"kernel setting": TUNED_ROW, **width_times(runner, k, repeats),
                     "chosen": "; ".join(f"width {key[0]}: {name}" for key, name in runner.graphs.choices.items())})
    return rows


def started(model, k: int, prompt_tokens: int, capacity: int | None = None, **options) -> TargetModel:
    """A TargetModel (`options`: cuda_graphs, tune_kernels, whole_cache) after a prompt of `prompt_tokens` tokens,
    its cache `capacity` slots (default: room for a verification over k + 1)."""
    runner = TargetModel(model, default_aux_layer_ids(text_config(model.config).num_hidden_layers), **options)
    runner.start(list(range(1, prompt_tokens + 1)), capacity=capacity or prompt_tokens + k + 1, with_aux=True)
    return runner


@torch.inference_mode()
def span_table(model, k: int, prompt_tokens: int, repeats: int, cache_slots: int) -> list[dict]:
    """Each width's step time (PyTorch's kernel choices; CUDA graphs on a CUDA device) with a cache of `cache_slots`
    slots (the benchmark sizes it for its longest prompt and answer), the steps attending to every slot of it and to
    the first span their `prompt_tokens`-token sequence needs (draftsmith.decoding.static_cache.attention_span).
    Both ways also verify the same k + 1 tokens once more (captured, as timed): the span's row gives the largest
    difference of its logits from the whole cache's and whether every position's greedy token is the same, so a
    span that changed the arithmetic shows before any training does."""
    rows, logits = [], []
    verify = torch.arange(7, 7 + k + 1).view(1, -1)
    for whole in (True, False):
        runner = started(model, k, prompt_tokens, capacity=cache_slots, whole_cache=whole,
                         cuda_graphs=next(model.parameters()).device.type == "cuda")
        times = width_times(runner, k, repeats)
        logits.append(runner.forward(verify.to(runner.device), keep=k + 1, with_aux=True)[0].float().cpu())
        read = runner.cache.max_length if whole else attention_span(prompt_tokens + k + 1, runner.cache.max_length)
        rows.append({"attention reads": f"{'the whole cache' if whole else 'the span needed'} ({read} slots)", **times})
    rows[1]["max logit difference"] = float((logits[1] - logits[0]).abs().max())
    rows[1]["same greedy tokens"] = bool(torch.equal(logits[1].argmax(-1), logits[0].argmax(-1)))
    return rows


def width_times(runner: TargetModel, k: int, repeats: int) -> dict:
    """Each width's step time (ms) and width k + 1 over width 1."""
    row = {f"width {width} ms": round(step_ms(runner, width, repeats), 3) for width in range(1, k + 2)}
    row[f"width {k + 1} / width 1"] = round(row[f"width {k + 1} ms"] / row["width 1 ms"], 3)
    return row


@torch.inference_mode()
def draft_round_table(target: str, model, k: int, prompt_tokens: int, repeats: int, draft_vocab: int) -> list[dict]:
    """A draft round's median time (ms), as the benchmark replays it after a verification that accepted all k drafts
    (k + 1 newly verified positions, then k chain drafts), for a freshly initialised one-layer EAGLE-3 draft of
    `target` (a round's kernels do not depend on the weights), with the draft's modules as built and with fewer
    kernels (draftsmith.decoding.draft_kernels); a last row compares the two."""
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    vocab = text_config(model.config).vocab_size
    size = min(draft_vocab, vocab)
    d2t, t2d = build_vocab_map({t: 1 for t in range(size)}, size, vocab)
    aux_ids = default_aux_layer_ids(text_config(model.config).num_hidden_layers)
    rows = []
    for fewer in (False, True):
        draft = build_draft(TargetSpec(target), torch.from_numpy(d2t), torch.from_numpy(t2d), 1, aux_ids)
        draft = draft.to(device=device, dtype=dtype).eval()
        proposer = Eagle3Proposer(draft, cuda_graphs=device.type == "cuda", fewer_kernels=fewer)
        width = draft.fc.in_features
        proposer.start(torch.zeros((1, prompt_tokens), dtype=torch.long, device=device),
                       torch.zeros((1, prompt_tokens, width), dtype=dtype, device=device), capacity=prompt_tokens + 3 * k)
        proposer.propose([], k)
        verified = proposer.verified
        accepted = (torch.zeros((1, k + 1), dtype=torch.long, device=device),
                    torch.zeros((1, k + 1, width), dtype=dtype, device=device))

        def full_acceptance():  # each timed round follows a verification that accepted all k drafts
            proposer.verified = verified
            proposer.accept(*accepted)

        full_acceptance()
        ms = median_ms(lambda: proposer.propose([], k), device, repeats, reset=full_acceptance)
        rows.append({"draft": "fewer kernels" if fewer else "as built", "round ms": round(ms, 3)})
    rows.append({"draft": "fewer kernels / as built", "round ms": round(rows[1]["round ms"] / rows[0]["round ms"], 3)})
    return rows


def profile_widths(model, k: int, prompt_tokens: int, steps: int) -> pd.DataFrame:
    """Per kernel (on a CPU: per aten operator), calls and self time (µs) per step of a width-1 step and a
    width-(k + 1) verification with the auxiliary states, eager, over `steps` steps each; a total row last."""
    from torch.profiler import ProfilerActivity, profile

    device = next(model.parameters()).device
    on_cuda = device.type == "cuda"
    runner = started(model, k, prompt_tokens)
    cached = runner.length
    columns = {}
    for width in (1, k + 1):
        ids = torch.zeros((1, width), dtype=torch.long, device=device)

        def step():
            runner.forward(ids, keep=width, with_aux=width > 1)[0].argmax(-1).tolist()
            runner.rewind(cached)

        with torch.inference_mode():
            for _ in range(3):  # warm-up: lazy initialisation and kernel selection stay out of the profile
                step()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    step()
            synchronize(device)
        for event in prof.key_averages():
            kernel = event.device_type == torch.autograd.DeviceType.CUDA
            if (kernel if on_cuda else event.key.startswith("aten::")):
                self_us = event.self_device_time_total if on_cuda else event.self_cpu_time_total
                columns.setdefault(event.key, {})[width] = (event.count / steps, self_us / steps)
    rows = []
    for name, by_width in columns.items():
        # kernel names are long templates that share their beginnings: keep both ends of a long one
        row = {"kernel" if on_cuda else "operator": name if len(name) <= 120 else f"{name[:70]} … {name[-45:]}"}
        for width in (1, k + 1):
            calls, us = by_width.get(width, (0.0, 0.0))
            row[f"calls per step, width {width}"] = round(calls, 2)
            row[f"µs per step, width {width}"] = round(us, 1)
        row["difference µs"] = round(row[f"µs per step, width {k + 1}"] - row["µs per step, width 1"], 1)
        rows.append(row)
    table = pd.DataFrame(rows)
    table = table.reindex(table["difference µs"].abs().sort_values(ascending=False).index).reset_index(drop=True)
    total = {table.columns[0]: "total"} | {c: round(table[c].sum(), 1) for c in table.columns[1:]}
    return pd.concat([table, pd.DataFrame([total])], ignore_index=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="a target model directory (a results tree's target/)")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per round: widths 1..k+1 are timed")
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--table", required=True, help="the Markdown table to write")
    ap.add_argument("--profile", help="also write the kernel-by-kernel comparison of width 1 and k + 1 here")
    ap.add_argument("--draft-rounds", help="also write a draft round's time, as built and with fewer kernels, here")
    ap.add_argument("--draft-vocab", type=int, default=16384, help="the draft vocabulary of --draft-rounds' draft")
    ap.add_argument("--spans", help="also write each width's time reading the whole cache and the span needed, here")
    ap.add_argument("--cache-slots", type=int, default=768,
                    help="--spans' cache size (the benchmark's for MT-Bench and 128 new tokens: 768)")
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--profile-rows", type=int, default=40, help="the largest differences kept (and the total)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = TargetSpec(args.target).load_causal_lm(dtype).to(device).eval()
    rows = widths_table(model, args.k, args.prompt_tokens, args.repeats)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    runs = f"{'CUDA graphs' if device.type == 'cuda' else 'eager'}, on {where}; torch {torch.__version__}"
    publish(args.table, f"Target step cost by width, {args.target}, {args.prompt_tokens}-token context, {dtype}, median "
            f"of {args.repeats} steps, {runs}. Width 1 is a target-only greedy step; width k + 1 a verification with "
            "the auxiliary states.", pd.DataFrame(rows).astype(object).fillna("").to_markdown(index=False))
    if args.draft_rounds:
        rows = draft_round_table(args.target, model, args.k, args.prompt_tokens, args.repeats, args.draft_vocab)
        publish(args.draft_rounds, f"A draft round (k = {args.k}, after a full acceptance) of a fresh one-layer EAGLE-3 "
                f"draft of {args.target}, {args.draft_vocab}-token draft vocabulary, {dtype}, median of {args.repeats} "
                f"rounds, {runs}.", pd.DataFrame(rows).to_markdown(index=False))
    if args.spans:
        rows = span_table(model, args.k, args.prompt_tokens, args.repeats, args.cache_slots)
        publish(args.spans, f"Target step cost by width, {args.target}, {args.prompt_tokens}-token context, a cache of "
                f"{args.cache_slots} slots, {dtype}, median of {args.repeats} steps, PyTorch's kernel choices, {runs}: "
                "the attention reading every slot (as before the spans) or the span the sequence needs.",
                pd.DataFrame(rows).astype(object).fillna("").to_markdown(index=False))
    if args.profile:
        table = profile_widths(model, args.k, args.prompt_tokens, args.profile_steps)
        shown = pd.concat([table.iloc[:-1].head(args.profile_rows), table.iloc[-1:]])
        publish(args.profile, f"What a width-1 step and a width-{args.k + 1} verification run, {args.target}, "
                f"{args.prompt_tokens}-token context, {dtype}, eager, {args.profile_steps} steps each, on {where}; "
                f"torch {torch.__version__}. Self time per step of each "
                f"{'kernel' if device.type == 'cuda' else 'aten operator'}, the largest differences first "
                f"({len(shown) - 1} of {len(table) - 1} shown; the total counts all).", shown.to_markdown(index=False))


def publish(path: str, caption: str, table: str) -> None:
    """`caption` and the Markdown `table` to `path` and to stdout."""
    text = caption + "\n\n" + table + "\n"
    write_text(path, text)
    print(text)


if __name__ == "__main__":
    main()

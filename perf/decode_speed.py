"""Decoding speed with and without CUDA graphs: the offline benchmark's loops, eager vs replayed, same run.

Runs draftsmith's offline benchmark twice in one process on the same prompts, target and trained draft
(`benchmark.cuda_graphs` false, then true) and tabulates tokens/s, speedup over target-only greedy,
acceptance length and the cost ratio c for each. GPU only (CUDA graphs).

    python -m perf decode_speed --results results-gpu --num-prompts 8
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.benchmark.offline import run_offline_benchmark
from draftsmith.config.workflow import section_defaults
from draftsmith.data.prompts import read_benchmark_prompts
from draftsmith.draft_model import resolve_num_speculative_tokens
from draftsmith.target_model.spec import TargetSpec
from perf.common import parser, write_table


def main(argv=None):
    ap = parser(__doc__, table="decode_speed")
    ap.add_argument("--results", required=True, help="a finished results tree (target/, draft/<variant>/, benchmark/)")
    ap.add_argument("--variant", default="default")
    ap.add_argument("--target", default=None, help="target model (default: the tree's embedded target/)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("decode_speed compares CUDA-graph replay with eager steps: it needs a CUDA device")
    results = Path(args.results)
    draft_dir = results / "draft" / args.variant
    prompts_file = results / "benchmark" / "prompts.jsonl"
    if not (draft_dir / "config.json").is_file() or not prompts_file.is_file():
        sys.exit(f"{results}: no trained draft or benchmark prompts; run the workflow first (bash perf/gpu/pipeline.sh)")
    target = TargetSpec(args.target or str(results / "target"))
    prompts = read_benchmark_prompts(str(prompts_file))[: args.num_prompts]
    cfg = {**section_defaults("benchmark"), "device": "cuda", "dtype": "bfloat16", "max_new_tokens": args.max_new_tokens,
           "methods": ["target_greedy", "prompt_lookup", "eagle3_draft"]}
    cfg["num_speculative_tokens"] = resolve_num_speculative_tokens("auto", draft_dir)
    summaries = {}
    with tempfile.TemporaryDirectory() as tmp:
        for graphs in (False, True):
            name = "CUDA graphs" if graphs else "eager"
            summaries[name] = run_offline_benchmark(target, str(draft_dir), prompts, {**cfg, "cuda_graphs": graphs},
                                                    Path(tmp) / f"{name}.csv", Path(tmp) / f"{name}.json", args.variant)
    k = cfg["num_speculative_tokens"]
    caption = (f"Offline benchmark loops, eager vs CUDA graphs, {len(prompts)} prompts of {prompts_file}, "
               f"{args.max_new_tokens} new tokens at most, k = {k}, bf16, batch 1, on {torch.cuda.get_device_name(0)}; "
               f"{time.strftime('%Y-%m-%d')}.")
    lines = [caption, "",
             "| steps | method | acceptance length | tokens/s | speedup | c | tau / (1 + k c) | graphs vs eager |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, summary in summaries.items():
        for method, stats in summary["methods"].items():
            costs = stats.get("step_costs")
            bound = f"{costs['cost_ratio']:.3f} | {stats['ideal_speedup']:.2f}" if costs else " | "
            ratio = stats["tokens_per_s"] / summaries["eager"]["methods"][method]["tokens_per_s"]
            lines.append(f"| {name} | {method} | {stats['acceptance_length']:.2f} | {stats['tokens_per_s']:.1f} | "
                         f"{stats['speedup']:.2f} | {bound} | {ratio:.2f} |")
    table = "\n".join(lines) + "\n"
    write_table(args.table, table, summaries)


if __name__ == "__main__":
    main()

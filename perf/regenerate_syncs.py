"""Where the batched decoder's loop makes the host wait for the GPU: one regenerate-sized `generate` call (SmolLM2,
regenerate's GPU settings: ragged attention where Triton runs, compiled token choice and RMSNorm/MLP, a look every
16 steps) under torch.cuda.set_sync_debug_mode("warn"), each synchronizing call counted by the Python lines that
led to it. The loop's own waits (`Look.read`: an event's synchronize) do not show; a blocking copy, `.item()`,
`.tolist()` of a device tensor or `nonzero()` does.

    python perf/regenerate_syncs.py --prompts 1024 --table out.md
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from regenerate_throughput import load_smollm2, real_prompts  # noqa: E402

from draftsmith.decoding.batch import BatchDecoder  # noqa: E402
from draftsmith.decoding.ragged_attention import ragged_attention_available  # noqa: E402
from draftsmith.decoding.sampling import Sampling  # noqa: E402
from draftsmith.io import write_text  # noqa: E402
from draftsmith.target_model.spec import stop_token_ids  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[1])


def caller(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frames of draftsmith and of the library it called into, as `file:line` (the path shortened)."""
    ours = [f for f in stack if f.filename.startswith(ROOT) and "perf/" not in f.filename]
    lines = [f"{Path(f.filename).name}:{f.lineno} {f.line}" for f in ours[-2:]]
    below = [f for f in stack[stack.index(ours[-1]) + 1:]] if ours else stack[-2:]
    lines += [f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.line}" for f in below[:3]]
    return " <- ".join(reversed(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-dir", default="/tmp/smollm2-target")
    ap.add_argument("--prompts", type=int, default=1024, help="distinct prompts, each answered 3 times")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--table", required=True)
    args = ap.parse_args()
    _, tokenizer, model, _ = load_smollm2(args.target_dir, "cuda")
    stops = sorted(stop_token_ids(tokenizer, model))
    ids = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True) for r in real_prompts(1500)]
    ids = [p for p in ids if len(p) <= 1024][: args.prompts]
    prompts = [p for p in ids for _ in range(3)]
    seeds = list(range(len(prompts)))
    sampling = Sampling(0.7, 0.95)
    decoder = BatchDecoder(model, args.batch, sync_every=16, compile_sampler=True, compile_layers=True,
                           ragged=ragged_attention_available(torch.device("cuda")) is None)
    decoder.generate(prompts[: args.batch], 256, stops, sampling, seeds[: args.batch])  # compile and capture
    found: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        found[caller(traceback.extract_stack()[:-1])] += 1

    before = decoder.counters()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            decoder.generate(prompts, 256, stops, sampling, seeds)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    host = decoder.counters()["host_seconds"] - before["host_seconds"]
    lines = [f"Synchronizing calls in one `generate` of {len(prompts)} answers ({args.prompts} prompts x 3) at batch "
             f"{args.batch} on {torch.cuda.get_device_name()}, ragged {decoder.ragged}; host seconds by part "
             f"{dict(host)}.", "", "| calls | where (innermost first) |", "| ---: | --- |"]
    lines += [f"| {n} | {where} |" for where, n in found.most_common(30)]
    write_text(args.table, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

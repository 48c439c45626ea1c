"""What checking a shard costs: the deep check file by file in one thread (what extraction and each training variant
ran before 2026-12-05), the checksum check on one thread per core (what they run now), the deep check on one thread per
core (`snakemake validate`), and the in-memory check extraction now runs on each sample before writing it.

The shard is written in the real format by the extraction's own writer (draftsmith.extraction.driver.ShardWriter) with
random bf16 states of SmolLM2-135M's width, so the files, their sizes and the checks are the pipeline's; the model
that would have produced the states is left out (the check never looks at where they came from). Side by side in one
run, from the page cache (the files were just written), as after extraction.

    python perf/shard_check_speed.py --samples 400 --tokens 1000 --table perf/results/shard_check_cpu.md
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.extraction.driver import ShardWriter
from draftsmith.extraction.shards import FORMAT, NUM_STATES, check_states, sample_file, serialise_sample, validate_shard
from draftsmith.io import write_text


def write_shard(shard_dir: Path, samples: int, tokens: int, hidden: int) -> tuple[dict, float]:
    """A shard of `samples` files; returns the prepared-samples dict it echoes and the in-memory checks' seconds."""
    writer = ShardWriter(shard_dir, {"perf": "shard_check_speed"})
    generator = torch.Generator().manual_seed(0)
    ids = {"input_ids": [], "sample_id": []}
    checking = 0.0
    for index in range(samples):
        states = [torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16) for _ in range(NUM_STATES)]
        start = time.perf_counter()
        check_states(states, f"{shard_dir}: {sample_file(index)}", tokens, dtype=torch.bfloat16)
        checking += time.perf_counter() - start
        token_ids = [(index + t) % 49152 for t in range(tokens)]
        ids["input_ids"].append(token_ids)
        ids["sample_id"].append(f"s{index}")
        writer.write(index, f"s{index}", serialise_sample(token_ids, [1] * tokens, states), tokens, tokens)
    manifest = {"format": FORMAT, "shard": 0, "num_shards": 1, "hidden_size": hidden, "num_states": NUM_STATES,
                "dtype": "bfloat16", "num_samples": samples, "num_tokens": samples * tokens}
    writer.finish(manifest, list(range(samples)))
    return ids, checking


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--tokens", type=int, default=1000, help="tokens per sample")
    ap.add_argument("--hidden", type=int, default=576, help="hidden size (SmolLM2-135M's 576)")
    ap.add_argument("--dir", default=None, help="where to write the shard (default: a temporary folder)")
    ap.add_argument("--table", required=True, help="the markdown table to write")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        shard = Path(tmp) / "shard_0"
        samples, in_memory = write_shard(shard, args.samples, args.tokens, args.hidden)
        gigabytes = sum(p.stat().st_size for p in shard.glob("data_*.pt")) / 1e9
        rows = [{"check": "in memory, before each write (extraction now; summed over the samples)",
                 "seconds": in_memory}]
        for name, deep, workers in [
            ("deep, file by file, one thread (extraction and each training variant before)", True, 1),
            ("checksums, one thread per core (extraction and training now)", False, None),
            ("deep, one thread per core (snakemake validate)", True, None),
        ]:
            start = time.perf_counter()
            validate_shard(shard, samples, deep=deep, workers=workers)
            rows.append({"check": name, "seconds": time.perf_counter() - start})
    table = pd.DataFrame(rows)
    table["GB/s"] = gigabytes / table["seconds"]
    before = table["seconds"][1]
    table["vs before"] = [f"{before / s:.1f}x" for s in table["seconds"]]
    text = (f"{args.samples} samples x {args.tokens} tokens x {NUM_STATES} x {args.hidden} bf16: {gigabytes:.2f} GB "
            f"of files; {os.cpu_count()} cores, torch {torch.__version__}\n\n"
            + table.round(3).to_markdown(index=False) + "\n")
    print(text)
    write_text(args.table, text)


if __name__ == "__main__":
    main()

"""Online against offline hidden states, and the two `training.compile` settings, side by side on one finished run.

Each run trains the draft for one epoch with draftsmith's own `run_training`, in a fresh process with empty compile
caches (Inductor's and Triton's: cold, as on a bare machine), on the same samples in the same order: offline from the
run's shards, online from its prepared samples with the target computing the states per batch, loaded ahead in a
thread (`online`) or in the training loop (`online-serial`, the loading before draftsmith.training.prefetch). Runs
that are all online need no shards (a run with `training.hidden_states: online` writes none). Per run: seconds from
the start of training (the process's call, target and draft loading included) to the first optimizer step, steady
tokens/s (median step), the epoch's wall seconds, and the graphs torch.compile built.

    python -m perf online_training --results results-gpu --table perf/results/online_training_h100_<date>.md
    python -m perf online_training --results results-smollm2 --runs online:attention,online-serial:attention \
        --data-fraction 0.1 --table ...

GPU only for the compile settings (a CPU compiles nothing); the online/offline comparison also runs on a CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from draftsmith.io import read_json
from perf.common import commit, parser, write_table

RUNS = [("offline", "forward"), ("offline", "attention"), ("online", "attention"), ("online", "forward")]
PREFETCH = {"online": None, "online-serial": 0, "offline": None}  # None: the source's own depth


def one_run(spec: dict) -> dict:
    """One training run in this process (the child): its timings as a dict."""
    import logging

    import torch

    from draftsmith.compiling import compile_totals
    from draftsmith.training.sources import OnlineStates, ShardStates
    from draftsmith.training.trainer import run_training

    times: list[float] = []

    class Steps(logging.Handler):
        def emit(self, record):
            if isinstance(record.msg, dict) and "train" in record.msg:
                times.append(time.perf_counter())

    logging.basicConfig(level=logging.INFO)
    logging.getLogger("speculators.metrics").addHandler(Steps())
    online = spec["states"].startswith("online")
    source = OnlineStates(spec["samples"], spec["online"]) if online else ShardStates(spec["manifests"])
    args = {"states": source.to_dict(), "d2t": spec["d2t"], "t2d": spec["t2d"], "target": spec["target"],
            "training": {**spec["training"], "compile": spec["compile"], "hidden_states": source.mode},
            "prefetch_batches": PREFETCH[spec["states"]],
            "state_dir": spec["state_dir"], "variant": "bench", "gpus": 1 if torch.cuda.is_available() else 0,
            "num_workers": 8 if torch.cuda.is_available() else 0}
    start = time.perf_counter()
    run_training(args)
    wall = time.perf_counter() - start
    compiled = compile_totals() or {}
    gaps = np.diff(times[3:])
    return {"first_step_s": times[0] - start, "wall_s": wall, "steps": len(times),
            "steady_steps_per_s": float(1 / np.median(gaps)) if len(gaps) else None,
            "graphs_compiled": compiled.get("compiled"), "compile_s": compiled.get("forward_s", 0) + compiled.get(
                "backward_s", 0)}


def main(argv=None):
    ap = parser(__doc__, table="online_training")
    ap.add_argument("--results", required=True, help="a finished run's results tree (shards, prepared, vocab, target)")
    ap.add_argument("--total-seq-length", type=int, default=8192)
    ap.add_argument("--runs", default=",".join(f"{s}:{c}" for s, c in RUNS),
                    help="states:compile pairs, in order (default: all four); states: offline, online, online-serial")
    ap.add_argument("--data-fraction", type=float, default=1.0, help="train on this seeded fraction of the samples")
    ap.add_argument("--dtype", default="bfloat16", help="online states' dtype where no shard says it")
    ap.add_argument("--one", help="internal: run one spec (JSON) in this process and print its result")
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one_run(json.loads(args.one))), flush=True)
        return
    from draftsmith.target_model.spec import TargetSpec

    results = Path(args.results)
    manifests = sorted(str(p) for p in results.glob("shards/*/shard_*/manifest.json"))
    samples = sorted(str(p) for p in results.glob("prepared/*/samples.parquet"))
    offline_asked = any(pair.startswith("offline") for pair in args.runs.split(","))
    if not samples or (offline_asked and not manifests):
        sys.exit(f"{results}: no prepared samples, or no shards for the offline runs; run the workflow there first")
    first = read_json(manifests[0]) if manifests else {}
    target = TargetSpec(str(results / "target"))
    hf = first.get("hf", {})  # the extraction settings the shards were made with (else extraction's defaults)
    online = {"aux_layer_ids": first.get("aux_layer_ids"), "dtype": first.get("dtype", args.dtype),
              "batch_tokens": hf.get("batch_tokens", 65536), "max_batch_size": hf.get("max_batch_size", 256)}
    training = {"draft_layers": 1, "ttt_steps": 3, "ttt_step_loss_decay": 1.0, "lr": 3e-4, "epochs": 1,
                "total_seq_length": args.total_seq_length, "scheduler": "linear", "warmup_steps": None,
                "noise_std": 0.05, "val_fraction": 0.02, "data_fraction": args.data_fraction, "seed": 0, "resume": False, "gpus": 1,
                "tf32": True}
    rows = []
    device = None
    for pair in args.runs.split(","):
        states, compile_setting = pair.split(":")
        with tempfile.TemporaryDirectory() as tmp:
            spec = {"states": states, "compile": compile_setting, "manifests": manifests, "samples": samples,
                    "online": online, "d2t": str(results / "vocab" / "d2t.npy"), "t2d": str(results / "vocab" / "t2d.npy"),
                    "target": target.to_dict(), "training": training, "state_dir": str(Path(tmp) / "state")}
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor"),
                   "TRITON_CACHE_DIR": str(Path(tmp) / "triton")}
            proc = subprocess.run([sys.executable, "-m", "perf", "online_training", "--results", str(results),
                                   "--one", json.dumps(spec)], env=env, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
            rows.append({"states": states, "compile": compile_setting, "error": proc.stderr.strip().splitlines()[-1:]})
            continue
        rows.append({"states": states, "compile": compile_setting, **json.loads(lines[-1][7:])})
        if device is None:
            import torch

            device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
        table = [f"Draft training, one epoch per run, each in a fresh process with empty compile caches, on {results} "
                 f"({len(manifests)} shards, data_fraction {args.data_fraction}), total_seq_length "
                 f"{args.total_seq_length}, 3 TTT steps; {device}; "
                 f"{time.strftime('%Y-%m-%d')}; commit {commit()}. Online: the target ({target.model}) computes the "
                 f"states per batch (dtype {online['dtype']}, batch_tokens {online['batch_tokens']}).", "",
                 "| hidden states | training.compile | first optimizer step s | steady steps/s | packed tokens/s | "
                 "epoch wall s | steps | graphs compiled | compile s |",
                 "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            if "error" in r:
                table.append(f"| {r['states']} | {r['compile']} | failed: {r['error']} | | | | | | |")
                continue
            sps = r["steady_steps_per_s"]  # None: too few steps to tell
            steady = (f"{sps:.2f} | {sps * args.total_seq_length:,.0f}" if sps else "n/a | n/a")
            table.append(f"| {r['states']} | {r['compile']} | {r['first_step_s']:.1f} | {steady} | {r['wall_s']:.1f} | "
                         f"{r['steps']} | {r['graphs_compiled']} | {r['compile_s']:.1f} |")
        write_table(args.table, "\n".join(table) + "\n", {"rows": rows, "device": device, "commit": commit(),
                                                         "results": str(results), "online": online})


if __name__ == "__main__":
    main()

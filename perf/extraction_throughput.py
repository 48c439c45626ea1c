"""Hidden-state extraction throughput: draftsmith's batched hf backend vs a batch-size-1 loop.

All run in one process on the same samples and write the same files to the same disk; the
batched backend also runs its previous path (`PreviousPathExtractor`), alternating with the
current one, so that the change is measured side by side. The
limit is the larger of two floors: prefill FLOPs over the measured matmul rate, and bytes
written over the measured write bandwidth (with fsync) of the output disk.

    python -m perf extraction_throughput --preset reference --device cuda --out-dir /tmp/x
    python -m perf extraction_throughput --preset embedded ...   # the embedded default's size, on CPU
    ... --profile /tmp/extraction_profile.txt   # then one more batched run under torch.profiler + cProfile
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.devices import resolve_device, resolve_dtype
from draftsmith.extraction.driver import extract_shard
from draftsmith.extraction.hf_backend import BatchStates, HFBackend, HFHiddenStateExtractor
from draftsmith.extraction.shards import serialise_sample
from draftsmith.io import sha256_bytes, write_text
from draftsmith.provenance import package_versions
from draftsmith.target_model.layers import default_aux_layer_ids
from draftsmith.target_model.spec import TargetSpec
from perf.common import commit, parser, write_table

PRESETS = {
    # DESIGN.md's reference: 24 layers, hidden 1024, 443M parameters, 192 sequences of 256-2048 tokens
    "reference": dict(layers=24, hidden=1024, intermediate=4096, heads=16, kv_heads=8, vocab=32000,
                      num_seqs=192, min_len=256, max_len=2048, batch_tokens=65536, max_batch=64),
    # the embedded default's target and sample lengths
    "embedded": dict(layers=8, hidden=128, intermediate=384, heads=4, kv_heads=2, vocab=1024,
                     num_seqs=256, min_len=30, max_len=160, batch_tokens=2048, max_batch=64),
}


class PreviousPathExtractor(HFHiddenStateExtractor):
    """The batched path before 2026-12-03 (the baseline row): a dense padding mask passed to the model, one
    batch-sized pinned host buffer per batch, and a clone per sample in the writer threads."""

    @torch.inference_mode()
    def forward(self, batch_ids):
        max_len = max(len(ids) for ids in batch_ids)
        input_ids = torch.zeros(len(batch_ids), max_len, dtype=torch.long)
        attention_mask = torch.zeros(len(batch_ids), max_len, dtype=torch.long)
        for row, ids in enumerate(batch_ids):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
        self._captured.clear()
        self.decoder(input_ids=input_ids.to(self.device, non_blocking=True),
                     attention_mask=attention_mask.to(self.device, non_blocking=True), use_cache=False)
        return torch.stack([self._captured[k] for k in self.layer_keys])

    def to_host(self, states, indices, lengths):
        if self.device.type != "cuda":
            return super().to_host(states, indices, lengths)
        host = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
        host.copy_(states, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return BatchStates(indices, [host[:, row, :n] for row, n in enumerate(lengths)], owned=False, ready=ready)


def make_target(p: dict, path: Path) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"],
                         num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
                         max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return sum(t.numel() for t in model.parameters())


def matmul_tflops(device: torch.device, dtype: torch.dtype) -> float:
    n = 8192 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 50 if device.type == "cuda" else 5
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def write_bandwidth(directory: Path, total_bytes: int) -> float:
    """Bytes/s writing `total_bytes` in 64 MiB files with fsync, like the shard writers."""
    block = os.urandom(64 << 20)
    start = time.perf_counter()
    written = 0
    i = 0
    while written < total_bytes:
        with open(directory / f"bw_{i}.bin", "wb") as f:
            f.write(block)
            f.flush()
            os.fsync(f.fileno())
        written += len(block)
        i += 1
    seconds = time.perf_counter() - start
    for p in directory.glob("bw_*.bin"):
        p.unlink()
    return written / seconds


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batch1_loop(extractor, samples, out: Path) -> float:
    """The naive loop: one sample per forward, copied and written before the next starts."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for i, ids in enumerate(samples["input_ids"]):
        states = extractor.sample_states(ids)
        data = serialise_sample(ids, samples["loss_mask"][i], states)
        sha256_bytes(data)
        with open(out / f"data_{i}.pt", "wb") as f:
            f.write(data)
    sync(extractor.device)
    return time.perf_counter() - start


def profile_batched(run, device: torch.device, path: Path) -> None:
    """One more batched extraction under torch.profiler (operators, CPU and GPU time) and cProfile (the
    main thread's Python: batching, copies, serialisation, hashing, waiting on the writers)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    py = cProfile.Profile()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        py.enable()
        run()
        py.disable()
        sync(device)
    wall = time.perf_counter() - start
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    stats = io.StringIO()
    pstats.Stats(py, stream=stats).sort_stats("cumulative").print_stats(30)
    write_text(path, f"profiled batched run: {wall:.2f} s wall (profiler overhead included)\n\n"
               f"== torch.profiler, top operators by {sort} ==\n"
               f"{prof.key_averages().table(sort_by=sort, row_limit=25)}\n"
               f"== torch.profiler, top operators by self_cpu_time_total ==\n"
               f"{prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=15)}\n"
               f"== cProfile of the main thread, by cumulative time ==\n{stats.getvalue()}")
    print(f"profile written to {path}")


def main(argv=None):
    ap = parser(__doc__, table="extraction")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="reference")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out-dir", default=None, help="where shards are written (the disk under test)")
    ap.add_argument("--num-seqs", type=int, default=None)
    ap.add_argument("--profile", default=None, help="write where the batched run's time goes to this file")
    ap.add_argument("--rounds", type=int, default=2, help="batched runs per path (the fastest is reported)")
    args = ap.parse_args(argv)
    p = dict(PRESETS[args.preset])
    if args.num_seqs:
        p["num_seqs"] = args.num_seqs
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    work = Path(args.out_dir or tempfile.mkdtemp(prefix="extract-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    target = work / "target"
    params = make_target(p, target)

    rng = random.Random(0)
    lengths = [rng.randint(p["min_len"], p["max_len"]) for _ in range(p["num_seqs"])]
    samples = {"sample_id": [f"s{i}" for i in range(len(lengths))],
               "input_ids": [[rng.randrange(p["vocab"]) for _ in range(n)] for n in lengths],
               "loss_mask": [[1] * n for n in lengths]}
    tokens = sum(lengths)
    aux = default_aux_layer_ids(p["layers"])
    extractor = HFHiddenStateExtractor(str(target), aux, device=str(device), dtype=args.dtype)

    # warm-up (kernels, allocator) on a few samples, not timed
    extractor.forward(samples["input_ids"][:4])
    sync(device)

    t_batch1 = batch1_loop(extractor, samples, work / "batch1")
    shutil.rmtree(work / "batch1")
    cfg = {"device": str(device), "dtype": args.dtype, "batch_tokens": p["batch_tokens"], "max_batch_size": p["max_batch"],
           "writer_threads": 8 if device.type == "cuda" else 2}
    backends = {"current": HFBackend(TargetSpec(str(target)), aux, cfg, extractor=extractor),
                "previous": HFBackend(TargetSpec(str(target)), aux, cfg,
                                      extractor=PreviousPathExtractor(str(target), aux, device=str(device), dtype=args.dtype))}
    seconds: dict[str, list[float]] = {"previous": [], "current": []}
    for _ in range(args.rounds):  # alternating, so that both paths see the same machine state
        for name in ("previous", "current"):
            start = time.perf_counter()
            manifest = extract_shard(samples, "bench", 0, 1, work / "batched", backends[name], {"path": str(target)})
            seconds[name].append(time.perf_counter() - start)
            if name == "current":
                bytes_written = sum(e["bytes"] for e in manifest["samples"])
            shutil.rmtree(work / "batched")
    print("batched runs, seconds:", json.dumps({k: [round(x, 3) for x in v] for k, v in seconds.items()}))
    t_previous, t_batched = min(seconds["previous"]), min(seconds["current"])
    backend = backends["current"]

    if args.profile:
        profile_batched(lambda: extract_shard(samples, "bench", 0, 1, work / "profiled", backend, {"path": str(target)}),
                        device, Path(args.profile))
        shutil.rmtree(work / "profiled")

    tflops = matmul_tflops(device, dtype)
    bandwidth = write_bandwidth(work, min(bytes_written, 4 << 30))
    # prefill FLOPs: 2 per parameter per token for the decoder (no lm_head), plus attention 4*L*hidden*len per token
    decoder_params = params - 2 * p["vocab"] * p["hidden"]
    flops = sum(2 * decoder_params * n + 4 * p["layers"] * p["hidden"] * n * n / 2 for n in lengths)
    t_compute, t_disk = flops / (tflops * 1e12), bytes_written / bandwidth
    limit = tokens / max(t_compute, t_disk)

    rows = [
        ("batch-size-1 loop", tokens / t_batch1, t_batch1),
        ("hf backend, previous path (padding mask, batch buffer, clones)", tokens / t_previous, t_previous),
        ("draftsmith hf backend (batched, async writes)", tokens / t_batched, t_batched),
    ]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    lines = [
        f"Extraction throughput, preset `{args.preset}`: {p['layers']} layers, hidden {p['hidden']}, "
        f"{params / 1e6:.1f}M parameters, {p['num_seqs']} sequences of {p['min_len']}-{p['max_len']} tokens "
        f"({tokens} tokens), 4 states per token, {dtype}, on {device_name}; "
        f"{time.strftime('%Y-%m-%d')}; commit {commit()}; torch {package_versions().get('torch')}",
        "",
        "| method | tokens/s | seconds | vs batch-1 | vs limit |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, tps, secs in rows:
        lines.append(f"| {name} | {tps:,.0f} | {secs:.2f} | {tps / rows[0][1]:.2f}x | {tps / limit:.0%} |")
    lines += [
        f"| limit: max(compute floor, disk floor) | {limit:,.0f} | {tokens / limit:.2f} | {limit / rows[0][1]:.2f}x | 100% |",
        "",
        f"Compute floor {tokens / t_compute:,.0f} tokens/s ({flops / 1e12:.1f} TFLOP at a measured {tflops:.1f} TFLOP/s); "
        f"disk floor {tokens / t_disk:,.0f} tokens/s ({bytes_written / 1e9:.2f} GB at a measured "
        f"{bandwidth / 1e9:.2f} GB/s with fsync). Batched rows: the fastest of {args.rounds} alternating runs per path "
        f"(all: previous {', '.join(f'{x:.2f}' for x in seconds['previous'])} s; "
        f"current {', '.join(f'{x:.2f}' for x in seconds['current'])} s); current vs previous {t_previous / t_batched:.2f}x.",
    ]
    table = "\n".join(lines) + "\n"
    write_table(args.table, table, {
        "preset": args.preset, "tokens": tokens, "batch1_tps": rows[0][1], "previous_path_tps": rows[1][1], "batched_tps": rows[2][1],
        "batched_seconds": seconds, "limit_tps": limit,
        "matmul_tflops": tflops, "write_gbps": bandwidth / 1e9, "device": device_name, "commit": commit()})


if __name__ == "__main__":
    main()

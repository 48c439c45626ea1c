"""One layer's decode attention at a large batch: the ragged Triton kernel (draftsmith.decoding.ragged_attention) at
several launch settings beside SDPA over the common span (the decoder's `grouped_sdpa`), on random cache contents of
SmolLM2-135M's shape (9 query heads, 3 KV heads, head size 64), each timed as a CUDA graph of `--calls` calls.

Scenes: every row filling `span` slots (the cost per slot: the kernel's against SDPA's), and the mix the eighteenth
session measured on real prompts at batch 2048 (74% of rows busy, filling 210 slots on average, uniform 1..420;
the free rows one slot each; SDPA reading the runs' mean span, 700). Each row's output is checked against SDPA's.

    python perf/ragged_attention_bench.py --table out.md --out-json out.json
"""

from __future__ import annotations

import argparse
import sys
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.decoding.batch_kv import grouped_sdpa, row_mask  # noqa: E402
from draftsmith.decoding.ragged_attention import ragged_decode_attention  # noqa: E402
from draftsmith.io import write_json, write_text  # noqa: E402


def graph_ms(fn, calls: int, repeats: int = 5) -> float:
    """Median ms of one call of `fn`, replayed `calls` times in a CUDA graph (no launch overhead)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def scenes(rows: int, length: int, spans: list[int], device) -> list[tuple[str, torch.Tensor, int]]:
    """(name, bounds [rows, 2], SDPA's span) per scene."""
    out = []
    starts = torch.randint(0, 32, (rows,), device=device)  # left padding, as refills leave it
    for span in spans:
        out.append((f"every row fills {span} slots", torch.stack((starts, torch.full_like(starts, span - 1)), -1), span))
    gen = torch.Generator(device="cpu").manual_seed(0)
    busy = torch.rand(rows, generator=gen) < 0.74
    fill = torch.randint(1, 421, (rows,), generator=gen)
    first = torch.randint(0, 32, (rows,), generator=gen)
    last = torch.where(busy, first + fill - 1, first).clamp(max=length - 1)
    mixed = torch.stack((first, last), -1).to(device)
    out.append(("measured mix: 74% busy, 210 slots each (SDPA: span 700)", mixed, min(700, length)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--length", type=int, default=1280, help="cache slots per row")
    ap.add_argument("--spans", default="256,768")
    ap.add_argument("--configs", default="64x4,32x4,128x4,64x2,64x8,128x8",
                    help="kernel launch settings, slots per tile x warps")
    ap.add_argument("--calls", type=int, default=30, help="calls per graph (one step's layers)")
    ap.add_argument("--out-json", required=True)
    ap.add_argument("--table", required=True)
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    heads, kv_heads, dim = 9, 3, 64
    torch.manual_seed(0)
    query = torch.randn(args.rows, 1, heads, dim, device=device, dtype=dtype).transpose(1, 2)
    key = torch.randn(args.rows, kv_heads, args.length, dim, device=device, dtype=dtype)
    value = torch.randn(args.rows, kv_heads, args.length, dim, device=device, dtype=dtype)
    scale = dim ** -0.5
    slot_bytes = 2 * kv_heads * dim * key.element_size()  # K and V of one slot
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    results = []
    with torch.inference_mode():
        for name, bounds, span in scenes(args.rows, args.length, [int(s) for s in args.spans.split(",")], device):
            bounds = bounds.contiguous()
            needed = int((bounds[:, 1] - bounds[:, 0] + 1).sum()) * slot_bytes
            mask = row_mask(bounds[:, 1:2], bounds[:, 0], span)
            want = grouped_sdpa(None, query, key[:, :, :span], value[:, :, :span], mask, scaling=scale)[0]
            ms = graph_ms(lambda: grouped_sdpa(None, query, key[:, :, :span], value[:, :, :span], mask, scaling=scale),
                          args.calls)
            results.append({"scene": name, "path": f"SDPA over span {span}", "ms": ms, "needed_bytes": needed,
                            "read_bytes": args.rows * span * slot_bytes, "max_diff": 0.0})
            print(results[-1])
            for block, warps in configs:
                got = ragged_decode_attention(query, key, value, bounds, scale, block, warps)
                diff = (got.float() - want.float()).abs().max().item()
                ms = graph_ms(lambda: ragged_decode_attention(query, key, value, bounds, scale, block, warps),  # noqa: B023
                              args.calls)
                results.append({"scene": name, "path": f"ragged kernel, {block} slots x {warps} warps", "ms": ms,
                                "needed_bytes": needed, "read_bytes": needed, "max_diff": diff})
                print(results[-1])
    device_name = torch.cuda.get_device_name()
    head = (f"One layer's decode attention, {args.rows} rows, {heads} query / {kv_heads} KV heads of {dim}, bfloat16, "
            f"{args.length}-slot cache, on {device_name}; {date.today().isoformat()}. GB/s: the slots each row needs "
            f"(K and V) per second; max diff: against SDPA's output.\n\n")
    lines = ["| scene | path | us per layer | x 30 layers, ms | needed GB/s | max diff |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r['scene']} | {r['path']} | {1e3 * r['ms']:.1f} | {30 * r['ms']:.2f} | "
                     f"{r['needed_bytes'] / r['ms'] / 1e6:,.0f} | {r['max_diff']:.1e} |")
    write_text(args.table, head + "\n".join(lines) + "\n")
    write_json(args.out_json, {"date": date.today().isoformat(), "device": device_name, "rows": args.rows,
                               "length": args.length, "results": results})
    print(head + "\n".join(lines))


if __name__ == "__main__":
    main()

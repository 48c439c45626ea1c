"""Timings of the real SmolLM2-135M-Instruct target on this CPU, to size the real-model demo.

(a) import: GGUF -> safetensors directory (draftsmith.gguf_target.import_gguf_target)
(b) hidden-state extraction forward: draftsmith's HFHiddenStateExtractor (pre-hooks on vLLM's default
    auxiliary layers + final norm), right-padded batches planned by plan_batches(batch_tokens)
(c) batched greedy `generate` (left padding) for self-distillation: raw tokens/s with eos ignored,
    and useful tokens/s on the real training prompts stopping at <|im_end|>
(d) target-only greedy decode at batch size 1 (draftsmith.benchmark.spec_decode.greedy_decode) on MT-Bench

Each row records wall seconds and the process's CPU seconds; on a shared machine the load average
is printed beside it. With more runnable threads than cores, torch's OpenMP regions wait for
preempted threads at every op: there 1 thread (--threads 1) runs several times faster than 2.

    python perf/smollm2_cpu_timings.py --table perf/results/smollm2_cpu_timings.md
    python perf/smollm2_cpu_timings.py --target /tmp/smol_target ...   # skip (a), reuse an imported dir
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.data import mtbench  # noqa: E402
from draftsmith.io import write_text  # noqa: E402
from draftsmith.target_model.gguf import END_OF_TURN, import_gguf_target  # noqa: E402

ROWS: list[dict] = []
OUT: dict = {}  # "table" path and "header", set by main: the table is rewritten after every row


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


class Timer:
    def __enter__(self):
        self.load0 = load()
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.c0
        self.load1 = load()


def record(stage: str, setting: str, tokens: int | None, t: Timer, note: str = "") -> None:
    row = {"stage": stage, "setting": setting, "tokens": tokens, "wall_s": round(t.wall, 2), "cpu_s": round(t.cpu, 2),
           "tokens_per_s": round(tokens / t.wall, 1) if tokens else None,
           "tokens_per_cpu_s": round(tokens / t.cpu, 1) if tokens else None, "load": f"{t.load0} -> {t.load1}",
           "note": note}
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    if OUT:
        write_text(OUT["table"], OUT["header"] + table())
        Path(OUT["table"]).with_suffix(".json").write_text(json.dumps(ROWS, indent=1) + "\n")


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def extraction_sequences(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """`n` real-text token sequences of lengths uniform in [lo, hi]: MT-Bench turns, rendered as chats, concatenated."""
    rng = random.Random(seed)
    texts = [t for q in mtbench.load_questions() for t in q["turns"]]
    stream: list[int] = []
    while len(stream) < n * hi:
        stream += tokenizer.apply_chat_template([{"role": "user", "content": rng.choice(texts)},
                                                 {"role": "assistant", "content": rng.choice(texts)}])
    out, pos = [], 0
    for _ in range(n):
        length = rng.randint(lo, hi)
        out.append(stream[pos: pos + length])
        pos += length
    return out


def time_extraction(target: str, batch_tokens_list: list[int], n: int) -> None:
    from transformers import AutoTokenizer

    from draftsmith.extraction.hf_backend import HFHiddenStateExtractor, plan_batches
    from draftsmith.target_model.layers import default_aux_layer_ids

    tokenizer = AutoTokenizer.from_pretrained(target)
    ex = HFHiddenStateExtractor(target, default_aux_layer_ids(30), device="cpu", dtype="float32")
    seqs = extraction_sequences(tokenizer, n, 200, 400)
    ex.forward([seqs[0][:64]])  # warm-up
    for bt in batch_tokens_list:
        batches = plan_batches([len(s) for s in seqs], bt, 64)
        with Timer() as t:
            for b in batches:
                ex.forward([seqs[i] for i in b])
        record("(b) extraction forward", f"batch_tokens {bt}, {n} seqs of 200-400 tokens, {len(batches)} batches, "
               f"layers {ex.aux_layer_ids}+final", sum(map(len, seqs)), t)


def left_pad(batch: list[list[int]], pad: int):
    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, s in enumerate(batch):
        ids[r, width - len(s):] = torch.tensor(s)
        mask[r, width - len(s):] = 1
    return ids, mask


def time_stop_at_end_of_turn(model, prompts: list[list[int]], eot: int, max_new: int, batch: int, what: str) -> None:
    """Greedy answers to `prompts` that stop at <|im_end|>, counting the useful tokens (up to it) only."""
    ids, mask = left_pad(prompts, eot)
    with Timer() as t:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=eot, eos_token_id=eot)
    new = out[:, ids.shape[1]:]
    useful = int(sum(((row == eot).nonzero()[0, 0] + 1) if (row == eot).any() else len(row) for row in new))
    record("(c) generate, stop at <|im_end|>", f"batch {batch}, max_new_tokens {max_new}, {what} "
           f"(mean answer {useful / batch:.0f} tok, {new.shape[1]} steps)", useful, t, "useful tokens only")


@torch.inference_mode()
def time_generation(model, tokenizer, batch_sizes: list[int], new_tokens: list[int], real_batches: list[int],
                    real_new: int) -> None:
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    mt = [chat_ids(tokenizer, q["turns"][0]) for q in mtbench.load_questions()]
    train = [chat_ids(tokenizer, p["messages"][0]["content"]) for p in mtbench.training_prompts()]
    model.generate(*[left_pad(mt[:2], eot)[0]], max_new_tokens=4, do_sample=False, pad_token_id=eot)  # warm-up
    for b in batch_sizes:
        for m in new_tokens:
            ids, mask = left_pad(mt[:b], eot)
            with Timer() as t:
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=m, min_new_tokens=m,
                                     do_sample=False, pad_token_id=eot)
            gen = out.shape[1] - ids.shape[1]
            record("(c) generate, eos ignored", f"batch {b}, max_new_tokens {m}, MT-Bench prompts "
                   f"(prompt {int(mask.sum(1).float().mean())} tok avg)", b * gen, t)
    for b in real_batches:
        prompts = train[:b] if b <= len(train) else train
        time_stop_at_end_of_turn(model, prompts, eot, real_new, len(prompts), "training prompts")
        time_stop_at_end_of_turn(model, mt[:b], eot, real_new, b, "MT-Bench first turns")


def time_batch1(model, tokenizer, n: int, max_new: int) -> None:
    from draftsmith.benchmark.spec_decode import TargetModel, greedy_decode

    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    questions = mtbench.select_questions(mtbench.load_questions(), per_category=1)[:n]
    target = TargetModel(model)
    greedy_decode(target, chat_ids(tokenizer, "Hi"), 4, {eot})  # warm-up
    tokens = 0
    with Timer() as t:
        for q in questions:
            tokens += len(greedy_decode(target, chat_ids(tokenizer, q["turns"][0]), max_new, {eot}).tokens)
    record("(d) target-only greedy, batch 1", f"{n} MT-Bench first turns, max_new_tokens {max_new} "
           f"(mean {tokens / n:.0f} tok)", tokens, t)


def table() -> str:
    head = ("| stage | setting | tokens | wall s | CPU s | tokens/s | tokens/CPU-s | load (1/5/15 min) before -> after |\n"
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |\n")
    cell = lambda x: str(x).replace("|", "\\|")  # noqa: E731  (<|im_end|> inside a table cell)
    lines = [f"| {cell(r['stage'])} | {cell(r['setting'])} | {r['tokens'] or ''} | {r['wall_s']} | {r['cpu_s']} | "
             f"{r['tokens_per_s'] or ''} | {r['tokens_per_cpu_s'] or ''} | {r['load']} |" for r in ROWS]
    return head + "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="an imported target directory (skips the import timing)")
    ap.add_argument("--table", default="perf/results/smollm2_cpu_timings.md")
    ap.add_argument("--stages", default="abcd")
    ap.add_argument("--extract-seqs", type=int, default=24)
    ap.add_argument("--batch-tokens", default="2048,4096")
    ap.add_argument("--gen-batches", default="8,16,32")
    ap.add_argument("--gen-new", default="128,256")
    ap.add_argument("--real-batches", default="16,32")
    ap.add_argument("--real-new", type=int, default=256)
    ap.add_argument("--b1-prompts", type=int, default=4)
    ap.add_argument("--b1-new", type=int, default=128)
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice, one per core)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load {load()}", flush=True)

    OUT["table"] = args.table
    OUT["header"] = (f"SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to fp32) on CPU: torch {torch.__version__}, "
                     f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs (shared with other jobs: see load); "
                     f"{datetime.date.today()}\n\nCommand: `python perf/smollm2_cpu_timings.py {' '.join(sys.argv[1:])}`\n\n")
    tmp = tempfile.TemporaryDirectory(prefix="smollm2-")
    target = args.target
    if "a" in args.stages or target is None:
        with Timer() as t:
            prov = import_gguf_target(Path(tmp.name) / "target")
        record("(a) import GGUF -> safetensors", f"fp32, {prov['num_parameters'] / 1e6:.1f}M params", None, t,
               f"load+dequantise {prov['seconds']['load_dequantise']} s")
        target = target or str(Path(tmp.name) / "target")
    if "b" in args.stages:
        time_extraction(target, ints(args.batch_tokens), args.extract_seqs)
    if "c" in args.stages or "d" in args.stages:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="sdpa").eval()
        if "c" in args.stages:
            time_generation(model, tokenizer, ints(args.gen_batches), ints(args.gen_new), ints(args.real_batches),
                            args.real_new)
        if "d" in args.stages:
            time_batch1(model, tokenizer, args.b1_prompts, args.b1_new)

    print(table())


if __name__ == "__main__":
    main()

"""How long a target's sampled answers run when the limit is far off: the share that regenerate's max_new_tokens
would cut at each limit. Real prompts (Arena-Hard v2.0 and IFEval, Latin-script, at most --max-prompt-tokens, a
seeded sample of each), the target's chat template, transformers' own sampling (temperature and top-p as
regenerate's), one long limit.

    python -m perf answer_lengths --target results/target --per-set 24 --limit 768 \\
        --table perf/results/answer_lengths_cpu_<date>.md

An answer counts as ended at its first stop token (the tokenizer's eos or <|im_end|>); one with none within --limit
counts as cut at every limit listed.
"""

from __future__ import annotations

import random
import time

from perf.common import commit, parser, write_table

LIMITS = (128, 192, 256, 384, 512, 640, 768, 1024)


def main(argv=None):
    ap = parser(__doc__, table="answer_lengths")
    ap.add_argument("--target", required=True, help="a Hugging Face model directory (e.g. a results tree's target/)")
    ap.add_argument("--per-set", type=int, default=24, help="prompts drawn from each of arena_hard and ifeval")
    ap.add_argument("--limit", type=int, default=768)
    ap.add_argument("--batch-size", type=int, default=48)
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are not drawn")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.data.prompt_sets import mostly_latin, prompt_set_file
    from draftsmith.io import iter_jsonl

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    prompts = []
    for name in ("arena_hard", "ifeval"):
        rows = [r["prompt"] for _, r in iter_jsonl(prompt_set_file(name))
                if mostly_latin(r["prompt"]) and len(tokenizer(r["prompt"])["input_ids"]) <= args.max_prompt_tokens]
        prompts += random.Random(args.seed).sample(rows, args.per_set)
    stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")} - {None}
    lengths, start = [], time.perf_counter()
    for i in range(0, len(prompts), args.batch_size):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts[i:i + args.batch_size]]
        encoded = tokenizer(texts, return_tensors="pt", padding=True, return_token_type_ids=False)
        with torch.inference_mode():
            out = model.generate(**encoded, do_sample=True, temperature=args.temperature, top_p=args.top_p,
                                 max_new_tokens=args.limit, pad_token_id=tokenizer.eos_token_id)
        for row in out[:, encoded["input_ids"].shape[1]:].tolist():
            lengths.append(next((j + 1 for j, t in enumerate(row) if t in stops), None))
    ended = sorted(n for n in lengths if n is not None)
    limits = [n for n in LIMITS if n <= args.limit]
    table = [f"{len(lengths)} sampled answers of {args.target} (T {args.temperature}, top-p {args.top_p}, seed "
             f"{args.seed}) to {args.per_set} Arena-Hard and {args.per_set} IFEval prompts, up to {args.limit} new "
             f"tokens; {time.strftime('%Y-%m-%d')}, commit {commit()}, {time.perf_counter() - start:.0f} s. "
             f"Ended: {len(ended)} (lengths {ended}).", "",
             "| max_new_tokens | answers cut |", "| ---: | ---: |"]
    table += [f"| {n} | {sum(x is None or x > n for x in lengths) / len(lengths):.1%} |" for n in limits]
    write_table(args.table, "\n".join(table) + "\n", {"lengths": lengths, "limits": limits, "commit": commit()})


if __name__ == "__main__":
    main()

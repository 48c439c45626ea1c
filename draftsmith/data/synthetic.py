"""Seeded synthetic chat corpus: varied, learnable multi-turn tasks for the embedded default.

Every assistant reply is a deterministic function of the conversation, so a small target
model learns the tasks and a draft model can learn to predict the target. Most replies are
a sentence; three families (greeting cards, times tables, spelling) answer at length (50-130
tokens), as chat answers usually do: on short answers a speculative decoder's speedup is
bounded by the prompt's forward pass, which every method pays once.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from typing import Callable

log = logging.getLogger(__name__)

NAMES = ["Alice", "Bob", "Chen", "Dana", "Emil", "Fatima", "Goran", "Hana", "Ivan", "Julia"]
WORDS = [
    "apple", "river", "stone", "cloud", "green", "table", "music", "light", "paper", "ocean",
    "tiger", "bread", "chair", "dream", "field", "glass", "honey", "island", "jacket", "lemon",
]
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Canada": "Ottawa", "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
    "Poland": "Warsaw", "Chile": "Santiago", "India": "New Delhi", "Greece": "Athens",
}
COLORS = ["red", "blue", "green", "yellow", "purple", "orange"]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer precisely.",
]

Conversation = list[dict[str, str]]


def _exchange(question: str, answer: str) -> Conversation:
    """A user turn and the assistant's reply."""
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _arithmetic(rng: random.Random) -> Conversation:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    conv = _exchange(f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}. The answer is {value}.")
    if rng.random() < 0.6:
        c = rng.randint(1, 20)
        conv += _exchange(f"Now add {c} to that.", f"{value} + {c} = {value + c}. The answer is {value + c}.")
    return conv


def _reverse_words(rng: random.Random) -> Conversation:
    words = rng.sample(WORDS, rng.randint(3, 7))
    return _exchange("Reverse the order of these words: " + " ".join(words),
                     "Here are the words in reverse order: " + " ".join(reversed(words)) + ".")


def _sort_numbers(rng: random.Random) -> Conversation:
    nums = [rng.randint(0, 99) for _ in range(rng.randint(4, 9))]
    order = rng.choice(["ascending", "descending"])
    ordered = sorted(nums, reverse=order == "descending")
    return _exchange(f"Sort these numbers in {order} order: " + ", ".join(map(str, nums)),
                     f"Sorted in {order} order: " + ", ".join(map(str, ordered)) + ".")


def _capital(rng: random.Random) -> Conversation:
    countries = rng.sample(sorted(CAPITALS), 2)
    conv = _exchange(f"What is the capital of {countries[0]}?", f"The capital of {countries[0]} is {CAPITALS[countries[0]]}.")
    if rng.random() < 0.5:
        conv += _exchange(f"And the capital of {countries[1]}?", f"The capital of {countries[1]} is {CAPITALS[countries[1]]}.")
    return conv


def _count_letters(rng: random.Random) -> Conversation:
    word = rng.choice(WORDS)
    return _exchange(f"How many letters are in the word {word}?",
                     f"The word {word} has {len(word)} letters: " + "-".join(word) + ".")


def _uppercase(rng: random.Random) -> Conversation:
    words = rng.sample(WORDS, rng.randint(2, 5))
    text = " ".join(words)
    return _exchange(f"Write this in capital letters: {text}", f"In capital letters: {text.upper()}.")


def _greeting(rng: random.Random) -> Conversation:
    name, color = rng.choice(NAMES), rng.choice(COLORS)
    return _exchange(
        f"Write a short greeting for {name}, whose favourite colour is {color}.",
        f"Hello {name}! It is lovely to meet you. I hear your favourite colour is {color}, "
        f"so I hope your day is as bright as {color} can be. Best wishes, your assistant.",
    )


def _greeting_cards(rng: random.Random) -> Conversation:
    friends = [(name, rng.choice(COLORS)) for name in rng.sample(NAMES, rng.randint(2, 4))]
    cards = [f"Dear {name}, it is lovely to hear from you. Since your favourite colour is {color}, "
             f"I hope your day is as bright as {color} can be." for name, color in friends]
    return _exchange("Write a short greeting card for each of these friends: "
                     + ", ".join(f"{name} ({color})" for name, color in friends) + ".",
                     "\n\n".join(cards) + "\n\nBest wishes, your assistant.")


def _times_table(rng: random.Random) -> Conversation:
    m, n = rng.randint(2, 12), rng.randint(6, 12)
    return _exchange(f"Write out the {m} times table from 1 to {n}.",
                     f"The {m} times table:\n" + "\n".join(f"{i} x {m} = {i * m}" for i in range(1, n + 1)))


def _spell_words(rng: random.Random) -> Conversation:
    words = rng.sample(WORDS, rng.randint(3, 6))
    return _exchange("Spell each of these words letter by letter: " + " ".join(words),
                     "\n".join(f"{word}: " + "-".join(word) + "." for word in words))


def _count_range(rng: random.Random) -> Conversation:
    start = rng.randint(0, 50)
    stop = start + rng.randint(3, 12)
    return _exchange(f"Count from {start} to {stop}.", ", ".join(str(i) for i in range(start, stop + 1)) + ".")


def _multiples(rng: random.Random) -> Conversation:
    m, n = rng.randint(2, 12), rng.randint(3, 8)
    return _exchange(f"List the first {n} multiples of {m}.",
                     f"The first {n} multiples of {m} are " + ", ".join(str(m * i) for i in range(1, n + 1)) + ".")


def _shopping(rng: random.Random) -> Conversation:
    items = rng.sample(WORDS, rng.randint(2, 4))
    prices = [rng.randint(1, 9) for _ in items]
    lines = "\n".join(f"- {item}: {price} dollars" for item, price in zip(items, prices))
    return _exchange("What is the total cost of:\n" + lines,
                     " + ".join(map(str, prices)) + f" = {sum(prices)}. The total cost is {sum(prices)} dollars.")


TASKS: dict[str, Callable[[random.Random], Conversation]] = {
    "arithmetic": _arithmetic,
    "reverse_words": _reverse_words,
    "sort_numbers": _sort_numbers,
    "capital": _capital,
    "count_letters": _count_letters,
    "uppercase": _uppercase,
    "greeting": _greeting,
    "greeting_cards": _greeting_cards,
    "times_table": _times_table,
    "spell_words": _spell_words,
    "count_range": _count_range,
    "multiples": _multiples,
    "shopping": _shopping,
}


def make_record(rng: random.Random, index: int) -> dict:
    task = rng.choice(sorted(TASKS))
    messages = TASKS[task](rng)
    if rng.random() < 0.3:
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] + messages
    return {"id": f"synthetic-{index:06d}", "task": task, "messages": messages}


def generate_corpus(num_records: int, num_heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Return (train, heldout) records; no held-out conversation occurs verbatim in train."""
    if num_records < 1 or num_heldout < 1:
        raise ValueError("synthetic corpus needs at least one train and one held-out record")
    rng = random.Random(seed)
    train = [make_record(rng, i) for i in range(num_records)]
    seen = {repr(r["messages"]) for r in train}
    heldout: list[dict] = []
    index = num_records
    while len(heldout) < num_heldout:
        record = make_record(rng, index)
        index += 1
        if repr(record["messages"]) not in seen:
            seen.add(repr(record["messages"]))
            heldout.append(record)
    log_heldout_mix(heldout)
    return train, heldout


def log_heldout_mix(heldout: list[dict]) -> None:
    """Log the held-out records per task, and warn about tasks with none: benchmarks on the held-out split skip them."""
    per_task = Counter(record["task"] for record in heldout)
    log.info("held-out records per task: %s", ", ".join(f"{task} {n}" for task, n in sorted(per_task.items())))
    missing = sorted(set(TASKS) - set(per_task))
    if missing:
        log.warning("no held-out record of task %s: held-out records must not occur in the train split, and these "
                    "tasks have few distinct conversations, most of them in the train split; benchmarks on the "
                    "held-out prompts leave them out", ", ".join(missing))

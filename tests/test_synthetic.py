import logging

from draftsmith.data.synthetic import TASKS, generate_corpus


def test_corpus_is_seeded_varied_and_heldout_is_disjoint():
    train, heldout = generate_corpus(300, 20, seed=1)
    again, _ = generate_corpus(300, 20, seed=1)
    other, _ = generate_corpus(300, 20, seed=2)
    assert train == again and train != other
    assert len(train) == 300 and len(heldout) == 20
    assert {r["task"] for r in train} == set(TASKS)
    train_convs = {repr(r["messages"]) for r in train}
    assert not any(repr(r["messages"]) in train_convs for r in heldout)
    assert any(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in train), "some records are multi-turn"


def test_answers_are_computed_from_the_question():
    train, _ = generate_corpus(200, 1, seed=0)
    for record in train:
        if record["task"] == "arithmetic":
            question, answer = record["messages"][-2]["content"], record["messages"][-1]["content"]
            if question.startswith("What is"):
                expr = question.removeprefix("What is ").rstrip("?")
                assert answer.startswith(f"{expr} = {eval(expr)}.")  # noqa: S307 - generated digits and + - *


def test_tasks_missing_from_the_heldout_split_are_named(caplog):
    # config/gpu.yaml's corpus: times tables, letter counts and multiples have few distinct conversations, and the
    # train split holds the likely ones, so none of the 96 held-out records is one of them.
    with caplog.at_level(logging.INFO, logger="draftsmith.data.synthetic"):
        _, heldout = generate_corpus(8000, 96, seed=0)
    held_tasks = {r["task"] for r in heldout}
    missing = sorted(set(TASKS) - held_tasks)
    assert {"times_table", "count_letters", "multiples"} <= set(missing)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and ", ".join(missing) in warnings[0]
    assert not any(task in warnings[0] for task in held_tasks)
    counts = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("held-out records per task"))
    assert all(f"{task} {sum(r['task'] == task for r in heldout)}" in counts for task in held_tasks)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="draftsmith.data.synthetic"):
        _, heldout = generate_corpus(20, 200, seed=0)  # a small train split leaves every task some held-out records
    assert {r["task"] for r in heldout} == set(TASKS)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]

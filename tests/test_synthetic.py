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

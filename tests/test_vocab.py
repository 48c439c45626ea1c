import numpy as np
import pytest

from draftsmith.vocab import build_vocab_map, combine_frequencies, coverage_line, save_npy, vocab_coverage


def test_vocab_map_selects_the_most_frequent_tokens_deterministically(tmp_path):
    freq = {5: 100, 9: 50, 2: 50, 7: 1, 11: 30}
    d2t, t2d = build_vocab_map(freq, draft_vocab_size=3, target_vocab_size=16)
    assert d2t.dtype == np.int64 and t2d.dtype == bool and t2d.shape == (16,)
    selected = np.arange(3) + d2t  # draft id i -> target id i + d2t[i]
    assert selected.tolist() == [2, 5, 9]  # top-3 by count, ties by id, sorted
    assert np.flatnonzero(t2d).tolist() == [2, 5, 9]
    again = build_vocab_map(dict(reversed(freq.items())), 3, 16)
    assert np.array_equal(again[0], d2t) and np.array_equal(again[1], t2d)
    save_npy(tmp_path / "d2t.npy", d2t)
    assert np.array_equal(np.load(tmp_path / "d2t.npy"), d2t)


def test_small_frequency_tables_are_filled_with_low_ids():
    d2t, t2d = build_vocab_map({7: 3}, draft_vocab_size=4, target_vocab_size=10)
    assert np.flatnonzero(t2d).tolist() == [0, 1, 2, 7]


def test_combined_frequencies_add_up():
    assert combine_frequencies([{1: 2, 3: 1}, {1: 5, 4: 4}]) == {1: 7, 3: 1, 4: 4}


def test_draft_vocab_larger_than_target_is_a_clear_error():
    with pytest.raises(ValueError, match="draft_vocab_size=32 is larger than the target's vocabulary \\(16\\)"):
        build_vocab_map({1: 1}, 32, 16)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        build_vocab_map({99: 1}, 4, 16)


def test_coverage_is_the_share_of_counted_tokens_the_chosen_vocabulary_holds():
    freq = {5: 100, 9: 50, 2: 50, 7: 1, 11: 30, 3: 9}  # 240 counted tokens
    d2t, t2d = build_vocab_map(freq, draft_vocab_size=3, target_vocab_size=16)
    held = sum(c for t, c in freq.items() if t2d[t])
    assert vocab_coverage(freq, [3]) == {3: pytest.approx(held / 240)} == {3: pytest.approx(200 / 240)}
    assert vocab_coverage(freq, [1, 6, 16]) == {1: pytest.approx(100 / 240), 6: 1.0, 16: 1.0}
    assert coverage_line(freq, 3, 16) == ("draft vocab 3 of 16 target tokens covers 83.33% of assistant tokens "
                                          "(1 would cover 41.67%, 6 would cover 100.00%)")
    assert coverage_line(freq, 16, 16) == ("draft vocab 16 of 16 target tokens covers 100.00% of assistant tokens "
                                           "(8 would cover 100.00%)")

"""Realism diagnostics: pure functions, exact values."""

import math

import pytest

from conversations import TurnRecord
from generator.diagnostics import (
    assistant_likeness_score,
    copy_score,
    distinct_n,
    first_turn_diversity,
    jsonable,
    pair_records,
    realism_diagnostics,
)


def rec(id, text, context=(), is_last=False, **meta):
    return TurnRecord(id=id, context=list(context), user_turn=text, is_last=is_last, meta=meta)


def test_distinct_n():
    assert distinct_n(["a b a", "b c"], 1) == pytest.approx(3 / 5)
    assert distinct_n(["a b a", "b c"], 2) == 1.0
    assert distinct_n(["A, a"], 1) == pytest.approx(2 / 3)  # lower-cased; punctuation is a token
    assert distinct_n([], 1) == 0.0


def test_first_turn_diversity():
    # Jaccard: {a,b}-{a,c} 1/3, {a,b}-{a,b} 1, {a,c}-{a,b} 1/3
    assert first_turn_diversity(["a b", "a c", "A b!"]) == pytest.approx(1 - 5 / 9)
    assert first_turn_diversity(["x y", "z"]) == 1.0
    assert math.isnan(first_turn_diversity(["only one"]))


def test_copy_score():
    ctx = [{"role": "assistant", "content": "One two three four five six seven eight nine."}]
    assert copy_score("one two three four five six seven eight and more words", ctx) == pytest.approx(8 / 11)
    assert copy_score("one two three four five six seven eight nine .", ctx) == 1.0
    assert copy_score("one two three four five six seven", ctx) == 0.0  # shorter than 8 tokens
    assert copy_score("nothing in common here at all , none whatsoever", ctx) == 0.0
    assert copy_score("anything at all here in this long enough turn", []) == 0.0
    assert copy_score("one two three four five six seven eight", "one two three four five six seven eight") == 1.0


@pytest.mark.parametrize(
    "text, score",
    [
        ("As an AI, I cannot browse.", 1.0),
        ("I'd be happy to help with that", 1.0),
        ("Let me know if you have any other questions.", 1.0),
        ("Sure! here you go", 0.5),
        ("Sure! Here is the fix. Feel free to ask more.", 0.75),
        ("Certainly. The answer is 4", 0.5),
        ("Here is a summary of the text", 0.5),
        ("Here is the article: ...", 0.0),  # users paste things too
        ("Here's a revised version of the text with improved style:", 0.5),
        ("here's my code, it crashes", 0.0),
        ("I'm here to assist you with your request.", 1.0),
        ("In fact, I can certainly continue from here.", 0.5),
        ("- apples\n- pears\n- plums", 0.5),
        ("1. install\n2. run\n3. profit\n", 0.5),
        ("- apples\n- pears", 0.0),
        ("# Title", 0.25),
        ("**Note:** this", 0.25),
        ("hey can you fix my code, it crashes", 0.0),
        ("sure, but why?", 0.0),
        ("Make sure to explain", 0.0),
    ],
)
def test_assistant_likeness_score(text, score):
    assert assistant_likeness_score(text) == pytest.approx(score)


def _fixture():
    chat = [{"role": "user", "content": "write a poem about cats"}, {"role": "assistant", "content": "Cats are soft."}]
    real = [
        rec("c1#0", "write a poem about cats"),
        rec("c1#2", "thanks", chat, is_last=True),
        rec("c2#0", "how do I sort a list in python", is_last=True),
    ]
    sim = [
        rec("c1#0", "write a poem about dogs", ended=False),  # 23/23 chars
        rec("c1#2", "thank you so much", chat, ended=True),  # 17/6
        rec("c2#0", "As an AI I can help.", ended=False),  # 20/30
    ]
    return sim, real


def test_realism_diagnostics_exact():
    sim, real = _fixture()
    d = realism_diagnostics(sim, real)
    # ratios sorted: 2/3, 1, 17/6 -> quartiles 5/6 and 23/12
    assert d["n_pairs"] == 3
    assert d["len_ratio_median"] == pytest.approx(1.0)
    assert d["len_ratio_iqr"] == pytest.approx(23 / 12 - 5 / 6)
    assert d["end_precision"] == 1.0 and d["end_recall"] == 0.5
    assert d["end_rate"] == pytest.approx(1 / 3) and d["real_end_rate"] == pytest.approx(2 / 3)
    assert d["assistant_likeness"] == pytest.approx(1 / 3) and d["real_assistant_likeness"] == 0.0
    assert d["first_turn_diversity"] == 1.0  # no word shared
    assert d["real_first_turn_diversity"] == pytest.approx(11 / 12)  # share "a" out of 12 words
    assert d["copy_rate"] == 0.0 and d["empty_rate"] == 0.0 and d["truncated_rate"] == 0.0
    assert set(d) >= {"distinct_1", "distinct_2", "real_distinct_1", "real_distinct_2", "copy_score_mean"}
    assert all(isinstance(v, float) for v in d.values())


def test_realism_diagnostics_undefined_values_are_nan_and_jsonable():
    d = realism_diagnostics([rec("x", "hi", ended=False)], [rec("y", "hello")])
    # same (empty) context: paired through the context key
    assert d["n_pairs"] == 1 and d["len_ratio_median"] == pytest.approx(2 / 5)
    assert math.isnan(d["end_precision"]) and math.isnan(d["end_recall"])
    j = jsonable(d)
    assert j["end_precision"] is None and j["n_pairs"] == 1.0


def test_pairing_prefers_id_over_context():
    a = rec("a", "x")
    b = rec("b", "y")
    assert pair_records([rec("b", "z")], [a, b]) == [(rec("b", "z"), b)]

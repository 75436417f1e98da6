"""The Turing-distance meter: pure logic with exact values, leakage guarantees, and the two controls on real data."""

import numpy as np
import pytest

from conversations import DataError, TurnRecord
from discriminator.controls import real_halves, real_turns, templated
from discriminator.turing import (
    accuracy,
    balance_items,
    bootstrap_ci,
    fold_groups,
    grouped_folds,
    make_detector,
    measure_td,
    paired_accuracy,
    register_detector,
    turing_distance,
)


def rec(i, context, turn, conv=None):
    ctx = [{"role": r, "content": c} for r, c in context]
    return TurnRecord(id=str(i), context=ctx, user_turn=turn, conversation_id=conv)


# ---------------------------------------------------------------------------------------------------------------------
# pure helpers


@pytest.mark.parametrize(
    "acc, td", [(50.0, 0.0), (100.0, 50.0), (0.0, 50.0), (88.7, 38.7), (11.3, 38.7), (92.3, 42.3), (98.7, 48.7)]
)
def test_turing_distance_exact(acc, td):
    assert turing_distance(acc) == pytest.approx(td, abs=1e-12)


def test_accuracy_threshold_at_zero_log_odds():
    # score > 0 means "real"; a score of exactly 0 counts as "simulated"
    scores = np.array([2.0, 0.0, -1.0, 0.5])
    labels = np.array([1, 1, 0, 0])
    assert accuracy(scores, labels) == 50.0
    assert accuracy(np.array([1.0, -1.0]), np.array([1, 0])) == 100.0


def test_bootstrap_ci_exact_cases():
    assert bootstrap_ci(np.ones(40, bool), n_boot=200) == (50.0, 50.0)
    assert bootstrap_ci(np.zeros(40, bool), n_boot=200) == (50.0, 50.0)
    # each group holds one right and one wrong answer: every group resample has accuracy exactly 50
    correct = np.tile([True, False], 20)
    groups = np.repeat(np.arange(20), 2)
    assert bootstrap_ci(correct, groups, n_boot=200) == (0.0, 0.0)
    # seeded: the same call gives the same interval; the interval contains the point estimate
    rng = np.random.default_rng(0)
    c = rng.random(400) < 0.7
    assert bootstrap_ci(c, n_boot=300, seed=1) == bootstrap_ci(c, n_boot=300, seed=1)
    lo, hi = bootstrap_ci(c, n_boot=300, seed=1)
    assert lo <= turing_distance(100 * c.mean()) <= hi


def test_bootstrap_ci_of_panel_max_is_at_least_each_detector():
    rng = np.random.default_rng(0)
    c = rng.random((3, 300)) < np.array([[0.6], [0.75], [0.5]])  # [D, n]
    lo, hi = bootstrap_ci(c, n_boot=500)
    lo1, hi1 = bootstrap_ci(c[1], n_boot=500)
    assert lo >= lo1 - 1e-9 and hi >= hi1 - 1e-9


def test_paired_accuracy_exact():
    c1 = [("assistant", "hello")]
    c2 = [("assistant", "bye")]
    items = [rec(0, c1, "a"), rec(1, c1, "b"), rec(2, c2, "c"), rec(3, c2, "d"), rec(4, [], "e"), rec(5, [], "f")]
    labels = np.array([1, 0, 1, 0, 1, 0])
    scores = np.array([1.0, -1.0, 0.3, 0.3, -5.0, 5.0])  # context 1 right, context 2 a tie, empty contexts never pair
    acc, n = paired_accuracy(scores, labels, items)
    assert (acc, n) == (75.0, 2)
    assert paired_accuracy(scores[:1], labels[:1], items[:1]) == (None, 0)


# ---------------------------------------------------------------------------------------------------------------------
# folds: groups and leakage


def test_fold_groups_exact():
    items = [
        rec(0, [("user", "q"), ("assistant", "a")], "shared ctx 1"),
        rec(1, [("user", "q"), ("assistant", "a")], "shared ctx 2"),  # same context as 0
        rec(2, [], "Hello   World"),
        rec(3, [("assistant", "other")], "hello world"),  # same text as 2 up to case/space
        rec(4, [], "opening"),
        rec(5, [("user", "opening"), ("assistant", "reply")], "follow-up"),  # lineage: holds item 4's turn
        rec(6, [], "alone"),
        rec(7, [], "alone too"),  # empty contexts do not tie 6 and 7
    ]
    assert fold_groups(items).tolist() == [0, 0, 1, 1, 2, 2, 3, 4]


def test_system_only_context_does_not_tie():
    sys_ctx = [("system", "You are helpful.")]
    items = [rec(i, sys_ctx, f"turn {i}") for i in range(4)]
    assert fold_groups(items).tolist() == [0, 1, 2, 3]


def test_grouped_folds_exact_sizes():
    # four singleton groups, four folds: one item per fold
    items = [rec(i, [("assistant", f"c{i}")], f"t{i}") for i in range(4)]
    f = grouped_folds(items, folds=4, seed=0)
    assert sorted(f.tolist()) == [0, 1, 2, 3]
    # groups of sizes 3, 1, 1, 1 into two folds: the big group alone on one side, the three singletons on the other
    items = [rec(i, [("assistant", "big")], f"t{i}") for i in range(3)]
    items += [rec(3 + i, [("assistant", f"c{i}")], f"u{i}") for i in range(3)]
    f = grouped_folds(items, folds=2, seed=0)
    assert len(set(f[:3].tolist())) == 1 and len(set(f[3:].tolist())) == 1 and f[0] != f[3]
    assert grouped_folds(items, folds=2, seed=0).tolist() == f.tolist()  # seeded


def test_grouped_folds_too_few_groups():
    items = [rec(i, [("assistant", "same")], f"t{i}") for i in range(10)]
    with pytest.raises(DataError, match="independent group"):
        grouped_folds(items, folds=5)


def _leaky_set():
    """Real turns (several per conversation) and, per real context, two simulated turns; plus duplicated texts."""
    convs = real_turns(n_conversations=80, seed=3)
    real = [t for turns in convs for t in turns][:200]
    sim = templated(real, seed=0) + templated(real[:100], seed=1)
    # a duplicate of a real text on the simulated side, under a different context
    sim.append(TurnRecord(id="dup", context=[{"role": "assistant", "content": "x"}], user_turn=real[7].user_turn.upper()))
    return real, sim


def test_leakage_no_context_text_or_conversation_in_two_folds():
    real, sim = _leaky_set()
    items = real + sim
    labels = [1] * len(real) + [0] * len(sim)
    fold = grouped_folds(items, folds=5, seed=0, labels=labels)
    seen_ctx, seen_text, seen_conv_prefix = {}, {}, {}
    for it, f in zip(items, fold):
        if any(m["role"] != "system" for m in it.context):
            assert seen_ctx.setdefault(it.context_key, f) == f, "a context landed in two folds"
        key = " ".join(it.user_turn.casefold().split())
        assert seen_text.setdefault(key, f) == f, "a turn text landed in two folds"
        if it.conversation_id and not it.id.endswith("templated"):
            assert seen_conv_prefix.setdefault(it.conversation_id, f) == f, "a conversation was split"
    # folds stay near equal in size
    sizes = np.bincount(fold, minlength=5)
    assert sizes.min() > 0.6 * sizes.mean()


def test_leakage_memoriser_reads_chance():
    """A detector that memorises training contexts and texts would read far above chance if anything leaked across
    folds. Each simulated context appears three times with different turns; each real text appears twice."""

    class Memoriser:
        def __init__(self, seed=0):
            pass

        def fit(self, items, labels):
            self.table = {}
            for it, y in zip(items, labels):
                self.table[it.context_key] = 1.0 if y else -1.0
                self.table[it.user_turn] = 1.0 if y else -1.0
            return self

        def score(self, items):
            return np.array([self.table.get(it.context_key, self.table.get(it.user_turn, 0.0)) for it in items])

    convs = real_turns(n_conversations=200, seed=5)
    flat = [turns[-1] for turns in convs if turns[-1].context]
    real_src, sim_src = flat[:60], flat[60:100]
    real = real_src + [TurnRecord(id=r.id + "/copy", context=[{"role": "assistant", "content": r.id}],
                                  user_turn=r.user_turn) for r in real_src]
    sim = [TurnRecord(id=f"{s.id}/{k}", context=s.context, user_turn=f"simulated {k} for {s.id}")
           for s in sim_src for k in range(3)]
    register_detector("memoriser", Memoriser)
    r = measure_td(real, sim, detectors=("memoriser",), folds=5, seed=0, n_boot=100)
    assert r["detectors"]["memoriser"]["accuracy"] == 50.0  # nothing seen at fit time: every score is 0


# ---------------------------------------------------------------------------------------------------------------------
# balancing and errors


def test_balance_items_prefers_pairs_and_is_seeded():
    convs = real_turns(n_conversations=60, seed=1)
    real = [t for turns in convs for t in turns if t.context][:120]
    sim = templated(real[:40])
    r1, s1 = balance_items(real, sim, seed=0)
    assert len(r1) == len(s1) == 40
    assert {x.context_key for x in r1} == {x.context_key for x in s1}  # all pairs kept
    assert [x.id for x in balance_items(real, sim, seed=0)[0]] == [x.id for x in r1]


def test_too_few_items_is_an_error():
    real, sim = real_halves(30)
    with pytest.raises(DataError, match="at least 20"):
        measure_td(real[:19], sim, detectors=("style",))


def test_unknown_detector():
    with pytest.raises(DataError, match="unknown detector"):
        make_detector("oracle")


# ---------------------------------------------------------------------------------------------------------------------
# the controls


def test_real_against_real_reads_near_zero():
    real_a, real_b = real_halves(300, seed=0)
    r = measure_td(real_a, real_b, detectors=("classical", "style"), folds=5, seed=0, n_boot=500)
    lo, hi = r["td_ci95"]
    assert lo < 5, r
    assert r["td"] < 8
    assert 0.4 < r["auc"] < 0.6
    assert r["n_real"] == r["n_simulated"] == 300
    assert set(r["detectors"]) == {"classical", "style"}
    assert r["td"] == max(d["td"] for d in r["detectors"].values())


def test_real_against_templated_reads_above_40():
    real, _ = real_halves(150, seed=1)
    sim = templated(real, seed=0)
    r = measure_td(real, sim, detectors=("classical", "style"), folds=5, seed=0, n_boot=300)
    assert r["td"] > 40
    assert r["td_ci95"][0] > 35
    assert r["signed"] > 40 and r["auc"] > 0.95
    # every templated turn shares its context with a real one: paired accuracy is defined and high
    assert r["n_paired_contexts"] > 50 and r["paired_accuracy"] > 90
    for name in ("classical", "style"):
        d = r["detectors"][name]
        assert set(d) >= {"accuracy", "auc", "td", "td_ci95", "signed", "paired_accuracy"}


def test_measure_td_with_tiny_neural_in_panel(tiny_encoder_path):
    import torch

    real, _ = real_halves(40, seed=2)
    sim = templated(real)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model only pays for extra threads
    try:
        r = measure_td(
            real, sim, detectors=("style", "neural"), folds=2, seed=0, n_boot=50,
            neural_kwargs={"backbone": tiny_encoder_path, "max_length": 48, "context_tokens": 16, "batch_size": 16},
        )
    finally:
        torch.set_num_threads(threads)
    assert set(r["detectors"]) == {"style", "neural"}
    assert 0 <= r["detectors"]["neural"]["td"] <= 50
    assert r["headline_detector"] in ("style", "neural")

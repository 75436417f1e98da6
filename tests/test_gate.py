import pytest

from adversary.gate import PlateauGate, Reading


def feed(gate, tds, start=0, every=10):
    return [gate.update(Reading(step=start + i * every, td=t)) for i, t in enumerate(tds)]


def test_plateau_fires_after_patience_non_improving_evaluations():
    g = PlateauGate(patience=2, min_delta=1.0, smooth=1)
    d = feed(g, [30.0, 25.0, 24.5, 24.2])
    assert [x.stop for x in d] == [False, False, False, True]
    assert g.reason == "plateau" and g.stale == 2


def test_improvement_resets_patience():
    g = PlateauGate(patience=2, min_delta=1.0, smooth=1)
    d = feed(g, [30.0, 29.5, 20.0, 19.8, 19.9])
    assert [x.stop for x in d] == [False, False, False, False, True]


def test_smoothing_ignores_a_single_lucky_reading():
    # one noisy low reading (10) does not reset patience on its own when smoothing over 2
    g = PlateauGate(patience=2, min_delta=1.0, smooth=2)
    d = feed(g, [20.0, 20.0, 10.0, 20.0, 20.0])
    # smoothed: 20, 20, 15 (improves by 5), 15, 20 -> stale after index 3 and 4
    assert [x.stop for x in d] == [False, False, False, False, True]
    assert g.best.td == 10.0 and g.best.step == 20


def test_target_and_max_steps():
    g = PlateauGate(patience=5, target_td=5.0, smooth=1)
    assert feed(g, [12.0, 4.9])[-1].reason == "target"
    g = PlateauGate(patience=5, max_steps=20, smooth=1)
    d = feed(g, [30.0, 20.0, 10.0])
    assert [x.reason for x in d] == [None, None, "max_steps"]


def test_best_not_last():
    g = PlateauGate(patience=2, min_delta=0.5, smooth=1)
    d = feed(g, [20.0, 12.0, 15.0, 16.0])
    assert d[-1].stop and g.best == Reading(step=10, td=12.0)
    assert [x.is_best for x in d] == [True, True, False, False]


def test_state_roundtrip_and_order_check():
    g = PlateauGate(patience=3, min_delta=0.5)
    feed(g, [20.0, 18.0])
    h = PlateauGate.from_state_dict(g.state_dict())
    assert h == g
    with pytest.raises(ValueError):
        h.update(Reading(step=5, td=1.0))
    with pytest.raises(ValueError):
        PlateauGate(patience=0)

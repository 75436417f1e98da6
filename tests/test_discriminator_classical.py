"""scikit-learn detectors and the shared features."""

import numpy as np
import pytest

from conversations import DataError, TurnRecord
from discriminator.classical import ClassicalDetector, StyleDetector
from discriminator.controls import real_halves, templated
from discriminator.features import STYLE_FEATURES, normalise_turn_text, render_context, style_features


@pytest.fixture(scope="module")
def data():
    real, other = real_halves(80, seed=7)
    return real, templated(real), other


def test_style_features_values():
    ctx = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help you today?"}]
    items = [
        TurnRecord(id="a", context=ctx, user_turn="can you help me?"),
        TurnRecord(id="b", context=[], user_turn="# Title\n\n- **one**\n- two\n\n1. three"),
    ]
    X = style_features(items)
    assert X.shape == (2, len(STYLE_FEATURES)) and X.dtype == np.float64
    f = {name: X[:, i] for i, name in enumerate(STYLE_FEATURES)}
    assert f["ends_question"].tolist() == [1.0, 0.0]
    assert f["all_lower"].tolist() == [1.0, 0.0]
    assert f["has_context"].tolist() == [1.0, 0.0]
    assert f["md_header"][1] > 0 and f["md_bullets"][1] > 0 and f["md_bold"][1] > 0 and f["md_numbered"][1] > 0
    assert f["md_header"][0] == 0
    assert f["overlap_prev"][0] == pytest.approx(3 / 4)  # "can", "you", "help" appear before; "me" does not
    assert style_features([]).shape == (0, len(STYLE_FEATURES))


def test_render_context_keeps_the_tail():
    ctx = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "second"}]
    assert render_context(ctx) == "user: first\nassistant: second"
    assert render_context(ctx, max_chars=6) == "second"
    assert normalise_turn_text("  Hello\n  World ") == "hello world"


@pytest.mark.parametrize("cls", [ClassicalDetector, StyleDetector])
def test_detector_separates_templated(cls, data):
    real, sim, _ = data
    det = cls(seed=0).fit(real[:50] + sim[:50], [1] * 50 + [0] * 50)
    s = det.score(real[50:] + sim[50:])
    assert s.shape == (60,) and s.dtype == np.float64
    assert np.mean((s > 0) == np.array([1] * 30 + [0] * 30)) > 0.95
    np.testing.assert_allclose(det.predict_proba(real[50:52]), 1 / (1 + np.exp(-s[:2])))
    # deterministic for a seed
    s2 = cls(seed=0).fit(real[:50] + sim[:50], [1] * 50 + [0] * 50).score(real[50:] + sim[50:])
    np.testing.assert_array_equal(s, s2)


@pytest.mark.parametrize("cls", [ClassicalDetector, StyleDetector])
def test_detector_errors(cls, data):
    real, _, _ = data
    with pytest.raises(RuntimeError, match="not fitted"):
        cls().score(real[:2])
    with pytest.raises(DataError, match="both real"):
        cls().fit(real[:10], [1] * 10)
    with pytest.raises(DataError, match="labels"):
        cls().fit(real[:10], [1] * 9)

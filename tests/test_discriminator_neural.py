"""NeuralDetector on the tiny random encoder (seconds per test); one slow test on the real MiniLM-L6."""

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from conversations import DataError, TurnRecord
from discriminator.controls import real_halves, templated
from discriminator.neural import NeuralDetector


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data():
    real, other = real_halves(48, seed=4)
    return real, templated(real), other


def tiny(path, **kw):
    kw = {"max_length": 64, "context_tokens": 24, "batch_size": 8, "lr": 1e-3, **kw}
    return NeuralDetector(path, **kw)


def batch(data, n=8):
    real, sim, _ = data
    items = real[: n // 2] + sim[: n // 2]
    return items, [1] * (n // 2) + [0] * (n // 2)


def test_update_changes_every_trainable_parameter(tiny_encoder_path, data):
    d = tiny(tiny_encoder_path)
    before = {n: p.detach().clone() for n, p in d.trainable_parameters().items()}
    loss = d.update(*batch(data))
    assert np.isfinite(loss) and loss > 0
    assert d.step == 1
    for n, p in d.trainable_parameters().items():
        assert not torch.equal(before[n], p), f"{n} did not change"


def test_update_is_one_step_even_for_a_large_batch(tiny_encoder_path, data):
    d = tiny(tiny_encoder_path, batch_size=4)
    d.update(*batch(data, n=16))  # four micro-batches, one optimiser step
    assert d.step == 1
    assert all(s["step"].item() == 1 for s in d.optimizer.state.values())


def test_score_is_batched_and_order_independent(tiny_encoder_path, data):
    real, sim, _ = data
    d = tiny(tiny_encoder_path, score_batch_size=5)
    items = real[:12] + sim[:12]
    s = d.score(items)
    assert s.shape == (24,) and s.dtype == np.float64
    one_by_one = np.concatenate([d.score([it]) for it in items])  # padding must not change a score
    np.testing.assert_allclose(s, one_by_one, atol=1e-5)
    perm = np.random.default_rng(0).permutation(24)
    np.testing.assert_allclose(d.score([items[i] for i in perm]), s[perm], atol=1e-5)
    np.testing.assert_allclose(d.predict_proba(items), 1 / (1 + np.exp(-s)))
    assert d.score([]).shape == (0,)
    # repeated items (a context's real turn beside each of its simulated turns) are scored once, in place
    calls = []
    forward = d.model.forward
    d.model.forward = lambda *a, **k: calls.append(k["input_ids"].shape[0]) or forward(*a, **k)
    twice = d.score(items[:3] + items[:3] + [items[0]])
    d.model.forward = forward
    np.testing.assert_allclose(twice, np.concatenate([s[:3], s[:3], s[:1]]), atol=1e-5)
    assert sum(calls) == 3


def test_encoding_keeps_context_tail_and_fits_max_length(tiny_encoder_path):
    d = tiny(tiny_encoder_path, max_length=40, context_tokens=10)
    long_ctx = [{"role": "assistant", "content": " ".join(f"w{i}" for i in range(200)) + " the very end"}]
    item = TurnRecord(id="x", context=long_ctx, user_turn="start of the turn " + "more " * 100)
    ids = d.encode([item])[0]["input_ids"]
    assert len(ids) == 40
    text = d.tokenizer.decode(ids)
    assert "the very end" in text  # truncated from the left: the end of the context survives
    assert "w0 " not in text
    assert "start of the turn" in text  # the turn is cut at its end, not its start


def test_state_dict_continues_identically(tiny_encoder_path, data):
    b1, b2 = batch(data), (data[0][8:12] + data[1][8:12], [1] * 4 + [0] * 4)
    a = tiny(tiny_encoder_path)
    a.update(*b1)
    sd = a.state_dict()
    loss_a = a.update(*b2)
    b = tiny(tiny_encoder_path, seed=0)
    b.load_state_dict(sd)
    loss_b = b.update(*b2)
    assert loss_a == loss_b
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n


def test_save_load_round_trip(tiny_encoder_path, data, tmp_path):
    a = tiny(tiny_encoder_path)
    a.fit(*batch(data, n=16), epochs=1)
    a.save(tmp_path / "disc")
    assert (tmp_path / "disc" / "model.safetensors").exists()
    b = NeuralDetector.load(tmp_path / "disc")
    items = data[2][:10]
    np.testing.assert_allclose(a.score(items), b.score(items), atol=1e-6)
    assert b.step == a.step
    nb = batch(data)
    assert a.update(*nb) == b.update(*nb)
    c = tiny(tiny_encoder_path)
    assert c.load(tmp_path / "disc") is c  # on an instance: in place
    np.testing.assert_allclose(c.score(items), NeuralDetector.load(tmp_path / "disc").score(items), atol=1e-6)


def test_lora_trains_adapters_and_head_only(tiny_encoder_path, data, tmp_path):
    d = tiny(tiny_encoder_path, lora={"r": 4})
    trainable, total = d.n_parameters()
    assert 0 < trainable < total
    names = list(d.trainable_parameters())
    assert all("lora_" in n or "classifier" in n for n in names), names
    before = {n: p.detach().clone() for n, p in d.trainable_parameters().items()}
    d.update(*batch(data))
    assert all(not torch.equal(before[n], p) for n, p in d.trainable_parameters().items())
    d.save(tmp_path / "lora")
    e = NeuralDetector.load(tmp_path / "lora")
    np.testing.assert_allclose(d.score(data[2][:6]), e.score(data[2][:6]), atol=1e-6)


def test_decoder_backbone(tiny_lm_path, data):
    d = tiny(tiny_lm_path)
    assert d.is_decoder_style
    loss = d.update(*batch(data))
    assert np.isfinite(loss)
    assert d.score(data[2][:5]).shape == (5,)


def test_fit_learns_separable_task(tiny_encoder_path, data):
    real, sim, _ = data
    d = tiny(tiny_encoder_path, lr=3e-3)
    items, labels = real[:32] + sim[:32], [1] * 32 + [0] * 32
    d.fit(items, labels, epochs=4)
    s = d.score(real[32:] + sim[32:])
    acc = np.mean((s > 0) == np.array([1] * 16 + [0] * 16))
    assert acc > 0.8
    assert np.mean(d.history[-4:]) < np.mean(d.history[:4])


def test_calibrate_centres_the_offset(tiny_encoder_path, data):
    real, sim, _ = data
    d = tiny(tiny_encoder_path)
    items, labels = real[:20] + sim[:20], [1] * 20 + [0] * 20
    d.fit(items, labels, epochs=1, calibrate=False)
    assert d.offset == 0.0
    b = d.calibrate(items, labels)
    assert b == d.offset and b != 0.0
    # the log-loss optimum of an offset makes the mean predicted P(real) equal the share of real items
    assert d.predict_proba(items).mean() == pytest.approx(0.5, abs=1e-6)
    assert d.state_dict()["offset"] == b


def test_freeze_and_bad_labels(tiny_encoder_path, data):
    d = tiny(tiny_encoder_path)
    items, _ = batch(data)
    with pytest.raises(DataError):
        d.update(items, [1, 2] * 4)
    d.freeze()
    with pytest.raises(RuntimeError, match="frozen"):
        d.update(*batch(data))
    assert d.score(items).shape == (8,)


@pytest.mark.slow
def test_minilm_catches_templated_turns():
    real, _ = real_halves(90, seed=6)
    sim = templated(real)
    d = NeuralDetector("minilm-l6", max_length=96, context_tokens=32, lr=1e-4, batch_size=16)
    d.fit(real[:60] + sim[:60], [1] * 60 + [0] * 60, epochs=1)  # 8 steps
    s = d.score(real[60:] + sim[60:])
    y = np.array([1] * 30 + [0] * 30)
    assert np.mean((s > 0) == y) > 0.9
    assert roc_auc_score(y, s) > 0.97

import json
import math

import numpy as np
import pytest
import torch

from adversary.config import AdversaryConfig
from adversary.cotrain import CoTrainCallback, FaultCounter, ReplayBuffer
from adversary.curves import plot_curves, read_curves, write_curves
from adversary.loop import FaultGuard
from adversary.reward import AssistantReward, CopyReward, DiscriminatorReward, LengthReward, build_rewards
from conversations.config import ConfigError
from generator.prompts import END_MARKER

CTX = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help you today?"}]


class FakeDisc:
    """Scores a turn by its length: short turns look real. Records updates."""

    def __init__(self):
        self.updates = []
        self.model = torch.nn.Linear(1, 1)

    def score(self, items):
        return np.asarray([3.0 - len(i.user_turn) / 10 for i in items])

    def update(self, items, labels):
        self.updates.append((len(items), list(labels)))
        return 0.5

    def observe(self, items, labels):
        self.observed = getattr(self, "observed", 0) + len(items)


def _state(cfg, disc=None):
    from adversary.state import AdversaryState

    return AdversaryState(cfg, disc or FakeDisc(), max_steps=None, seed=0)


def test_discriminator_reward_clips_strips_marker_and_feeds_buffer():
    buf = ReplayBuffer(size=8)
    r = DiscriminatorReward(FakeDisc(), buf, clip=2.0)
    comps = ["ok", "x" * 100 + END_MARKER, [{"role": "assistant", "content": "fine thanks"}]]
    out = r(prompts=["p"] * 3, completions=comps, context=[json.dumps(CTX)] * 3, real_turn=["a", "b", "c"],
            record_id=["r0", "r1", "r2"])
    assert out == [2.0, -2.0, pytest.approx(1.9)]
    pending = buf.take_pending()
    assert [p[1] for p in pending] == ["ok", "x" * 100, "fine thanks"] and [p[2] for p in pending] == ["a", "b", "c"]


def test_nonfinite_discriminator_scores_are_counted_and_zeroed():
    class NanDisc(FakeDisc):
        def score(self, items):
            return np.asarray([np.nan, 1.0])

    faults = FaultCounter(limit=1)
    out = DiscriminatorReward(NanDisc(), ReplayBuffer(), clip=5.0, faults=faults)(
        prompts=["p"] * 2, completions=["a", "b"], context=[json.dumps(CTX)] * 2, real_turn=["x", "y"], record_id=["1", "2"])
    assert out == [0.0, 1.0] and faults.counts == {"reward": 1}


def test_non_saturating_reward_exact():
    from adversary.reward import disc_reward

    z = np.array([-20.0, -1.0, 0.0, 3.0, 50.0])
    np.testing.assert_allclose(disc_reward(z, "log_d", 5.0), [-5.0, -np.log1p(np.e), -np.log(2), -np.log1p(np.exp(-3)),
                                                               -np.log1p(np.exp(-50))])
    assert disc_reward(z, "log_d", 5.0).max() <= 0  # no reward for "more real than real"
    np.testing.assert_allclose(disc_reward(z, "logit", 5.0), [-5.0, -1.0, 0.0, 3.0, 5.0])


def test_realism_terms_exact():
    assert LengthReward()(prompts=None, completions=["abcd", "a" * 9], real_turn=["abcd", "a"]) == [0.0, -math.log(5)]
    copy = CopyReward()(prompts=None, completions=["Hello! How can I help you today?", "zzz"], context=[json.dumps(CTX)] * 2)
    assert copy[0] < -0.5 and copy[1] == 0.0
    ast = AssistantReward()(prompts=None, completions=["As an AI language model, I'd be happy to help!", "thx"])
    assert ast[0] < 0 and ast[1] == 0.0


def test_build_rewards_skips_zero_weights_but_keeps_disc():
    cfg = AdversaryConfig(w_disc=0.0, w_length=0.0, w_copy=0.3, w_assistant=0.0)
    funcs, weights = build_rewards(cfg, _state(cfg))
    assert [f.__name__ for f in funcs] == ["disc", "copy"] and weights == [0.0, 0.3]


def test_replay_buffer_balanced_and_roundtrip():
    from conversations import TurnRecord

    buf = ReplayBuffer(size=3, seed=1)
    buf.add([TurnRecord(id=f"s{i}", context=CTX, user_turn=f"sim{i}") for i in range(5)], [f"real{i}" for i in range(5)])
    fresh = buf.take_pending()
    buf.extend(fresh)
    assert len(buf.items) == 3 and buf.items[0][1] == "sim2"  # oldest dropped
    items, labels = buf.sample(4)
    assert list(labels) == [0, 1, 0, 1]
    assert [i.user_turn for i in items][1::2] == [items[0].user_turn.replace("sim", "real"), items[2].user_turn.replace("sim", "real")]
    b2 = ReplayBuffer(size=3, seed=99)
    b2.load_state_dict(json.loads(json.dumps(buf.state_dict())))
    assert list(b2.items) == list(buf.items) and b2.sample(4)[0][0].user_turn == buf.sample(4)[0][0].user_turn


def _cotrain(cfg, disc):
    class Acc:
        num_processes, is_main_process, process_index = 1, True, 0

    state = _state(cfg, disc)
    return CoTrainCallback(cfg, state, Acc), state.buffer


class _S:
    def __init__(self, step):
        self.global_step = step


class _C:
    should_training_stop = False


def test_cotrain_guard_rails():
    from conversations import TurnRecord

    disc = FakeDisc()
    cfg = AdversaryConfig(d_every=1, d_steps=2, disc_batch_size=4, disc_acc_ceiling=0.95, disc_acc_floor=0.6)
    cb, buf = _cotrain(cfg, disc)
    # simulated turns long (scored simulated) and real turns short (scored real): accuracy 1.0 > ceiling -> no update
    buf.add([TurnRecord(id="a", context=CTX, user_turn="y" * 80)], ["hi"])
    cb.on_step_end(None, _S(1), _C())
    assert cb.last["disc/acc"] == 1.0 and cb.last["disc/updates"] == 0 and disc.updates == []
    # simulated turn short, real turn long: accuracy 0 < floor -> twice the updates
    buf.add([TurnRecord(id="b", context=CTX, user_turn="ok")], ["z" * 80])
    cb.on_step_end(None, _S(2), _C())
    assert cb.last["disc/acc"] == 0.0 and cb.last["disc/updates"] == 4 and len(disc.updates) == 4
    assert all(labels.count(0) == labels.count(1) for _, labels in disc.updates)
    assert disc.observed == 2  # the classical member learns the fresh pair of the round that updates (every rank)
    assert [h["disc/updates"] for h in cb.state.cotrain_history] == [0, 4]


def test_cotrain_reports_collapse(capsys, monkeypatch):
    import adversary.cotrain as cotrain
    from conversations import TurnRecord

    monkeypatch.setattr(cotrain, "COLLAPSE_WINDOW", 3)
    cb, buf = _cotrain(AdversaryConfig(), FakeDisc())
    for step in range(1, 4):
        buf.add([TurnRecord(id=str(step), context=CTX, user_turn="y" * 80)], ["hi"])
        cb.on_step_end(None, _S(step), _C())
    assert "discriminator collapse" in capsys.readouterr().out and cb.state.cotrain_history[-1]["disc/collapse"] == 1


def test_fault_guard_skips_nonfinite_step_and_stops():
    model = torch.nn.Linear(2, 1)
    faults = FaultCounter(limit=1)
    guard = FaultGuard(faults)
    model.weight.grad = torch.tensor([[float("nan"), 1.0]])
    model.bias.grad = torch.tensor([1.0])
    before = model.weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    c = _C()
    guard.on_pre_optimizer_step(None, _S(1), c, model=model)
    opt.step()
    assert torch.equal(model.weight, before) and faults.counts == {"grad": 1}
    guard.on_log(None, _S(1), c, logs={"loss": float("inf")})
    assert faults.total == 2 and c.should_training_stop


def test_curves_csv_roundtrip_and_plot(tmp_path):
    rows = [{"step": 10, "td/panel": 8.0, "td/ci_low": 5.0, "td/ci_high": 11.0, "td/classical": 8.0, "td/style": 3.0},
            {"step": 0, "td/panel": 20.0, "td/ci_low": 17.0, "td/ci_high": 23.0, "td/classical": 20.0, "td/style": 9.0}]
    write_curves(rows, tmp_path / "curves.csv")
    back = read_curves(tmp_path / "curves.csv")
    assert [r["step"] for r in back] == [0, 10] and back[1]["td/style"] == 3.0
    plot_curves(back, tmp_path / "c.png", freeze_step=10, best_step=10)
    assert (tmp_path / "c.png").stat().st_size > 5000


def test_config_validation_messages():
    with pytest.raises(ConfigError, match="heldout_contexts must be >= 20"):
        AdversaryConfig(heldout_contexts=5)
    with pytest.raises(ConfigError, match="heldout_detectors"):
        AdversaryConfig(heldout_detectors=["gpt"])


def test_metric_callbacks_run_before_the_reporters(tmp_path):
    # disc/* and faults/* are added to the logs in on_log: TensorBoard (registered first by the Trainer) must see them
    from adversary.heldout import HeldoutMeter
    from adversary.loop import build_trainer
    from adversary.objectives.base import Phase
    from adversary.stages import make_discriminator, prepare_data
    from adversary.train import parse_args
    from generator.model import load_generator

    cfg, args = parse_args(["--config", "configs/smoke.yaml", "--output_dir", str(tmp_path), "--report_to", "tensorboard"])
    data = prepare_data(cfg, args.seed)
    model, tok = load_generator(cfg.model)
    state = _state(cfg, make_discriminator(cfg, args.seed))
    phase = Phase(cfg, args, model, tok, state, data, meter=HeldoutMeter(cfg, data, tok, state, tmp_path))
    trainer = build_trainer(cfg, args, model, tok, state, data, phase=phase)
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    first_reporter = names.index("TensorBoardCallback")
    assert names.index("FaultGuard") < first_reporter and names.index("CoTrainCallback") < first_reporter


def test_heldout_generation_uses_a_merged_copy_and_leaves_the_adapter_alone(tiny_lm_path):
    """The held-out meter generates with a merged copy of the LoRA generator: plain linear layers, the same logits
    (in bf16 within bf16's rounding), and the training model (adapter and base weights) untouched afterwards."""
    from accelerate import Accelerator

    from generator.engine import inference_model
    from generator.model import LoraSettings, load_generator

    model, _ = load_generator("tiny-random", lora=LoraSettings(r=4, alpha=8))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # a non-zero adapter: merging must matter
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    ids = torch.arange(1, 9)[None]
    model.eval()  # LoRA dropout off: the reference logits
    with torch.no_grad():
        want = model(input_ids=ids).logits
    model.train()
    acc = Accelerator(cpu=True)
    with inference_model(model, acc, merge_lora=True) as gen:
        assert gen is not model and not any("lora_" in n for n, _ in gen.named_parameters())
        with torch.no_grad():
            torch.testing.assert_close(gen(input_ids=ids).logits, want, atol=1e-4, rtol=1e-4)
    after = model.state_dict()
    assert model.training  # the caller's mode is its own business: the copy was put in eval mode, not the model
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with inference_model(model, acc, merge_lora=False) as gen:
        assert gen is model
    with inference_model(model, acc, precision="bf16", merge_lora=True) as gen:
        assert next(gen.parameters()).dtype == torch.bfloat16
        with torch.no_grad():
            torch.testing.assert_close(gen(input_ids=ids).logits.float(), want, atol=0.05, rtol=0.05)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_policy_engine_is_the_one_way_in_for_a_model_or_a_trainer(tiny_lm_path, monkeypatch):
    """`policy_engine` takes the model being trained or its trainer: either way the engine decodes a merged frozen
    copy with the model's logits, at the batch size asked for, and the training model is left as it was; without the
    merge it decodes the model itself. The copy is made on entry, not when the context manager is made (the meter
    trims the heap in between)."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from generator.engine import SamplingSettings, policy_engine
    from generator.model import LoraSettings, load_generator

    model, tok = load_generator("tiny-random", lora=LoraSettings(r=4, alpha=8))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    ids = torch.arange(1, 9)[None]
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    trainer = SimpleNamespace(model_wrapped=model, accelerator=Accelerator(cpu=True))
    for policy in (model, trainer):
        with policy_engine(policy, tok, precision="fp32", batch_size=3) as engine:
            assert engine.model is not model and engine.batch_size == 3
            assert not any("lora_" in n for n, _ in engine.model.named_parameters())
            with torch.no_grad():
                torch.testing.assert_close(engine.model(input_ids=ids).logits, want, atol=1e-4, rtol=1e-4)
            done = engine.complete([[1, 2, 3]] * 4, SamplingSettings(max_new_tokens=3, min_new_tokens=3), seed=0)
            assert [len(c.ids) for c in done] == [3] * 4
        assert engine.model is None  # the copy let go on exit
    with policy_engine(model, tok, merge_lora=False) as engine:
        assert engine.model is model
    import generator.engine.weights as weights

    copies = []
    monkeypatch.setattr(weights, "inference_copy", lambda m, p: copies.append(p) or m)
    pending = weights.policy_model(model, precision="bf16")
    assert copies == []
    with pending:
        assert copies == ["bf16"]
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

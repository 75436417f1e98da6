"""Precision by capability: the CPU probe's override, bf16 autocast against fp32 on a tiny model (logits, a short
LoRA training curve, GRPO-style log-probability ratios), and the main job end to end on either side of the choice."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conversations import precision as P

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def forced(monkeypatch):
    """Set MIMESIS_CPU_BF16 for one test (the probe's answer is cached per process: cleared around it)."""

    def force(value: str):
        monkeypatch.setenv(P.ENV_FORCE, value)
        P.cpu_bf16_is_fast.cache_clear()

    yield force
    P.cpu_bf16_is_fast.cache_clear()


def test_auto_follows_the_cpu_and_the_override(forced):
    forced("0")
    assert P.resolve_precision("auto", "cpu") == "fp32"
    forced("1")
    assert P.resolve_precision("auto", "cpu") == "bf16"
    assert P.resolve_precision("fp32", "cpu") == "fp32"  # an explicit choice is never overridden
    assert P.trainer_precision_kwargs("bf16", "cpu") == {"bf16": True, "fp16": False, "use_cpu": True}


def test_the_job_parses_to_fp32_on_a_cpu_without_fast_bf16(forced):
    from adversary.config import parse_job

    forced("0")
    cfg, args = parse_job((), ["--config", str(ROOT / "configs" / "demo.yaml")], prog="t")
    assert cfg.dtype == "fp32" and not args.bf16 and args.use_cpu
    forced("1")
    cfg, args = parse_job((), ["--config", str(ROOT / "configs" / "demo.yaml")], prog="t")
    assert cfg.dtype == "bf16" and args.bf16 and args.use_cpu


def _batch(tok, n=4, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, tok.vocab_size, (n, length), generator=g)


def test_bf16_autocast_logits_agree_with_fp32(tiny_lm_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_lm_path).eval()
    ids = _batch(AutoTokenizer.from_pretrained(tiny_lm_path))
    with torch.no_grad():
        ref = model(ids).logits.float()
        with P.autocast("bf16"):
            low = model(ids).logits.float()
    # bf16 keeps 8 bits of mantissa: differences of a few 1e-2 on logits of this model's scale
    scale = ref.abs().max().item()
    assert (low - ref).abs().max().item() <= 0.05 * scale + 1e-3
    assert (low.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def _lora_losses(path, precision: str, steps: int = 8) -> list[float]:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from generator.model import lora_config

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), lora_config(8, 16, 0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    ids = _batch(AutoTokenizer.from_pretrained(path), n=8, length=32, seed=1)
    losses = []
    for _ in range(steps):
        with P.autocast(precision):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_short_lora_training_curve_in_bf16_tracks_fp32(tiny_lm_path):
    fp32, bf16 = _lora_losses(tiny_lm_path, "fp32"), _lora_losses(tiny_lm_path, "bf16")
    assert fp32[-1] < fp32[0] and bf16[-1] < bf16[0]  # both learn the batch
    for a, b in zip(fp32, bf16):
        assert abs(a - b) <= 0.02 * a, (fp32, bf16)


def test_grpo_log_probability_ratios_stay_finite(tiny_lm_path):
    """GRPO's ratio exp(logp_policy - logp_old) with the policy under bf16 autocast and the old log-probs in fp32:
    finite and near 1 for identical weights (what a step that samples in one precision and trains in another sees)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_lm_path).eval()
    ids = _batch(AutoTokenizer.from_pretrained(tiny_lm_path), n=4, length=20, seed=2)

    def logp(precision):
        with torch.no_grad(), P.autocast(precision):
            logits = model(ids).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)

    ratio = torch.exp(logp("bf16") - logp("fp32"))
    assert torch.isfinite(ratio).all()
    assert (ratio - 1).abs().max().item() < 0.1


@pytest.mark.parametrize("fast", ["0", "1"])
def test_the_smoke_job_runs_on_either_side_of_the_choice(tmp_path, fast):
    """`dtype: auto` end to end with the CPU probe forced both ways: the warm start, the discriminator, GRPO and the
    meter agree on one precision (the job writes it into its export manifest)."""
    import json

    out = tmp_path / "run"
    env = {**os.environ, P.ENV_FORCE: fast, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(ROOT / "adversary" / "train.py"), "--config", str(ROOT / "configs" / "smoke.yaml"),
           "--output_dir", str(out), "--dtype", "auto", "--max_steps", "2", "--eval_steps", "2", "--save_steps", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    manifest = json.loads((out / "frozen" / "simulator.json").read_text())
    assert manifest["precision"] == ("bf16" if fast == "1" else "fp32")
    assert not math.isnan(json.loads((out / "summary.json").read_text())["best_td"])

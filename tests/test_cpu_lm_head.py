"""The lean CPU tiles for TRL's chunked LM head (generator.cpu_lm_head): TRL's values, to the bit."""

import pytest
import torch

import trl.kernels.chunked_logprob as ck

from generator.cpu_lm_head import lean_cpu_tiles


def _head(hidden, weight, targets, temperature, outputs, autocast, entropy_weight=0.0, logit_scale=1.0):
    h = hidden.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        # chunks of 128 over a vocabulary of 300: three tiles, the last one partial
        lp, ent, *_ = ck.ChunkedLogProbFunction.apply(h, weight, None, targets, temperature, 128, None, logit_scale,
                                                      outputs)
    loss = (lp * torch.linspace(-1, 1, len(lp))).sum()
    if entropy_weight:
        loss = loss + entropy_weight * ent.sum()
    loss.backward()
    return lp.detach(), None if ent is None else ent.detach(), h.grad


@pytest.mark.parametrize("temperature,logit_scale,outputs,autocast,entropy_weight", [
    (1.0, 1.0, ("log_probs", "entropy"), True, 0.0),   # GRPO's head on a CPU: entropy for the metric only
    (0.7, 1.0, ("log_probs", "entropy"), True, 0.0),   # a sampling temperature
    (1.0, 0.5, ("log_probs",), True, 0.0),             # a logit scale, no entropy
    (1.0, 1.0, ("log_probs", "entropy"), False, 0.0),  # fp32
    (1.0, 1.0, ("log_probs", "entropy"), True, 0.1),   # an entropy gradient: TRL's own tile
])
def test_lean_tiles_give_trls_log_probs_entropies_and_gradients_to_the_bit(monkeypatch, temperature, logit_scale,
                                                                          outputs, autocast, entropy_weight):
    monkeypatch.delenv("MIMESIS_LEAN_LM_HEAD", raising=False)
    monkeypatch.setattr(ck, "_forward_tile", ck._forward_tile)  # restored after the test: the swap is process-wide
    monkeypatch.setattr(ck, "_backward_tile", ck._backward_tile)
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(37, 16, generator=g), torch.randn(300, 16, generator=g)
    targets = torch.randint(0, 300, (37,), generator=g)
    targets[:3] = torch.tensor([0, 127, 299])  # a tile's first and last columns
    trl_out = _head(hidden, weight, targets, temperature, outputs, autocast, entropy_weight, logit_scale)
    assert lean_cpu_tiles() and lean_cpu_tiles()  # idempotent
    assert ck._forward_tile._lean and ck._backward_tile._lean
    ours = _head(hidden, weight, targets, temperature, outputs, autocast, entropy_weight, logit_scale)
    for a, b in zip(trl_out, ours):
        assert (a is None and b is None) or torch.equal(a, b)
    assert trl_out[2].abs().sum() > 0


def test_lean_tiles_leave_a_trl_with_other_tile_arguments_alone(monkeypatch):
    def other(tile, targets):
        return None

    monkeypatch.setattr(ck, "_forward_tile", other)
    monkeypatch.setattr(ck, "_backward_tile", other)
    assert not lean_cpu_tiles() and ck._forward_tile is other


def test_lean_tiles_are_off_when_told(monkeypatch):
    monkeypatch.setattr(ck, "_forward_tile", ck._forward_tile)
    monkeypatch.setattr(ck, "_backward_tile", ck._backward_tile)
    monkeypatch.setattr(ck, "_forward_tile", getattr(ck._forward_tile, "_trl", ck._forward_tile))  # TRL's own
    monkeypatch.setenv("MIMESIS_LEAN_LM_HEAD", "0")
    assert not lean_cpu_tiles() and not getattr(ck._forward_tile, "_lean", False)

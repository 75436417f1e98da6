"""The SFT stages' weighted token losses (`SFTArgs.loss`): TaiLr and MixCE, each token's NLL weighted by a function
of the model's own detached probability of it; the non-adversarial controls of the study (docs/results.md)."""

from __future__ import annotations

TOKEN_LOSSES = ("nll", "tailr", "mixce")  # the names `SFTArgs.loss` and the main job's `sft_loss` take


def token_loss(name: str, tailr_gamma: float = 0.5, mixce_eta: float = 0.5):
    """`SFTTrainer(compute_loss_func=...)` for the loss `name`: None (TRL's own NLL) for nll."""
    if name == "tailr":
        return tailr_loss(tailr_gamma)
    if name == "mixce":
        return mixce_loss(mixce_eta)
    return None


def tailr_loss(gamma: float):
    """TaiLr's token loss: -sum_t w_t log p_t / n, w_t = p_t / (gamma + (1 - gamma) p_t) with p_t detached; gamma 0
    is the plain NLL."""
    return _weighted_token_loss(lambda p: p / (gamma + (1.0 - gamma) * p))


def mixce_loss(eta: float):
    """MixCE's token loss (the self-reinforced form): -sum_t w_t log p_t / n, w_t = eta + (1 - eta) p_t with p_t
    detached. The reverse cross-entropy's gradient E_model[grad log q] is approximated on the data by weighting each
    token by the model's own probability of it; eta 1 is the plain NLL. Milder than TaiLr: a token is never weighted
    below eta."""
    return _weighted_token_loss(lambda p: eta + (1.0 - eta) * p)


def _weighted_token_loss(weight):
    """-sum_t weight(p_t) log p_t / n over the completion tokens, `weight` of the detached probability p_t. `n` is the
    batch's (accumulated) count of loss tokens, so gradient accumulation scales as the NLL's does. Only the loss
    tokens' rows are upcast to fp32 and normalised: (N, V), not the whole (B, T, V)."""
    import torch

    def loss(outputs, labels, num_items_in_batch=None):
        target = labels[:, 1:]  # (B, T-1)
        mask = target != -100
        rows = outputs.logits[:, :-1][mask].float()  # (N, V): the loss tokens' logits
        logp = -torch.nn.functional.cross_entropy(rows, target[mask], reduction="none")  # (N,)
        w = weight(logp.detach().exp())
        n = num_items_in_batch if num_items_in_batch is not None else mask.sum()
        return -(w * logp).sum() / n

    return loss

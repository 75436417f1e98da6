"""A second neural detector family that costs seconds, not minutes: a frozen sentence encoder (MiniLM-L6 by
default) embeds each (context tail, user turn) pair once, mean-pooled, and a logistic-regression head is fitted per
fold on the embeddings (scikit-learn). The fine-tuned `NeuralDetector` re-trains the whole encoder in every fold
(~37 s a fold on 480 items here); this one encodes each distinct pair once per process (an in-memory cache keyed by
its token ids), so a panel over many conditions that share real turns pays for each text once.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from conversations import TurnRecord

_ENCODERS: dict[tuple, object] = {}  # (backbone, max_length, context_tokens) -> frozen NeuralDetector
_CACHE: dict[tuple, np.ndarray] = {}  # (encoder key, token ids) -> embedding [H]


def _encoder(backbone: str, max_length: int, context_tokens: int):
    key = (backbone, max_length, context_tokens)
    if key not in _ENCODERS:
        from discriminator.neural import NeuralDetector

        _ENCODERS[key] = NeuralDetector(backbone=backbone, max_length=max_length, context_tokens=context_tokens,
                                        seed=0).freeze()
    return key, _ENCODERS[key]


def embed(items: Sequence[TurnRecord], backbone: str = "minilm-l6", max_length: int = 128, context_tokens: int = 48,
          batch_size: int = 64) -> np.ndarray:
    """Mean-pooled last hidden states of the frozen encoder, [n, H] float32; each distinct input encoded once."""
    import torch

    key, det = _encoder(backbone, max_length, context_tokens)
    feats = det.encode(items)
    ids = [(key, tuple(f["input_ids"]), tuple(f.get("token_type_ids", ()))) for f in feats]
    todo = sorted({i for i, k in enumerate(ids) if k not in _CACHE}, key=lambda i: -len(feats[i]["input_ids"]))
    seen, uniq = set(), []
    for i in todo:
        if ids[i] not in seen:
            seen.add(ids[i])
            uniq.append(i)
    body = det.model.base_model  # the encoder without the classification head
    from conversations.precision import autocast

    with torch.inference_mode(), autocast(det.cfg.precision, det.device):
        for s in range(0, len(uniq), batch_size):
            idx = uniq[s:s + batch_size]
            batch = det._collate([feats[i] for i in idx])
            h = body(**batch).last_hidden_state.float()  # (B, T, H)
            m = batch["attention_mask"].unsqueeze(-1).float()  # (B, T, 1)
            pooled = ((h * m).sum(1) / m.sum(1).clamp(min=1.0)).cpu().numpy()
            for i, v in zip(idx, pooled):
                _CACHE[ids[i]] = v
    return np.stack([_CACHE[k] for k in ids]).astype(np.float32)


class EmbeddingDetector:
    """Frozen-encoder embeddings -> standardised -> L2 logistic regression with balanced class weights."""

    name = "embed"

    def __init__(self, backbone: str = "minilm-l6", max_length: int = 128, context_tokens: int = 48, C: float = 1.0,
                 seed: int = 0):
        self.backbone, self.max_length, self.context_tokens, self.C, self.seed = backbone, max_length, context_tokens, C, seed
        self._model = None

    def _x(self, items):
        return embed(items, self.backbone, self.max_length, self.context_tokens)

    def fit(self, items: Sequence[TurnRecord], labels) -> "EmbeddingDetector":
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        self._model = make_pipeline(StandardScaler(), LogisticRegression(C=self.C, class_weight="balanced",
                                                                         max_iter=2000, random_state=self.seed))
        self._model.fit(self._x(items), np.asarray(labels))
        return self

    def score(self, items: Sequence[TurnRecord]) -> np.ndarray:
        """Log-odds that each item is real [n]."""
        if self._model is None:
            raise RuntimeError("EmbeddingDetector.score before fit")
        return self._model.decision_function(self._x(items)).astype(np.float64)

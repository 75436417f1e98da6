"""`NeuralDetector`: a sequence classifier over the pair (context tail, user turn).

Input: the context rendered as `role: content` lines, truncated from the LEFT to `context_tokens` tokens (the end of the
context, i.e. the message the user answers, matters most), paired with the user turn, truncated from the right so the
whole pair fits `max_length`. Output: one logit per item, read as the log-odds that the turn is real (label 1).

Any checkpoint that `AutoModelForSequenceClassification` loads works as backbone (encoders get the tokenizer's pair
encoding, `[CLS] context [SEP] turn [SEP]`; decoders, which have no separator, get `context\\nuser: turn` and are pooled
at the last token). The default is the embedded all-MiniLM-L6-v2 (`minilm-l6`, 22M parameters), which fits on CPU.

Training is online-friendly: `update(items, labels)` is exactly one optimiser step, `state_dict()` holds everything needed
to continue identically (weights, AdamW moments, step counter; dropout is seeded from (seed, step), so it does not
depend on the global RNG), and `save(dir)` / `load(dir)` write it to disk with safetensors for the weights.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from conversations import DataError, TurnRecord
from conversations.assets import NO_HUB_KERNELS, resolve_model, whole_weights
from conversations.seeds import seed_for
from discriminator.classical import check_labels
from discriminator.features import render_pairs
from discriminator.loading import _class_or_instance, _quiet_transformers

STATE_VERSION = 1
# a decoder tokenizer has no pair separator: the turn is announced in text instead
DECODER_TURN_MARKER = "\nuser: "
DEFAULT_LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.05}


@dataclass
class NeuralDetectorConfig:
    """The neural detector's settings (saved beside its weights; `NeuralDetector.load` rebuilds from them)."""

    backbone: str = "minilm-l6"  # any AutoModelForSequenceClassification checkpoint, or an embedded asset name
    max_length: int = 256  # input tokens: context tail + turn
    context_tokens: int = 128  # of those, context, truncated from the left
    lr: float = 2e-5
    batch_size: int = 32  # a fit's minibatch, an update's micro-batch
    lora: bool | dict = False  # True or LoRA settings: train adapters instead of every weight
    label_smoothing: float = 0.0
    seed: int = 0  # the head's initialisation, dropout and shuffling
    epochs: int = 1
    weight_decay: float = 0.01
    head_lr: float | None = None  # the classification head's learning rate (default: lr)
    max_grad_norm: float | None = 1.0
    score_batch_size: int | None = None  # default: 2 x batch_size
    trust_remote_code: bool = False
    precision: str = "fp32"  # fp32 master weights; forward and backward under this precision's autocast

    def __post_init__(self):
        from conversations.precision import resolve_precision

        if self.context_tokens < 0 or self.max_length < 16 or self.context_tokens > self.max_length - 16:
            raise DataError(f"need 0 <= context_tokens <= max_length - 16 (room for the turn), got context_tokens="
                            f"{self.context_tokens}, max_length={self.max_length}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise DataError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        self.backbone = str(self.backbone)
        self.lora = (dict(DEFAULT_LORA, **self.lora) if isinstance(self.lora, dict) else dict(DEFAULT_LORA)) \
            if self.lora else False
        self.score_batch_size = int(self.score_batch_size or 2 * self.batch_size)
        self.precision = resolve_precision(self.precision, "cuda" if torch.cuda.is_available() else "cpu")


class NeuralDetector:
    name = "neural"
    config_class = NeuralDetectorConfig  # a subclass family (discriminator.lm_judge) brings its own defaults
    families: dict[str, type] = {}  # name -> class, filled as each family's module is imported (`load` reads it)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        NeuralDetector.families[cls.name] = cls

    def __init__(self, config: "NeuralDetectorConfig | str | None" = None, device: str | None = None,
                 **settings) -> None:
        """`NeuralDetector(config)`, `NeuralDetector(**settings)` (the fields of `NeuralDetectorConfig`) or
        `NeuralDetector("backbone", **settings)`."""
        if isinstance(config, str):
            config, settings = None, {"backbone": config, **settings}
        if config is not None and settings:
            raise TypeError("give a NeuralDetectorConfig or keyword settings, not both")
        self.cfg = config or self.config_class(**settings)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.step = 0  # optimiser steps taken; seeds dropout, so a restored state continues identically
        self.epochs_done = 0  # seeds the shuffling in fit()
        self.frozen = False
        # added to the model's logit: fitted by calibrate() (fit() calls it) so that a short fit still puts its
        # decision threshold (log-odds 0) in the right place; not trained by the optimiser
        self.offset = 0.0
        self._build()

    # ----------------------------------------------------------------------------------------------------------------
    # construction

    def config(self) -> dict[str, Any]:
        """The settings as plain data: `NeuralDetector(**d.config())` builds the same (untrained) detector."""
        return asdict(self.cfg)

    def _rng_devices(self) -> list[int]:
        return [self.device.index or 0] if self.device.type == "cuda" else []

    def _build(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = resolve_model(self.cfg.backbone)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=self.cfg.trust_remote_code)
            # whole_weights: never partitioned by ZeRO-3 (DeepSpeed does not wrap the discriminator)
            with _quiet_transformers(), torch.random.fork_rng(devices=self._rng_devices()), whole_weights():
                torch.manual_seed(self.cfg.seed)  # the new classification head starts the same for a given seed
                model = AutoModelForSequenceClassification.from_pretrained(
                    path, num_labels=1, dtype=torch.float32, trust_remote_code=self.cfg.trust_remote_code,
                    **NO_HUB_KERNELS,
                )
        except OSError as e:
            raise DataError(f"cannot load backbone {self.cfg.backbone!r}: {str(e).splitlines()[0]}") from None
        tok = self.tokenizer
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token or tok.unk_token
        tok.padding_side = "right"
        model.config.pad_token_id = tok.pad_token_id
        self.is_decoder_style = tok.sep_token is None
        self._input_names = [n for n in tok.model_input_names if n in ("input_ids", "attention_mask", "token_type_ids")]
        if self.cfg.lora:
            from peft import LoraConfig, TaskType, get_peft_model

            settings = dict(self.cfg.lora)
            target = settings.pop("target_modules", None)
            with torch.random.fork_rng(devices=self._rng_devices()):
                torch.manual_seed(self.cfg.seed)
                try:
                    model = get_peft_model(model, LoraConfig(task_type=TaskType.SEQ_CLS, target_modules=target, **settings))
                except ValueError:  # an architecture peft has no default targets for
                    model = get_peft_model(
                        model, LoraConfig(task_type=TaskType.SEQ_CLS, target_modules="all-linear", **settings)
                    )
        self.model = model.to(self.device)
        self.model.eval()
        self._trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        # the classification head starts random: a higher learning rate there lets a short fit (tens of steps, as in
        # the meter's cross-fitting) move the decision offset to where it belongs; the encoder keeps `lr`
        head = [p for n, p in self._trainable if self._is_head(n)]
        body = [p for n, p in self._trainable if not self._is_head(n)]
        groups = [{"params": body, "lr": self.cfg.lr}]
        if head:
            groups.append({"params": head, "lr": self.cfg.head_lr if self.cfg.head_lr is not None else self.cfg.lr})
        groups = [g for g in groups if g["params"]]
        try:  # fused: one kernel for all parameters, 16 ms a step for MiniLM-L6 on 2 CPU cores against ~90 ms
            self.optimizer = torch.optim.AdamW(groups, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay, fused=True)
        except (RuntimeError, TypeError):  # a device or dtype the fused kernel does not support
            self.optimizer = torch.optim.AdamW(groups, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    @staticmethod
    def _is_head(name: str) -> bool:
        # BERT-like: classifier.*, decoders: score.*; with LoRA the same names sit under modules_to_save
        parts = name.split(".")
        return "classifier" in parts or "score" in parts

    def trainable_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self._trainable)

    # ----------------------------------------------------------------------------------------------------------------
    # encoding

    def _context_tails(self, contexts: list[str]) -> list[str]:
        """Cut each context string at a token boundary so that at most `context_tokens` tokens are left (from the left:
        the end is kept). Offsets keep the original text, so the tail re-tokenises to the same tokens."""
        k = self.cfg.context_tokens
        if k == 0:
            return ["" for _ in contexts]
        try:
            with _quiet_transformers():  # "longer than the model's maximum" warns, but these ids are never fed
                enc = self.tokenizer(contexts, add_special_tokens=False, return_offsets_mapping=True)
            offsets = enc["offset_mapping"]
            return [c if len(o) <= k else c[o[-k][0]:] for c, o in zip(contexts, offsets)]
        except NotImplementedError:  # a slow (Python) tokenizer has no offsets: truncate ids and decode
            with _quiet_transformers():
                enc = self.tokenizer(contexts, add_special_tokens=False)["input_ids"]
            return self.tokenizer.batch_decode([ids[-k:] for ids in enc], skip_special_tokens=True)

    def encode(self, items: Sequence[TurnRecord]) -> list[dict[str, list[int]]]:
        """Token ids per item, unpadded (padding happens per batch, so short batches stay short)."""
        # a character budget first, so a 40k-character context is not tokenised only to be thrown away
        contexts, turns = render_pairs(items, context_chars=self.cfg.context_tokens * 16 + 64)
        contexts = self._context_tails(contexts)
        if self.is_decoder_style:
            contexts = [c + DECODER_TURN_MARKER if c else DECODER_TURN_MARKER.lstrip("\n") for c in contexts]
        enc = self.tokenizer(contexts, turns, truncation="only_second", max_length=self.cfg.max_length)
        names = [n for n in self._input_names if n in enc]
        return [{n: enc[n][i] for n in names} for i in range(len(items))]

    def _collate(self, features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        batch = self.tokenizer.pad(features, padding=True, return_tensors="pt")  # each [B, T]
        return {k: v.to(self.device) for k, v in batch.items() if k in self._input_names}

    def _logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from conversations.precision import autocast

        with autocast(self.cfg.precision, self.device):
            logits = self.model(**batch).logits
        return logits.float().squeeze(-1) + self.offset  # [B, 1] -> [B]

    # ----------------------------------------------------------------------------------------------------------------
    # training

    def update(self, items: Sequence[TurnRecord], labels) -> float:
        """ONE optimiser step on this batch (gradients accumulated over micro-batches of `batch_size` if it is larger);
        returns the mean loss. Used online by the adversarial loop."""
        if self.frozen:
            raise RuntimeError("this discriminator is frozen; it scores only")
        y = check_labels(items, labels)
        if not len(y):
            raise DataError("update() needs at least one item")
        self.model.train()
        with torch.random.fork_rng(devices=self._rng_devices()):
            # dropout masks depend on (seed, step) only: restoring a state_dict replays training exactly
            torch.manual_seed(seed_for("dropout_step", self.cfg.seed, self.step))
            total = self._accumulate(list(items), y)
        if self.cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_([p for _, p in self._trainable], self.cfg.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        self.step += 1
        return total

    def _accumulate(self, items: list[TurnRecord], y: np.ndarray) -> float:
        """Backward of this batch's mean loss, micro-batch by micro-batch; returns it. Pointwise log-loss here (label
        smoothing for a single logit: targets 1 -> 1 - eps/2, 0 -> eps/2); a family with another loss overrides this."""
        feats = self.encode(items)
        targets = torch.tensor(y, dtype=torch.float32) * (1.0 - self.cfg.label_smoothing) + 0.5 * self.cfg.label_smoothing
        total = 0.0
        for start in range(0, len(feats), self.cfg.batch_size):
            sl = slice(start, start + self.cfg.batch_size)
            logits = self._logits(self._collate(feats[sl]))
            t = targets[sl].to(self.device)
            loss = F.binary_cross_entropy_with_logits(logits, t, reduction="sum") / len(feats)
            loss.backward()
            total += float(loss.detach())
        return total

    def _epoch_batches(self, items: Sequence[TurnRecord], y: np.ndarray) -> list[np.ndarray]:
        """One epoch's minibatches of item indices: shuffled by (seed, epochs done), `batch_size` each."""
        order = np.random.default_rng([self.cfg.seed, self.epochs_done]).permutation(len(items))
        return [order[s:s + self.cfg.batch_size] for s in range(0, len(order), self.cfg.batch_size)]

    def fit(
        self, items: Sequence[TurnRecord], labels, epochs: int | None = None, calibrate: bool = True
    ) -> "NeuralDetector":
        """`epochs` passes of shuffled minibatches of `batch_size`, one `update` each, then (by default) `calibrate` on
        up to 512 of the same items. Losses land in `self.history`."""
        y = check_labels(items, labels)
        items = list(items)
        n_epochs = self.cfg.epochs if epochs is None else int(epochs)
        self.history: list[float] = []
        for _ in range(n_epochs):
            for idx in self._epoch_batches(items, y):
                self.history.append(self.update([items[i] for i in idx], y[idx]))
            self.epochs_done += 1
        if calibrate and len(np.unique(y)) == 2:
            self.calibrate(items, y)
        return self

    def calibrate(self, items: Sequence[TurnRecord], labels, max_items: int = 512) -> float:
        """Refit `offset` (the encoder fixed) to minimise the log loss on up to `max_items` of these items (a seeded,
        label-stratified sample), so that scores read as calibrated log-odds and 0 is the decision threshold. After
        tens of steps a fine-tuned head ranks well (high AUC) long before its bias has moved to the right place."""
        y = check_labels(items, labels)
        rng = np.random.default_rng([self.cfg.seed, 7])
        per = max(1, max_items // 2)
        idx = np.concatenate([rng.permutation(np.flatnonzero(y == c))[:per] for c in (0, 1)])
        raw = self.score([items[i] for i in idx]) - self.offset
        t = y[idx].astype(np.float64)
        b = 0.0
        for _ in range(100):  # Newton on a 1-D convex problem
            p = 1.0 / (1.0 + np.exp(-(raw + b)))
            g, h = float(np.sum(p - t)), float(np.sum(p * (1 - p))) + 1e-9
            step = float(np.clip(g / h, -5.0, 5.0))
            b -= step
            if abs(step) < 1e-10:
                break
        self.offset = float(b)
        return self.offset

    def freeze(self) -> "NeuralDetector":
        """Eval mode, no gradients, `update` refused: the judge that a reward reads."""
        self.model.eval()
        for _, p in self._trainable:
            p.requires_grad_(False)
        self.frozen = True
        return self

    # ----------------------------------------------------------------------------------------------------------------
    # scoring

    def score(self, items: Sequence[TurnRecord]) -> np.ndarray:
        """Log-odds that each item is real, float64 [n]. Batched (items sorted by length so batches pad little),
        eval mode, under torch.inference_mode."""
        if not len(items):
            return np.zeros(0)
        # identical inputs are scored once: in co-training the real turn of a context comes with each of its
        # `num_generations` simulated turns
        first: dict[tuple, int] = {}
        where = []  # item -> its unique input
        feats = []
        for f in self.encode(items):
            key = tuple(tuple(f[n]) for n in sorted(f))
            if key not in first:
                first[key] = len(feats)
                feats.append(f)
            where.append(first[key])
        order = np.argsort([-len(f["input_ids"]) for f in feats], kind="stable")
        out = torch.empty(len(feats), dtype=torch.float32)
        was_training = self.model.training
        self.model.eval()
        with torch.inference_mode():
            for start in range(0, len(order), self.cfg.score_batch_size):
                idx = order[start:start + self.cfg.score_batch_size]
                out[torch.as_tensor(idx)] = self._logits(self._collate([feats[i] for i in idx])).float().cpu()
        self.model.train(was_training)
        return out.numpy().astype(np.float64)[np.asarray(where)]

    def predict_proba(self, items: Sequence[TurnRecord]) -> np.ndarray:
        """P(real) per item, [n]."""
        return 1.0 / (1.0 + np.exp(-self.score(items)))

    # ----------------------------------------------------------------------------------------------------------------
    # state

    def _weights(self) -> dict[str, torch.Tensor]:
        """Every weight for a full fine-tune; only the trainable ones (adapters and head) with LoRA, whose frozen base
        comes from the backbone."""
        if self.cfg.lora:
            sd = {n: p for n, p in self._trainable}
        else:
            sd = self.model.state_dict()
        # clone: a saved state must not move when training continues, and safetensors refuses shared storage
        return {k: v.detach().cpu().clone().contiguous() for k, v in sd.items()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "config": self.config(),
            "model": self._weights(),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "step": self.step,
            "epochs_done": self.epochs_done,
            "offset": self.offset,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> "NeuralDetector":
        ours, theirs = self.config(), sd.get("config", {})
        for key in ("backbone", "lora", "max_length", "context_tokens"):
            if key in theirs and theirs[key] != ours[key]:
                raise DataError(f"state was saved with {key}={theirs[key]!r}, this detector has {ours[key]!r}")
        missing, unexpected = self.model.load_state_dict(
            {k: v.to(self.device) for k, v in sd["model"].items()}, strict=not self.cfg.lora
        )
        if unexpected or (self.cfg.lora and set(sd["model"]) != {n for n, _ in self._trainable}):
            raise DataError(f"state does not match the model: unexpected {list(unexpected)[:3]}")
        self.optimizer.load_state_dict(sd["optimizer"])
        self.step = int(sd.get("step", 0))
        self.epochs_done = int(sd.get("epochs_done", 0))
        self.offset = float(sd.get("offset", 0.0))
        return self

    def save(self, directory: str | Path) -> Path:
        """`discriminator.json` (config, step), `model.safetensors` (weights), `optimizer.pt` (AdamW state)."""
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        sd = self.state_dict()
        save_file(sd["model"], str(d / "model.safetensors"), metadata={"format": "pt"})
        torch.save({"optimizer": sd["optimizer"], "step": sd["step"], "epochs_done": sd["epochs_done"]}, d / "optimizer.pt")
        meta = {
            "version": STATE_VERSION, "config": sd["config"], "step": sd["step"], "epochs_done": sd["epochs_done"],
            "offset": sd["offset"], "family": self.name,
        }
        (d / "discriminator.json").write_text(json.dumps(meta, indent=2))
        return d

    @_class_or_instance
    def load(cls_or_self, directory: str | Path, device: str | None = None) -> "NeuralDetector":
        """`NeuralDetector.load(dir)` builds the saved detector; `det.load(dir)` loads into `det` in place (its
        backbone and shape settings must match) and returns it."""
        from safetensors.torch import load_file

        d = Path(directory)
        meta_path = d / "discriminator.json"
        if not meta_path.exists():
            raise DataError("not a saved discriminator (no discriminator.json)", str(d))
        meta = json.loads(meta_path.read_text())
        if meta.get("version") != STATE_VERSION:
            raise DataError(f"saved with state version {meta.get('version')}, this code reads {STATE_VERSION}", str(d))
        if isinstance(cls_or_self, NeuralDetector):
            det = cls_or_self
        else:  # a saved judge builds the judge (its module imported: `families`)
            det = NeuralDetector.families.get(meta.get("family"), cls_or_self)(**meta["config"], device=device)
        opt = torch.load(d / "optimizer.pt", map_location="cpu", weights_only=True) if (d / "optimizer.pt").exists() else None
        sd = {
            "config": meta["config"],
            "model": load_file(str(d / "model.safetensors")),
            "optimizer": opt["optimizer"] if opt else det.optimizer.state_dict(),
            "step": meta.get("step", 0),
            "epochs_done": meta.get("epochs_done", 0),
            "offset": meta.get("offset", 0.0),
        }
        return det.load_state_dict(sd)

    def n_parameters(self) -> tuple[int, int]:
        """(trainable, total)."""
        total = sum(p.numel() for p in self.model.parameters())
        return sum(p.numel() for _, p in self._trainable), total

    def __repr__(self) -> str:
        t, n = self.n_parameters()
        return f"NeuralDetector({self.cfg.backbone!r}, trainable={t:,}/{n:,}, step={self.step})"


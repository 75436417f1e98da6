"""How a turn is sampled (`SamplingSettings`, one object for every caller, recorded in the export), what one
completion is, and which tokens end a turn."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from conversations.config import ConfigError


@dataclass(frozen=True)
class SamplingSettings:
    """How a turn is sampled. The simulator's export records the settings it was trained and measured with, and
    `agent_rl.users.load_simulator` / `agent_rl.serve` default to them."""

    max_new_tokens: int = 64  # token budget of one turn
    temperature: float = 1.0  # 0: greedy
    top_p: float = 0.95  # nucleus mass (1: off)
    top_k: int = 0  # 0: off
    min_new_tokens: int = 1  # stop tokens are masked before this many tokens
    max_prompt_tokens: int | None = None  # prompt budget, older messages dropped from the left (None: no limit)
    # how a turn ends the conversation: None, the end marker as sampled with the text; a number, the decision drawn
    # from the model's own P(end | context, turn) at this logit offset (generator.ending; a calibrated run records it)
    end_bias: float | None = None

    def __post_init__(self):
        checks = [
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 is off), got {self.top_k}"),
            (self.min_new_tokens >= 0, f"min_new_tokens must be >= 0, got {self.min_new_tokens}"),
            (self.max_prompt_tokens is None or self.max_prompt_tokens >= 16,
             f"max_prompt_tokens must be >= 16 (or null), got {self.max_prompt_tokens}"),
            (self.end_bias is None or abs(self.end_bias) <= 20,
             f"end_bias must be a logit offset in [-20, 20] (or null: the marker as sampled), got {self.end_bias}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)

    def replace(self, **changes) -> "SamplingSettings":
        return SamplingSettings(**{**asdict(self), **{k: v for k, v in changes.items() if v is not None}})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "SamplingSettings":
        known = {k: v for k, v in (d or {}).items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class Completion:
    ids: list[int]  # the sampled tokens, the stop token included when one was sampled
    text: str  # decoded, special tokens and the stop token left out
    stopped: bool  # True: a stop token ended it; False: it ran out of `max_new_tokens`
    stop_id: int | None = None  # the stop token sampled, if any


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """Token ids that end a turn: the tokenizer's and the model's eos, and every other special token (`<|im_start|>`
    opening a new turn, `<|endoftext|>`): none belongs inside a turn."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model is not None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    ids.update(int(i) for i in tokenizer.all_special_ids)
    return sorted(ids)

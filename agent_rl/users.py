"""User simulators behind one interface: given a batch of `UserRequest`s (a conversation in the agent's point of view
plus the hidden goal), return each user's next turn. One call = one batch across many episodes.

Specs (`load_simulator(spec)`):
- `frozen:DIR`      an export of the main job; every file's sha256 is checked against simulator.json before loading
                    and a modified export is refused (`adversary.export.ExportError`);
- `hf:MODEL`        any local causal LM (embedded asset name, model id or path, or a LoRA adapter folder) prompted as a
                    user in the generator's role-flipped format (`generator.prompts`);
- `openai:MODEL@BASE_URL`  an OpenAI-compatible endpoint, sent the same role-flipped messages; the API key is read
                    from an environment variable (`api_key_env`, default OPENAI_API_KEY) per request, never logged;
- `scripted:oracle` answers truthfully and cooperatively from the hidden task, deterministic;
- `scripted:terse`  answers as little as it can (a bare fact to a precise question, nothing otherwise).
A bare folder path holding simulator.json is read as `frozen:`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from conversations import DataError

from agent_rl.gyms import ORACLE, TERSE, UserRequest, get_gym

log = logging.getLogger("agent_rl.users")
SCRIPTED_MODES = (ORACLE, TERSE)
EMPTY_REPLY = "..."  # what the agent sees when an LM user writes nothing: an empty message would vanish in templates


class UserSimulator(Protocol):
    spec: str

    def reply(self, requests: Sequence[UserRequest]) -> list[str]:
        """The next user turn for each request, in order (one batch)."""


@dataclass(frozen=True)
class LMSettings:
    """Sampling settings for LM-backed users (hf:, frozen:, openai:)."""

    max_new_tokens: int = 64
    temperature: float = 0.7
    top_p: float = 0.95
    batch_size: int = 16
    max_context_tokens: int = 768
    seed: int = 0
    device: str | None = None
    api_key_env: str = "OPENAI_API_KEY"


def user_settings(args, **overrides) -> LMSettings:
    """LMSettings from a config holding user_max_new_tokens, user_temperature, user_top_p and user_batch_size."""
    return LMSettings(max_new_tokens=args.user_max_new_tokens, temperature=args.user_temperature,
                      top_p=args.user_top_p, batch_size=args.user_batch_size, **overrides)


class ScriptedUser:
    """Rule-based users: each gym implements `scripted_user(task, context, mode)` on its structured hidden task."""

    def __init__(self, mode: str):
        if mode not in SCRIPTED_MODES:
            raise DataError(f"unknown scripted user '{mode}'; use scripted:oracle or scripted:terse")
        self.mode = mode
        self.spec = f"scripted:{mode}"
        self.calls = 0

    def reply(self, requests):
        self.calls += 1
        return [get_gym(r.gym).scripted_user(r.task, r.context, self.mode) for r in requests]


class LMUser:
    """A causal LM playing the user: `generator.sample.generate_user_turns` on the whole batch (role flip, goal in the
    system prompt, left padding, length-sorted sub-batches), the end-of-conversation marker stripped (in a task the
    episode ends by the agent's answer or the turn limit, not by the user)."""

    def __init__(self, model, tokenizer, spec: str, settings: LMSettings | None = None, manifest: dict | None = None):
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.settings = settings or LMSettings()
        self.manifest = manifest
        self.calls = 0
        model.eval().requires_grad_(False)  # a user simulator is never trained here

    def reply(self, requests, settings: LMSettings | None = None):
        """`settings` overrides the sampling settings for this call (the server's per-request max_tokens etc.)."""
        from generator.prompts import strip_end_marker
        from generator.sample import generate_user_turns

        if not requests:
            return []
        s = settings or self.settings
        self.calls += 1
        texts = generate_user_turns(
            self.model,
            self.tokenizer,
            [r.context for r in requests],
            goals=[r.goal for r in requests],
            personas=[r.persona for r in requests],
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            # a new seed per call, else every turn of a run would replay the same random stream; the global torch RNG
            # (the agent's sampling) is left untouched by generate_user_turns
            seed=s.seed + 7919 * self.calls,
            batch_size=s.batch_size,
            max_context_tokens=s.max_context_tokens,
        )
        return [strip_end_marker(t)[0].strip() or EMPTY_REPLY for t in texts]


class OpenAIUser:
    """An OpenAI-compatible endpoint playing the user: the role-flipped messages go out concurrently (one request per
    episode, `max_workers` at a time) through the generator's client, which reads the key from the environment at
    each request and never stores or logs it."""

    def __init__(self, model: str, base_url: str, settings: LMSettings | None = None):
        from generator.sample import OpenAIAssistant

        self.settings = settings or LMSettings()
        self.spec = f"openai:{model}@{base_url}"
        self.client = OpenAIAssistant(
            base_url,
            model,
            api_key_env=self.settings.api_key_env,
            max_tokens=self.settings.max_new_tokens,
            temperature=self.settings.temperature,
            max_workers=self.settings.batch_size,
        )
        self.calls = 0

    def __repr__(self) -> str:  # never the key, only where it comes from
        return f"OpenAIUser({self.spec!r}, api_key_env={self.settings.api_key_env!r})"

    def reply(self, requests, settings: LMSettings | None = None):
        import copy

        from generator.prompts import simulator_messages, strip_end_marker

        self.calls += 1
        client = self.client
        if settings is not None:  # per-call token limit and temperature (the server's per-request values)
            client = copy.copy(client)
            client.max_tokens, client.temperature = settings.max_new_tokens, settings.temperature
        msgs = [simulator_messages(r.context, persona=r.persona, goal=r.goal) for r in requests]
        return [strip_end_marker(t)[0].strip() or EMPTY_REPLY for t in client.respond(msgs)]


def load_simulator(spec: str, settings: LMSettings | None = None) -> UserSimulator:
    """A user simulator from its spec (see the module docstring)."""
    settings = settings or LMSettings()
    kind, sep, rest = spec.partition(":")
    if not sep and Path(spec).is_dir() and (Path(spec) / "simulator.json").exists():
        kind, rest = "frozen", spec
    if kind == "scripted":
        return ScriptedUser(rest)
    if kind == "frozen":
        from adversary.export import load_frozen

        from generator.prompts import PROMPT_FORMAT_VERSION

        model, tok, manifest = load_frozen(rest, device=settings.device)  # verifies every hash first
        trained_with = manifest.get("prompt_format_version")
        if trained_with is not None and str(trained_with) != PROMPT_FORMAT_VERSION:
            log.warning("%s was trained with prompt format %s but this code renders format %s: its replies may "
                        "degrade", rest, trained_with, PROMPT_FORMAT_VERSION)
        return LMUser(model, tok, f"frozen:{rest}", settings, manifest)
    if kind == "hf":
        from generator.model import load_generator

        if not rest:
            raise DataError("hf: needs a model, e.g. hf:smollm2-135m-instruct")
        model, tok = load_generator(rest, device=settings.device)
        return LMUser(model, tok, spec, settings)
    if kind == "openai":
        model, at, url = rest.partition("@")
        if not model or not at or not url:
            raise DataError(f"openai simulator spec must be openai:MODEL@BASE_URL, got '{spec}'")
        return OpenAIUser(model, url, settings)
    raise DataError(
        f"unknown simulator '{spec}'; use frozen:DIR, hf:MODEL, openai:MODEL@BASE_URL, scripted:oracle or "
        "scripted:terse"
    )


def short_label(spec: str) -> str:
    """A readable name for tables: frozen:/long/path/sim-3 -> frozen:sim-3, openai:m@url -> openai:m."""
    kind, _, rest = spec.partition(":")
    if kind == "frozen":
        return f"frozen:{Path(rest).name}"
    if kind == "openai":
        return f"openai:{rest.partition('@')[0]}"
    if kind == "hf" and ("/" in rest and Path(rest).exists()):
        return f"hf:{Path(rest).name}"
    return spec

"""User simulators behind one interface: given a batch of `UserRequest`s (a conversation in the agent's point of view
plus the hidden goal), return each user's next turn. One call = one batch across many episodes.

Specs (`load_simulator(spec)`):
- `frozen:DIR`      an export of the main job; every file's sha256 is checked against simulator.json before loading
                    and a modified export is refused (`adversary.export.ExportError`);
- `hf:MODEL`        any local causal LM (embedded asset name, model id or path, or a LoRA adapter folder) prompted as a
                    user in the generator's role-flipped format (`generator.prompts`);
- `openai:MODEL@BASE_URL`  an OpenAI-compatible endpoint, sent the same role-flipped messages; the API key is read
                    from an environment variable (`api_key_env`, default OPENAI_API_KEY) per request, never logged;
- `...#persona=TEXT` after an hf: or frozen: spec gives the simulated user a persona (in its system prompt);
- `frozen:DIR#guidance=K` samples K turns a request and keeps one by the export's guide (a calibrated discriminator,
                    `adversary.guidance`: resampled by D/(1-D)); a guided export uses its recorded K by default, and
                    `#guidance=1` turns it off;
- `scripted:oracle` answers truthfully and cooperatively from the hidden task, deterministic;
- `scripted:terse`  answers as little as it can (a bare fact to a precise question, nothing otherwise).
A bare folder path holding simulator.json is read as `frozen:`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

from adversary.guidance import load_export_guide, split_guidance
from conversations import DataError
from conversations.seeds import derive_seed
from generator.engine import SamplingSettings
from generator.engine.resume import KV_CACHE_MB, CacheStore

from agent_rl.gyms import ORACLE, TERSE, UserRequest, get_gym

SCRIPTED_MODES = (ORACLE, TERSE)
EMPTY_REPLY = "..."  # what the agent sees when an LM user writes nothing: an empty message would vanish in templates


class UserSimulator(Protocol):
    spec: str

    def reply(self, requests: Sequence[UserRequest]) -> list[str]:
        """The next user turn for each request, in order (one batch)."""


# the agent side's defaults when neither the command line nor an export says otherwise
DEFAULT_SETTINGS = SamplingSettings(max_new_tokens=64, temperature=0.7, top_p=0.95, max_prompt_tokens=768)


@dataclass
class UserTurn:
    text: str  # what the agent sees (EMPTY_REPLY when the simulator wrote nothing)
    prompt_tokens: int
    completion_tokens: int
    truncated: bool  # hit max_new_tokens before ending the turn
    ended: bool  # the simulator wrote END_MARKER (would end the conversation)


@dataclass
class UserSamplingArgs:
    """The user simulator's sampling on the command line of the agent-side entry points (train, evaluate, compare);
    unset values fall back to what a frozen export records."""

    user_max_new_tokens: int | None = field(default=None, metadata={
        "help": "token limit of a simulated user turn (default: what a frozen export records, else 64)"})
    user_temperature: float | None = field(default=None, metadata={"help": "default: the export's, else 0.7"})
    user_top_p: float | None = field(default=None, metadata={"help": "default: the export's, else 0.95"})
    user_batch_size: int = field(default=32, metadata={"help": "simulated user turns per engine call"})


def user_settings(args, base: SamplingSettings | None = None) -> SamplingSettings | None:
    """Sampling settings from a config's user_max_new_tokens / user_temperature / user_top_p, each None (unset)
    falling back to `base`; None when nothing is set and there is no base (the export's settings then apply)."""
    given = {"max_new_tokens": args.user_max_new_tokens, "temperature": args.user_temperature, "top_p": args.user_top_p}
    if base is None and all(v is None for v in given.values()):
        return None
    return (base or DEFAULT_SETTINGS).replace(**given)


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
    """A causal LM playing the user on the generation engine: the whole batch in one call (role flip, goal in the
    system prompt, shared system-prompt cache), the end-of-conversation marker stripped (in a task the episode ends
    by the agent's answer or the turn limit, not by the user). `settings` defaults to what the export was trained and
    measured with."""

    def __init__(self, engine, spec: str, settings: SamplingSettings | None = None, manifest: dict | None = None,
                 seed: int = 0, persona: str | None = None, guide=None, kv_cache_mb: float = KV_CACHE_MB):
        """`kv_cache_mb`: memory for each episode's cache between its user turns (requests with an `episode` key;
        0: every turn prefills its whole prompt)."""
        self.engine, self.spec, self.manifest, self.seed, self.persona = engine, spec, manifest, seed, persona
        self.kv = CacheStore(kv_cache_mb)
        self.guide = guide  # adversary.guidance.Guide: K turns a request, one kept (None: one turn)
        self.settings = settings or exported_settings(manifest) or DEFAULT_SETTINGS
        self.calls = 0
        engine.model.eval().requires_grad_(False)  # a user simulator is never trained here

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def turns(self, requests, settings: SamplingSettings | None = None, cancelled=None) -> list[UserTurn]:
        """Each request's turn with token counts. `settings` overrides the sampling settings for this call (the
        server's per-request values); `cancelled[i]()` true drops request i from the batch at the next token."""
        from generator.prompts import render_prompt, strip_end_marker
        from generator.sample import clean_turn

        if not requests:
            return []
        s = settings or self.settings
        self.calls += 1
        tok = self.engine.tokenizer
        prompts = [render_prompt(tok, r.context, persona=r.persona or self.persona, goal=r.goal,
                                 max_context_tokens=s.max_prompt_tokens) for r in requests]
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        # a new seed per call, else every turn of a run would replay the same random stream
        seed = derive_seed(self.seed, step=self.calls)
        k = self.guide.k if self.guide is not None else 1
        # an episode's prompt extends its last one (the template appends): resumed from its cache when held
        keys = [r.episode for r in requests] if k == 1 else [None] * len(requests)
        states = self.kv.take(keys) if any(key is not None for key in keys) else None
        done = self.engine.complete(ids, s, seed=seed, cancelled=cancelled, n=k, states=states)
        self.kv.keep(keys, states)
        if k > 1:  # K candidates a request from one prefill; the guide keeps one of each K
            import numpy as np

            from conversations import TurnRecord

            groups = [[TurnRecord(id=str(i), context=r.context, user_turn=strip_end_marker(clean_turn(c.text))[0])
                       for c in done[i * k:(i + 1) * k]] for i, r in enumerate(requests)]
            keep = self.guide.pick(groups, np.random.default_rng(seed))
            done = [done[i * k + j] for i, j in enumerate(keep)]
        cut = [strip_end_marker(clean_turn(c.text)) for c in done]
        ends = [e for _, e in cut]
        if s.end_bias is not None:  # the export's calibrated end decision (generator.ending)
            from generator.ending import end_decisions
            from generator.sample import END_DECISION_SEED

            ends = end_decisions(self.engine, prompts, [t.strip() for t, _ in cut], s.end_bias, seed + END_DECISION_SEED)
        return [UserTurn(text=text.strip() or EMPTY_REPLY, prompt_tokens=len(p), completion_tokens=len(c.ids),
                         truncated=not c.stopped and not marked, ended=ended)
                for p, c, (text, marked), ended in zip(ids, done, cut, ends)]

    def reply(self, requests, settings: SamplingSettings | None = None):
        return [t.text for t in self.turns(requests, settings)]

    def end_episode(self, episode: int) -> None:
        self.kv.drop(episode)


class OpenAIUser:
    """An OpenAI-compatible endpoint playing the user: the role-flipped messages go out concurrently (one request per
    episode, `max_workers` at a time) through `conversations.openai_client.ChatClient`, which reads the key from the
    environment at each request and never stores or logs it."""

    def __init__(self, model: str, base_url: str, settings: SamplingSettings | None = None,
                 api_key_env: str = "OPENAI_API_KEY", max_workers: int = 16):
        from conversations.openai_client import ChatClient

        self.settings = settings or DEFAULT_SETTINGS
        self.spec = f"openai:{model}@{base_url}"
        self.client = ChatClient(base_url, model, api_key_env=api_key_env, max_workers=max_workers)
        self.calls = 0

    def __repr__(self) -> str:  # never the key, only where it comes from
        return f"OpenAIUser({self.spec!r}, api_key_env={self.client.api_key_env!r})"

    def reply(self, requests, settings: SamplingSettings | None = None):
        from generator.prompts import simulator_messages, strip_end_marker

        s = settings or self.settings
        self.calls += 1
        msgs = [simulator_messages(r.context, persona=r.persona, goal=r.goal) for r in requests]
        texts = self.client.complete_many(msgs, max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p)
        return [strip_end_marker(t)[0].strip() or EMPTY_REPLY for t in texts]


def exported_settings(manifest: dict | None) -> SamplingSettings | None:
    """The sampling settings an export records (`manifest["sampling"]`), or None for an export that has none."""
    if not manifest or not manifest.get("sampling"):
        return None
    return SamplingSettings.from_dict(manifest["sampling"])


def check_simulator_spec(spec: str) -> None:
    """A simulator spec checked before anything loads: its kind, its model name (hf:), its export folder (frozen:),
    its URL form (openai:), its mode (scripted:). A `DataError` says what is wrong."""
    from conversations.assets import check_model_name

    spec, guidance = split_guidance(spec)
    if guidance and guidance > 1 and not spec.startswith("frozen:") and not (Path(spec.partition("#")[0]) /
                                                                            "simulator.json").exists():
        raise DataError(f"simulator '{spec}': #guidance= needs a frozen export that carries a guide")
    spec = spec.partition("#persona=")[0]
    kind, sep, rest = spec.partition(":")
    if not sep and Path(spec).is_dir():
        kind, rest = "frozen", spec
    if kind == "scripted":
        if rest not in SCRIPTED_MODES:
            raise DataError(f"unknown scripted user '{rest}'; use scripted:oracle or scripted:terse")
    elif kind == "frozen":
        if not Path(rest).is_dir():
            raise DataError(f"simulator '{spec}': no such folder {rest} (a frozen export of the main job, or use "
                            "hf:MODEL)")
    elif kind == "hf":
        if not rest:
            raise DataError("hf: needs a model, e.g. hf:smollm2-135m-instruct")
        check_model_name(rest, "simulator model")
    elif kind == "openai":
        model, at, url = rest.partition("@")
        if not model or not at or not url.startswith(("http://", "https://")):
            raise DataError(f"openai simulator spec must be openai:MODEL@http(s)://HOST/..., got '{spec}'")
    else:
        raise DataError(f"unknown simulator '{spec}'; use frozen:DIR, hf:MODEL, openai:MODEL@BASE_URL, "
                        "scripted:oracle or scripted:terse")


def load_simulator(spec: str, settings: SamplingSettings | None = None, *, batch_size: int = 32, seed: int = 0,
                   device: str | None = None, dtype: str = "auto", api_key_env: str = "OPENAI_API_KEY") -> UserSimulator:
    """A user simulator from its spec (see the module docstring). `settings` None: a frozen export's own settings
    (what it was trained and measured with), else `DEFAULT_SETTINGS`. LM weights load in the process precision for
    inference (`conversations.precision`: bf16 on a CPU where bf16 is fast)."""
    from conversations.precision import resolve_precision

    check_simulator_spec(spec)
    spec, guidance = split_guidance(spec)
    spec_body, _, persona = spec.partition("#persona=")
    kind, sep, rest = spec_body.partition(":")
    if not sep and Path(spec_body).is_dir() and (Path(spec_body) / "simulator.json").exists():
        kind, rest = "frozen", spec_body
    if kind == "scripted":
        return ScriptedUser(rest)
    if kind in ("frozen", "hf"):
        from adversary.export import load_local_simulator

        engine, manifest = load_local_simulator(kind, rest, precision=resolve_precision(dtype, device),
                                                batch_size=batch_size, device=device)  # an export's hashes first
        if kind == "frozen":
            guide = load_export_guide(rest, manifest, guidance)
            label = f"frozen:{rest}" + (f"#guidance={guide.k}" if guide else "") + (f"#persona={persona}" if persona else "")
            return LMUser(engine, label, settings, manifest, seed=seed, persona=persona or None, guide=guide)
        return LMUser(engine, spec, settings, seed=seed, persona=persona or None)
    if kind == "openai":
        model, at, url = rest.partition("@")
        if not model or not at or not url:
            raise DataError(f"openai simulator spec must be openai:MODEL@BASE_URL, got '{spec}'")
        return OpenAIUser(model, url, settings, api_key_env=api_key_env, max_workers=batch_size)
    raise DataError(
        f"unknown simulator '{spec}'; use frozen:DIR, hf:MODEL, openai:MODEL@BASE_URL, scripted:oracle or "
        "scripted:terse"
    )


def short_label(spec: str) -> str:
    """A readable name for tables: frozen:/long/path/sim-3 -> frozen:sim-3, openai:m@url -> openai:m."""
    spec, guidance = split_guidance(spec)
    if guidance:
        return f"{short_label(spec)}+guided{guidance}"
    spec, _, persona = spec.partition("#persona=")
    if persona:
        return f"{short_label(spec)}+persona"
    kind, _, rest = spec.partition(":")
    if kind == "frozen":
        return f"frozen:{Path(rest).name}"
    if kind == "openai":
        return f"openai:{rest.partition('@')[0]}"
    if kind == "hf" and ("/" in rest and Path(rest).exists()):
        return f"hf:{Path(rest).name}"
    return spec

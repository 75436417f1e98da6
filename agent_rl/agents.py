"""Agents: the reference scripted agents and an LM policy, all behind `act(views) -> texts` for a batch of episodes.

Specs (`load_agent(spec)`): `scripted:oracle` (privileged: knows the hidden task, elicits it the way the reward code
credits; scores the maximum against the oracle user), `scripted:random` (uses nothing hidden), `hf:MODEL` (asset name,
model id or path) or a bare path to an agent checkpoint (a LoRA adapter folder, e.g. a training checkpoint, or a full
model folder).

The LM policy (on `generator.engine.Engine`) keeps each episode as one growing token sequence: the first prompt is the chat template of the system
prompt and the opening; after that, the agent's sampled tokens are appended as they were sampled, and each observation
is appended as the template's turn separator + the user's text + the generation prompt (`ChatTurnFormat`). The model
is fed exactly these ids at every turn, so the sequence that training scores is the one that was sampled, token for
token, and the observation tokens can be masked out (`env_mask` 0).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from conversations import DataError
from conversations.seeds import derive_seed
from generator.engine.resume import KV_CACHE_MB

from agent_rl.gyms import Task, get_gym


@dataclass
class EpisodeView:
    uid: int  # unique within one rollout run
    gym: str
    task: Task  # the scripted oracle reads the hidden part; LM agents see only `messages`
    turn: int  # agent turns taken so far
    seed: int
    messages: list[dict[str, str]]  # the agent's chat so far: system, opening, then agent turns and observations


class Agent(Protocol):
    spec: str

    def act(self, views: Sequence[EpisodeView]) -> list[str]:
        """The next agent turn (tagged text) for each episode, in order (one batch)."""

    def end_episode(self, uid: int):
        """The episode is over: drop its state; returns its token record (`EpisodeTokens`) when the agent keeps
        one, else None."""


class ScriptedAgent:
    def __init__(self, mode: str, seed: int = 0):
        if mode not in ("oracle", "random"):
            raise DataError(f"unknown scripted agent '{mode}'; use scripted:oracle or scripted:random")
        self.mode, self.seed, self.spec = mode, seed, f"scripted:{mode}"

    def act(self, views):
        out = []
        for v in views:
            gym = get_gym(v.gym)
            if self.mode == "oracle":
                out.append(gym.oracle_turn(v.task, v.turn))
            else:
                # a string seed hashes deterministically (sha512): same episode and turn, same move, on any machine
                rng = random.Random(f"{self.seed}/{v.task.key()}/{v.seed}/{v.turn}")
                out.append(gym.random_turn(v.task, rng, v.turn))
        return out

    def end_episode(self, uid):
        return None


class ChatTurnFormat:
    """How the chat template joins an agent turn to the next observation, found once by rendering a probe
    conversation: `between` closes the agent's turn and opens a user turn; `tail` closes it and opens the agent's."""

    def __init__(self, tokenizer):
        probe = [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": "AGENTTURN"},
            {"role": "user", "content": "OBSERVATION"},
        ]
        text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        a_end = text.index("AGENTTURN") + len("AGENTTURN")
        o_start = text.index("OBSERVATION")
        self.between = text[a_end:o_start]
        self.tail = text[o_start + len("OBSERVATION") :]
        self.eos_text = tokenizer.eos_token or ""
        self.tokenizer = tokenizer

    def observation_ids(self, observation: str, agent_closed: bool) -> list[int]:
        """Tokens that follow an agent turn: separator, observation, generation prompt. When the agent's turn already
        ended with the eos token (`agent_closed`), the template's own closing eos is not repeated."""
        between = self.between
        if agent_closed and self.eos_text and between.startswith(self.eos_text):
            between = between[len(self.eos_text) :]
        return self.tokenizer(between + observation + self.tail, add_special_tokens=False)["input_ids"]


@dataclass
class EpisodeTokens:
    """One episode as the policy saw it. `ids[:prompt_len]` is the first prompt; after it, `mask` is 1 on tokens the
    agent sampled and 0 on observation tokens; `turn_of` gives each of those tokens' agent turn (-1: observation)."""

    ids: list[int]
    prompt_len: int
    mask: list[int] = field(default_factory=list)
    turn_of: list[int] = field(default_factory=list)
    turns: int = 0
    closed: bool = True  # the last agent turn ended with eos

    @property
    def completion_ids(self) -> list[int]:
        return self.ids[self.prompt_len :]


# The agent's sampling: one named choice per use, read by agent_rl/train.py and agent_rl.evaluate. GRPO's rollouts
# sample the policy as it is (temperature 1, no nucleus): the log-probabilities it reinforces are then those of the
# tokens' own distribution (a nucleus would train on a truncated one). Evaluation samples as a deployed agent does.
ROLLOUT_TEMPERATURE, ROLLOUT_TOP_P = 1.0, 1.0
EVAL_TEMPERATURE, EVAL_TOP_P = 0.7, 0.95


class PolicyAgent:
    """A causal LM agent on the generation engine: one engine call for all live episodes (the shared system prompt
    is run once per batch, finished turns leave the batch), each episode's keys and values kept from one turn to the
    next so that a turn prefills only what came after the last one (`generator.engine.resume`)."""

    def __init__(
        self,
        model,
        tokenizer,
        spec: str = "policy",
        *,
        max_new_tokens: int = 64,
        temperature: float = EVAL_TEMPERATURE,
        top_p: float = EVAL_TOP_P,
        batch_size: int = 16,
        max_seq_len: int = 4096,
        seed: int = 0,
        record: bool = False,
        precision: str | None = None,
        engine=None,
        kv_cache_mb: float = KV_CACHE_MB,
    ):
        """`engine`: decode on this `Engine` (a policy being trained: `generator.engine.policy_engine`) instead of a
        new one on `model` (`batch_size` and `precision` are then the engine's). `kv_cache_mb`: memory for the
        episodes' keys and values between turns (0: every turn prefills its whole episode)."""
        from generator.engine import Engine, SamplingSettings
        from generator.engine.resume import CacheStore

        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.settings = SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        self.engine = engine if engine is not None else Engine(model, tokenizer, batch_size=batch_size,
                                                               precision=precision)
        self.max_seq_len, self.seed, self.record = max_seq_len, seed, record
        self.format = ChatTurnFormat(tokenizer)
        self.seqs: dict[int, EpisodeTokens] = {}
        self.kv = CacheStore(kv_cache_mb)  # uid -> the PromptCache of its last prompt
        self.calls = 0

    def _sync(self, v: EpisodeView) -> EpisodeTokens:
        seq = self.seqs.get(v.uid)
        if seq is None:
            enc = self.tokenizer.apply_chat_template(v.messages, add_generation_prompt=True, return_dict=True)
            ids = enc["input_ids"]
            seq = self.seqs[v.uid] = EpisodeTokens(ids=list(ids), prompt_len=len(ids))
        elif seq.turns < v.turn:
            obs = v.messages[-1]
            if obs["role"] != "user":
                raise DataError("the agent's chat must end with an observation (a user message) before its turn")
            new = self.format.observation_ids(obs["content"], seq.closed)
            seq.ids += new
            seq.mask += [0] * len(new)
            seq.turn_of += [-1] * len(new)
            seq.turns = v.turn
        if len(seq.ids) + self.settings.max_new_tokens > self.max_seq_len:
            raise DataError(
                f"episode {v.uid} ({v.gym}) needs {len(seq.ids) + self.settings.max_new_tokens} tokens, over max_seq_len "
                f"{self.max_seq_len}: lower the turn limit or max_new_tokens"
            )
        return seq

    def act(self, views):
        seqs = [self._sync(v) for v in views]
        self.calls += 1
        uids = [v.uid for v in views]
        states = self.kv.take(uids)
        done = self.engine.complete([s.ids for s in seqs], self.settings,
                                    seed=derive_seed(self.seed, stream=self.calls), states=states)
        self.kv.keep(uids, states)
        texts = []
        for s, c in zip(seqs, done):
            # the stop token stays: the policy sampled it, and training scores exactly the sampled sequence
            s.closed = c.stop_id is not None and c.stop_id == self.tokenizer.eos_token_id
            s.turn_of += [s.turns] * len(c.ids)
            s.ids += c.ids
            s.mask += [1] * len(c.ids)
            texts.append(c.text.strip())
        return texts

    def end_episode(self, uid) -> EpisodeTokens | None:
        """Drops the episode's tokens; with `record` they come back (`run_episodes` puts them on its result)."""
        seq = self.seqs.pop(uid, None)
        self.kv.drop(uid)
        return seq if self.record else None


def check_agent_spec(spec: str) -> None:
    """An agent spec checked before anything loads (a `DataError` says what is wrong)."""
    from pathlib import Path

    from conversations.assets import check_model_name

    kind, sep, rest = spec.partition(":")
    if kind == "scripted" and sep:
        if rest not in ("oracle", "random"):
            raise DataError(f"unknown scripted agent '{spec}'; use scripted:oracle or scripted:random")
    elif kind == "hf" and sep:
        check_model_name(rest, "agent model")
    elif Path(spec).exists():
        check_model_name(spec, "agent checkpoint")
    else:
        raise DataError(f"unknown agent '{spec}'; use scripted:oracle, scripted:random, hf:MODEL or a checkpoint path")


def load_agent(spec: str, *, seed: int = 0, device: str | None = None, **policy_kw) -> Agent:
    """An agent from its spec (see the module docstring). `policy_kw` go to `PolicyAgent` (max_new_tokens, ...)."""
    from pathlib import Path

    kind, sep, rest = spec.partition(":")
    if kind == "scripted" and sep:
        return ScriptedAgent(rest, seed=seed)
    if kind == "hf" and sep:
        path = rest
    elif Path(spec).exists():
        path = spec
    else:
        raise DataError(f"unknown agent '{spec}'; use scripted:oracle, scripted:random, hf:MODEL or a checkpoint path")
    from generator.model import load_generator

    model, tok = load_generator(path, device=device)  # a LoRA adapter folder is merged into its base here
    return PolicyAgent(model, tok, spec, seed=seed, **policy_kw)

"""Assistants a simulated user talks to in whole conversations: a local causal LM on the generation engine, an
OpenAI-compatible endpoint, or the replay of a real conversation's assistant replies."""

from __future__ import annotations

from typing import Protocol, Sequence

from conversations.schema import DataError
from conversations.seeds import seed_for
from generator.engine import Engine, SamplingSettings

Messages = list[dict[str, str]]


class Assistant(Protocol):
    def respond(self, conversations: Sequence[Messages], ids: Sequence[str] | None = None) -> list[str]:
        """The assistant's next message for each conversation (each ends with a user message)."""


def fit_chat(tokenizer, messages: Messages, system_prompt: str | None, max_tokens: int) -> str:
    """The chat template of `messages` (a system prompt added when none is there), the oldest exchanges dropped until
    it fits `max_tokens`; it keeps starting on a user message."""
    msgs = list(messages)
    if system_prompt and not any(m["role"] == "system" for m in msgs):
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    system = [m for m in msgs if m["role"] == "system"]
    body = [m for m in msgs if m["role"] != "system"]
    for j in range(len(body)):
        if j and body[j]["role"] != "user":
            continue
        text = tokenizer.apply_chat_template(system + body[j:], tokenize=False, add_generation_prompt=True)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= max_tokens:
            return text
    return tokenizer.apply_chat_template(system + body[-1:], tokenize=False, add_generation_prompt=True)


class LocalAssistant:
    """Any local causal LM with a chat template, answering a batch of conversations in one engine call."""

    def __init__(self, engine: Engine, *, system_prompt: str | None = None, settings: SamplingSettings | None = None,
                 seed: int = 0):
        self.engine = engine
        self.system_prompt = system_prompt
        self.settings = settings or SamplingSettings(max_new_tokens=128, temperature=0.7, top_p=0.95, top_k=50,
                                                     max_prompt_tokens=1024)
        self.seed = seed
        self.calls = 0

    def respond(self, conversations, ids=None):
        tok = self.engine.tokenizer
        prompts = [fit_chat(tok, c, self.system_prompt, self.settings.max_prompt_tokens or 10**9) for c in conversations]
        self.calls += 1
        seed = seed_for("assistant_call", self.seed, self.calls)
        out = self.engine.complete_texts(prompts, self.settings, seed=seed)
        return [c.text.strip() for c in out]


class OpenAIAssistant:
    """An OpenAI-compatible endpoint (`conversations.openai_client.ChatClient`: key from the environment, retries,
    bounded concurrency)."""

    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY", *,
                 system_prompt: str | None = None, max_tokens: int = 256, temperature: float = 0.7,
                 timeout: float = 60.0, max_workers: int = 8, retries: int = 2, cache_dir=None):
        from conversations.openai_client import ChatClient

        self.client = ChatClient(base_url, model, api_key_env=api_key_env, timeout=timeout, retries=retries,
                                 max_workers=max_workers, cache_dir=cache_dir)
        self.system_prompt = system_prompt
        self.max_tokens, self.temperature = max_tokens, temperature

    def __repr__(self) -> str:
        return f"OpenAIAssistant({self.client!r})"

    def respond(self, conversations, ids=None):
        batch = []
        for c in conversations:
            msgs = list(c)
            if self.system_prompt and not any(m["role"] == "system" for m in msgs):
                msgs = [{"role": "system", "content": self.system_prompt}] + msgs
            batch.append(msgs)
        return self.client.complete_many(batch, max_tokens=self.max_tokens, temperature=self.temperature)


class ReplayAssistant:
    """The real assistant's replies, in order, from the conversations the simulation started from. The simulation's
    seed is a conversation's first `start_user_turns` real user turns (without their replies): the first replay
    answers the last seed turn, the next ones the simulated turns after it. Past the real conversation's last reply
    there is nothing to replay: `respond` returns None for it and the simulation stops that conversation (stop reason
    `replay_exhausted`)."""

    def __init__(self, replies: dict[str, list[str]]):
        self.replies = {k: list(v) for k, v in replies.items()}
        self.given: dict[str, int] = {}

    @classmethod
    def from_conversations(cls, conversations, start_user_turns: int = 0) -> "ReplayAssistant":
        """Each conversation's replies from the one to its `start_user_turns`-th user turn on (all with 0)."""
        out = {}
        for conv in conversations:
            seen, replies = 0, []
            for m in conv.messages:
                if m["role"] == "user":
                    seen += 1
                elif m["role"] == "assistant" and seen >= max(1, start_user_turns):
                    replies.append(m["content"])
            out[conv.id] = replies
        return cls(out)

    def respond(self, conversations, ids=None):
        if ids is None:
            raise DataError("the replay assistant needs each conversation's id")
        out = []
        for i in ids:
            k = self.given.get(i, 0)
            reply = self.replies.get(i, [])
            out.append(reply[k] if k < len(reply) else None)
            self.given[i] = k + 1
        return out

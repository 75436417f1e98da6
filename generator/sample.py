"""Sampling user turns: batched generation for many contexts at once, simulated turn records, and whole conversations
against an assistant (a local causal LM or an OpenAI-compatible endpoint)."""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from conversations import Conversation, TurnRecord
from conversations.schema import DataError
from generator.prompts import END_MARKER, render_prompt, strip_end_marker

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """Token ids that end a turn: the tokenizer's and the model's eos, and every other special token (`<|im_start|>`
    opening a new turn, `<|endoftext|>`): none belongs inside a user turn."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model is not None:
        eos = getattr(model.generation_config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    ids.update(int(i) for i in tokenizer.all_special_ids)
    return sorted(ids)


def _model_device(model):
    return next(model.parameters()).device


def clean_turn(text: str) -> str:
    """Whitespace trimmed; anything after END_MARKER dropped (the marker itself kept so callers see the end)."""
    i = text.find(END_MARKER)
    if i >= 0:
        text = text[: i + len(END_MARKER)]
    return text.strip()


def generate_texts(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 0.95,
    top_k: int = 0,
    min_new_tokens: int = 1,
    seed: int = 0,
    batch_size: int = 16,
    share_prefix: bool = True,
    fast_sampling: bool = True,
) -> list[tuple[str, bool]]:
    """(text, hit_token_limit) for each rendered prompt, in order. Prompts are batched by length (less padding) and
    left-padded (padded after their shared prefix with `share_prefix`); generation stops at any end-of-turn token.
    The global torch RNG is left as it was.

    `share_prefix`: the tokens every prompt of a batch starts with (the simulator's system prompt: ~95 of a demo
    prompt's ~140 tokens) are run once and their key/value cache shared by the batch (`prefix_cache_batch`), which
    cuts the prefill, the larger part of generating a short turn on a CPU, by that share. `fast_sampling`: draw with
    `NucleusSampler` (the same distribution as transformers' sampling, without its full sort of the vocabulary);
    False uses transformers' own sampler."""
    import torch

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not prompts:
        return []
    device = _model_device(model)
    stops = stop_token_ids(tokenizer, model)
    stop_set = set(stops)
    enc_all = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(enc_all[i]))
    results: list[tuple[str, bool] | None] = [None] * len(prompts)
    gen_kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min(min_new_tokens, max_new_tokens),
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    sampling = bool(temperature and temperature > 0)
    if sampling and not fast_sampling:
        gen_kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    elif sampling:
        # sampling as a greedy step over Gumbel-perturbed logits (NucleusSampler): the same distribution as
        # transformers' temperature/top-k/top-p sampling, without its full sort and multinomial over the vocabulary
        from transformers import LogitsProcessorList

        gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None,
                          logits_processor=LogitsProcessorList([NucleusSampler(temperature, top_p, top_k)]))
    else:
        gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)

    was_training = model.training
    model.eval()
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(seed)
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                rows = [enc_all[i] for i in idx]
                shared = prefix_cache_batch(model, rows, tokenizer.pad_token_id, device) if share_prefix else None
                if shared is not None:
                    input_ids, attention_mask, cache_kwargs = shared
                else:
                    batch = tokenizer.pad({"input_ids": rows}, padding=True, padding_side="left", return_tensors="pt")
                    input_ids, attention_mask, cache_kwargs = batch["input_ids"], batch["attention_mask"], {}
                input_ids = input_ids.to(device)  # (B, T_prompt)
                out = model.generate(
                    input_ids=input_ids, attention_mask=attention_mask.to(device), **cache_kwargs, **gen_kwargs
                )
                new = out[:, input_ids.shape[1] :].tolist()  # (B, T_new)
                for i, row in zip(idx, new):
                    cut = next((k for k, t in enumerate(row) if t in stop_set), None)
                    hit_limit = cut is None
                    text = tokenizer.decode(row[:cut] if cut is not None else row, skip_special_tokens=True)
                    results[i] = (text, hit_limit)
    finally:
        if was_training:
            model.train()
    return results  # type: ignore[return-value]


class NucleusSampler:
    """A transformers logits processor that samples: returns scores that are 0 at one token and -inf elsewhere, so
    the greedy step picks it. The token is drawn from exactly the distribution of transformers' temperature, top-k,
    top-p sampling (`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, then multinomial): the nucleus
    (the tokens whose higher-ranked tokens hold less than `top_p` of the probability) is found among the top
    `candidates` tokens (4096 held 96% of SmolLM2's nuclei at top_p 0.95 after the warm start; the median nucleus
    was 134 tokens), with a full sort only for a row whose nucleus is wider, and the draw is the Gumbel-max trick,
    argmax(logit - log E) with E ~ Exp(1). Why: transformers' full sort of 49k logits and `multinomial` took 27% of a
    batched decoding step of SmolLM2 on 2 CPU cores (90 ms a step for 32 rows; this: 18 ms). Draws use the global
    torch RNG (seeded by the caller)."""

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, candidates: int = 4096):
        if temperature <= 0 or not 0 < top_p <= 1 or top_k < 0 or candidates < 1:
            raise ValueError(f"need temperature > 0, 0 < top_p <= 1, top_k >= 0, candidates >= 1; got "
                             f"{temperature}, {top_p}, {top_k}, {candidates}")
        self.temperature, self.top_p, self.top_k, self.candidates = temperature, top_p, top_k, candidates

    def __call__(self, input_ids, scores):
        import torch

        scores = scores.float() / self.temperature  # (B, V)
        k = min(self.top_k or self.candidates, scores.shape[-1])
        vals, idx = scores.topk(k, dim=-1)  # (B, k), descending
        # probabilities in the full distribution, or, with top_k, in the top-k one (transformers' top-p after top-k)
        norm = vals.logsumexp(-1, keepdim=True) if self.top_k else scores.logsumexp(-1, keepdim=True)
        probs = (vals - norm).exp()  # (B, k)
        keep = (probs.cumsum(-1) - probs) < self.top_p  # the mass ranked above each candidate
        keep[:, 0] = True
        noisy = torch.where(keep, vals - torch.empty_like(vals).exponential_().log(), float("-inf"))
        choice = idx.gather(-1, noisy.argmax(-1, keepdim=True))  # (B, 1)
        wide = probs.sum(-1) < self.top_p if not self.top_k else torch.zeros_like(keep[:, 0])
        if wide.any():  # the nucleus extends past the candidates: the whole vocabulary for these rows
            from transformers import TopPLogitsWarper

            rows = scores[wide]
            if self.top_p < 1:
                rows = TopPLogitsWarper(self.top_p)(None, rows)
            choice[wide] = (rows - torch.empty_like(rows).exponential_().log()).argmax(-1, keepdim=True)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, choice, 0.0)


MIN_SHARED_PREFIX = 16  # tokens; below this a batch-1 prefill costs more than it saves


def prefix_cache_batch(model, rows: list[list[int]], pad_id: int, device):
    """A batch whose rows all start with the same P tokens, laid out so that one key/value cache of those P tokens
    serves every row: `prefix + pads + rest` (the pads masked out in the middle, not on the left; positions come
    from the attention mask's cumulative sum, so every real token keeps the position it has unpadded). Returns
    (input_ids (B, T), attention_mask (B, T), generate kwargs with the cache) or None when there is no shared prefix
    worth caching or the model's cache is not a plain attention cache (recurrent and linear-attention layers would
    carry state across the pads)."""
    import torch

    if len(rows) < 2:
        return None
    shortest = min(len(r) for r in rows)
    p = 0
    first = rows[0]
    while p < shortest - 1 and all(r[p] == first[p] for r in rows):  # at least one token per row stays uncached
        p += 1
    if p < MIN_SHARED_PREFIX:
        return None
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([first[:p]], device=device), use_cache=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    layers = getattr(cache, "layers", None)
    if cache is None or not layers or any(type(l).__name__ != "DynamicLayer" for l in layers):
        return None
    cache.batch_repeat_interleave(len(rows))  # (1, H, P, D) -> (B, H, P, D) per layer
    width = max(len(r) for r in rows)
    ids = [first[:p] + [pad_id] * (width - len(r)) + r[p:] for r in rows]
    mask = [[1] * p + [0] * (width - len(r)) + [1] * (len(r) - p) for r in rows]
    return torch.tensor(ids), torch.tensor(mask), {_generate_cache_kwarg(): cache}


def _generate_cache_kwarg() -> str:
    """transformers 5.x takes `cache=` (`past_key_values=` deprecated), 4.x only `past_key_values=`."""
    from transformers.generation import utils

    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


def _per_item(values, n: int, name: str) -> list:
    if values is None:
        return [None] * n
    if isinstance(values, str):
        return [values] * n
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} contexts")
    return values


def _generate_turns_detailed(
    model, tokenizer, contexts, *, goals=None, personas=None, max_context_tokens: int | None = 384, **kw
) -> list[tuple[str, bool]]:
    goals = _per_item(goals, len(contexts), "goals")
    personas = _per_item(personas, len(contexts), "personas")
    prompts = [
        render_prompt(tokenizer, c, persona=p, goal=g, max_context_tokens=max_context_tokens)
        for c, g, p in zip(contexts, goals, personas)
    ]
    out = []
    for text, hit_limit in generate_texts(model, tokenizer, prompts, **kw):
        text = clean_turn(text)
        out.append((text, hit_limit and END_MARKER not in text))
    return out


def generate_user_turns(
    model,
    tokenizer,
    contexts: Sequence[Messages],
    *,
    goals: Sequence[str | None] | str | None = None,
    personas: Sequence[str | None] | str | None = None,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 0.95,
    seed: int = 0,
    batch_size: int = 16,
    max_context_tokens: int | None = 384,
) -> list[str]:
    """One sampled user turn per context (contexts in the real orientation: the messages before the user's turn).
    Returns decoded text up to the first end-of-turn, whitespace trimmed, END_MARKER kept when produced (callers
    split it off with `strip_end_marker`). `temperature=0` is greedy. Same seed and inputs, same outputs."""
    return [
        t
        for t, _ in _generate_turns_detailed(
            model,
            tokenizer,
            contexts,
            goals=goals,
            personas=personas,
            max_context_tokens=max_context_tokens,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            batch_size=batch_size,
        )
    ]


def simulate_records(model, tokenizer, records: Sequence[TurnRecord], **kw) -> list[TurnRecord]:
    """A simulated turn for each record's context: same id, context and conversation id; `user_turn` generated with
    the marker stripped; meta = {"ended": produced END_MARKER, "truncated": hit max_new_tokens}. A goal or persona in
    a record's meta is passed to the simulator."""
    goals = kw.pop("goals", None) or [r.meta.get("goal") for r in records]
    personas = kw.pop("personas", None) or [r.meta.get("persona") for r in records]
    turns = _generate_turns_detailed(model, tokenizer, [r.context for r in records], goals=goals, personas=personas, **kw)
    out = []
    for r, (text, truncated) in zip(records, turns):
        text, ended = strip_end_marker(text)
        out.append(
            TurnRecord(
                id=r.id,
                context=[dict(m) for m in r.context],
                user_turn=text,
                conversation_id=r.conversation_id,
                meta={"ended": ended, "truncated": truncated},
            )
        )
    return out


# ---------------------------------------------------------------------------------------------------------------------
# assistants the simulator talks to


class Assistant(Protocol):
    def respond(self, conversations: Sequence[Messages]) -> list[str]:
        """The assistant's next message for each conversation (each ends with a user message)."""


class LocalAssistant:
    """Any local causal LM with a chat template, answering a batch of conversations at once."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        system_prompt: str | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.7,
        top_p: float = 0.95,
        max_context_tokens: int = 1024,
        batch_size: int = 16,
        seed: int = 0,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.system_prompt = system_prompt
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.max_context_tokens, self.batch_size, self.seed = max_context_tokens, batch_size, seed
        self._calls = 0

    def _render(self, messages: Messages) -> str:
        msgs = list(messages)
        if self.system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs = [{"role": "system", "content": self.system_prompt}] + msgs
        system = [m for m in msgs if m["role"] == "system"]
        body = [m for m in msgs if m["role"] != "system"]
        # drop the oldest exchanges until it fits; keep starting on a user message
        for j in range(0, len(body), 1):
            if j and body[j]["role"] != "user":
                continue
            text = self.tokenizer.apply_chat_template(system + body[j:], tokenize=False, add_generation_prompt=True)
            if len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) <= self.max_context_tokens:
                return text
        return self.tokenizer.apply_chat_template(system + body[-1:], tokenize=False, add_generation_prompt=True)

    def respond(self, conversations: Sequence[Messages]) -> list[str]:
        prompts = [self._render(c) for c in conversations]
        self._calls += 1
        out = generate_texts(
            self.model,
            self.tokenizer,
            prompts,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=50,
            seed=self.seed + 1000 * self._calls,
            batch_size=self.batch_size,
        )
        return [t.strip() for t, _ in out]


class OpenAIAssistant:
    """An OpenAI-compatible chat endpoint (`POST {base_url}/chat/completions`), standard library only. The API key is
    read from the environment variable `api_key_env` at each request and never stored, printed or logged; without it
    requests go unauthenticated (local vLLM / llama.cpp servers accept that)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        *,
        system_prompt: str | None = None,
        max_tokens: int = 256,
        temperature: float = 0.7,
        timeout: float = 60.0,
        max_workers: int = 8,
        retries: int = 2,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise DataError(f"base URL must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key_env = api_key_env
        self.system_prompt = system_prompt
        self.max_tokens, self.temperature, self.timeout = max_tokens, temperature, timeout
        self.max_workers, self.retries = max_workers, retries
        self._warned_no_key = False

    def __repr__(self) -> str:
        return f"OpenAIAssistant(base_url={self.base_url!r}, model={self.model!r}, api_key_env={self.api_key_env!r})"

    def _one(self, messages: Messages) -> str:
        msgs = list(messages)
        if self.system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs = [{"role": "system", "content": self.system_prompt}] + msgs
        body = json.dumps(
            {"model": self.model, "messages": msgs, "max_tokens": self.max_tokens, "temperature": self.temperature}
        ).encode()
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        elif not self._warned_no_key:
            self._warned_no_key = True
            log.warning("%s is not set: calling %s without an API key", self.api_key_env, self.base_url)
        url = f"{self.base_url}/chat/completions"
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    data = json.loads(resp.read().decode())
                return data["choices"][0]["message"]["content"] or ""
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace")
                if e.code in (429, 500, 502, 503, 504) and attempt < self.retries:
                    time.sleep(2**attempt)
                    continue
                raise DataError(f"HTTP {e.code} from the assistant endpoint: {detail}", url) from None
            except urllib.error.URLError as e:
                if attempt < self.retries:
                    time.sleep(2**attempt)
                    continue
                raise DataError(f"cannot reach the assistant endpoint ({e.reason})", url) from None
            except (KeyError, IndexError, TypeError, json.JSONDecodeError):
                raise DataError("the assistant endpoint's reply is not a chat completion", url) from None
        raise AssertionError("unreachable")

    def respond(self, conversations: Sequence[Messages]) -> list[str]:
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, len(conversations)))) as pool:
            return list(pool.map(self._one, conversations))


# ---------------------------------------------------------------------------------------------------------------------
# whole conversations


@dataclass
class SimulatedConversation:
    id: str
    messages: Messages
    # True when the simulator produced END_MARKER; False when it ran out of turns (or wrote an empty turn)
    ended: bool = False
    user_turns: int = 0
    goal: str | None = None
    persona: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_conversation(self) -> Conversation:
        return Conversation(id=self.id, messages=[dict(m) for m in self.messages], source="simulated")

    def to_dict(self) -> dict[str, Any]:
        d = {"id": self.id, "messages": self.messages, "ended": self.ended, "user_turns": self.user_turns}
        if self.goal is not None:
            d["goal"] = self.goal
        if self.persona is not None:
            d["persona"] = self.persona
        if self.meta:
            d["meta"] = self.meta
        return d


def simulate_conversations(
    model,
    tokenizer,
    assistant: Assistant,
    *,
    n: int | None = None,
    contexts: Sequence[Messages] | None = None,
    goals: Sequence[str | None] | str | None = None,
    personas: Sequence[str | None] | str | None = None,
    ids: Sequence[str] | None = None,
    max_turns: int = 4,
    seed: int = 0,
    respond_to_last: bool = True,
    **gen_kw,
) -> list[SimulatedConversation]:
    """Simulate conversations in lock-step: each round samples one user turn for every conversation still going (one
    batched `generate`) and gets the assistant's replies (one batched call). A conversation stops when the simulator
    writes END_MARKER (the assistant still answers that last message when `respond_to_last`), writes an empty turn,
    or after `max_turns` user turns. Start from `contexts` (seed messages, possibly empty) or from `n` empty ones."""
    if contexts is None:
        if n is None:
            raise ValueError("give either n or contexts")
        contexts = [[] for _ in range(n)]
    k = len(contexts)
    goals_l, personas_l = _per_item(goals, k, "goals"), _per_item(personas, k, "personas")
    ids = list(ids) if ids is not None else [f"sim-{seed}-{i}" for i in range(k)]
    convs = [
        SimulatedConversation(id=ids[i], messages=[dict(m) for m in contexts[i]], goal=goals_l[i], persona=personas_l[i])
        for i in range(k)
    ]
    active = list(range(k))
    for turn in range(max_turns):
        if not active:
            break
        turns = _generate_turns_detailed(
            model,
            tokenizer,
            [convs[i].messages for i in active],
            goals=[goals_l[i] for i in active],
            personas=[personas_l[i] for i in active],
            seed=seed + turn,
            **gen_kw,
        )
        answer, still = [], []
        for i, (text, _) in zip(active, turns):
            text, ended = strip_end_marker(text)
            c = convs[i]
            if not text.strip():
                c.ended = ended
                c.meta["stop"] = "marker" if ended else "empty_turn"
                continue
            c.messages.append({"role": "user", "content": text})
            c.user_turns += 1
            if ended:
                c.ended = True
                c.meta["stop"] = "marker"
                if respond_to_last:
                    answer.append(i)
            else:
                answer.append(i)
                still.append(i)
        if answer:
            replies = assistant.respond([convs[i].messages for i in answer])
            for i, reply in zip(answer, replies):
                convs[i].messages.append({"role": "assistant", "content": reply})
        active = still
    for i in active:
        convs[i].meta["stop"] = "max_turns"
    return convs


def simulate_conversation(
    model,
    tokenizer,
    assistant: Assistant,
    *,
    context: Messages | None = None,
    goal: str | None = None,
    persona: str | None = None,
    max_turns: int = 4,
    seed: int = 0,
    **gen_kw,
) -> SimulatedConversation:
    """One conversation; see `simulate_conversations`."""
    return simulate_conversations(
        model,
        tokenizer,
        assistant,
        contexts=[context or []],
        goals=[goal],
        personas=[persona],
        max_turns=max_turns,
        seed=seed,
        **gen_kw,
    )[0]

"""The simulator's prompt format: a role flip of the conversation, an end-of-conversation marker, token budgets.

The simulator is an ordinary chat LM that plays the *user*. It sees the conversation from the user's side: the real
user's past turns become its own (`assistant`) turns, the assistant's turns become its inputs (`user`), and a system
prompt tells it that it is a human user (optionally with a persona and a hidden goal). Its completion is the next user
turn. See docs/prompt-format.md for the full description and an example.

Everything that turns a context into model input goes through `fit_messages` / `render_prompt`, at SFT time and at
sampling time, so training and inference see the same text. Bump `PROMPT_FORMAT_VERSION` on any change that alters
the rendered text: exported simulators record the version they were trained with.
"""

from __future__ import annotations

from typing import Any

# 2: a shorter system prompt (38 tokens instead of 71 with SmolLM2's tokenizer) and opening message (4 instead of 10):
# the fixed text is paid in every SFT, GRPO and generation step; version-1 simulators are still loadable
PROMPT_FORMAT_VERSION = "2"

# Plain text, not an added special token: it survives any tokenizer, needs no embedding resize, is kept by
# `decode(skip_special_tokens=True)`, and an exported adapter needs nothing beyond the base model's vocabulary.
# Costs 7 tokens with the SmolLM2 tokenizer.
END_MARKER = "<|endconversation|>"
# between the last turn's text and the marker, so the marker tokenizes the same way whatever the turn ends with
END_SEPARATOR = "\n"

DEFAULT_SYSTEM_PROMPT = (
    "You are the human user talking to an AI assistant. Write your next message as you would type it. If it is your "
    f"last message, end it with {END_MARKER}"
)

# First `user` message of the flipped conversation when the real context is empty or opens with a user turn: chat
# templates that insist on user/assistant alternation (Mistral, Gemma) then accept the flipped conversation, and the
# simulator has something to answer on the very first turn.
OPENING_MESSAGE = "[chat begins]"

# An original system prompt (instructions to the assistant) is folded into the simulator's system prompt, cut here.
MAX_FOLDED_SYSTEM_CHARS = 1000
# Fewest tokens a message keeps when it alone is over the budget (cut from the middle).
MIN_MESSAGE_TOKENS = 16

_FLIP = {"user": "assistant", "assistant": "user"}


def system_prompt_for(persona: str | None = None, goal: str | None = None, original_system: str | None = None) -> str:
    parts = [DEFAULT_SYSTEM_PROMPT]
    if persona:
        parts.append(f"Your persona: {persona.strip()}")
    if goal:
        # hidden: the assistant never sees the simulator's system prompt; the agent environments pass goals this way
        parts.append(f"Your goal in this conversation (the assistant does not know it): {goal.strip()}")
    if original_system and original_system.strip():
        s = original_system.strip()
        if len(s) > MAX_FOLDED_SYSTEM_CHARS:
            s = s[:MAX_FOLDED_SYSTEM_CHARS].rstrip() + " [...]"
        parts.append(f"The assistant was given these instructions: {s}")
    return "\n\n".join(parts)


def simulator_messages(
    context: list[dict[str, str]], persona: str | None = None, goal: str | None = None
) -> list[dict[str, str]]:
    """Role-flipped chat messages for the simulator: system prompt first, then the conversation with user and
    assistant swapped, ending with the assistant's last message as a `user` input (the simulator answers it).

    The conversation's own system prompt, if any, is folded into the simulator's system prompt. Consecutive messages
    with the same role are joined so the result always alternates."""
    original_system = "\n\n".join(m["content"] for m in context if m["role"] == "system" and m["content"].strip())
    out: list[dict[str, str]] = [
        {"role": "system", "content": system_prompt_for(persona, goal, original_system or None)}
    ]
    body = [{"role": _FLIP[m["role"]], "content": m["content"]} for m in context if m["role"] in _FLIP]
    if not body or body[0]["role"] == "assistant":
        out.append({"role": "user", "content": OPENING_MESSAGE})
    for m in body:
        if out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append(m)
    return out


def _render(tokenizer, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _n_tokens(tokenizer, text: str) -> int:
    # the chat template already holds any BOS: never add special tokens twice
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _cut_middle(tokenizer, text: str, keep: int) -> str:
    """Keep the first and last `keep // 2` tokens of `text`: the opening says what the message is about, the end is
    what the user replies to."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= keep:
        return text
    head, tail = keep // 2, keep - keep // 2
    return tokenizer.decode(ids[:head]) + " [...] " + tokenizer.decode(ids[len(ids) - tail :])


def fit_messages(
    tokenizer,
    context: list[dict[str, str]],
    persona: str | None = None,
    goal: str | None = None,
    max_context_tokens: int | None = None,
) -> list[dict[str, str]]:
    """`simulator_messages`, with the oldest context messages dropped until the rendered prompt (generation prompt
    included) fits `max_context_tokens`. The system prompt is always kept; when the last message alone is too long it
    is cut in the middle. Best effort: a system prompt longer than the budget is not cut."""
    msgs = simulator_messages(context, persona, goal)
    if max_context_tokens is None or _n_tokens(tokenizer, _render(tokenizer, msgs)) <= max_context_tokens:
        return msgs
    system = [m for m in context if m["role"] == "system"]
    body = [m for m in context if m["role"] != "system"]
    if not body:
        return msgs

    def fits(j: int) -> bool:
        return _n_tokens(tokenizer, _render(tokenizer, simulator_messages(system + body[j:], persona, goal))) <= max_context_tokens

    # smallest start index that fits; token count falls (almost) monotonically as messages are dropped
    lo, hi = 1, len(body) - 1
    if not fits(hi):
        lo = hi + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    if lo < len(body):
        return simulator_messages(system + body[lo:], persona, goal)
    # even the last message alone is over the budget: cut it in the middle, keep at least MIN_MESSAGE_TOKENS
    last = dict(body[-1])
    msgs = simulator_messages(system + [last], persona, goal)
    for _ in range(3):  # decode/re-encode can shift counts by a token or two
        over = _n_tokens(tokenizer, _render(tokenizer, msgs)) - max_context_tokens
        if over <= 0:
            break
        n = _n_tokens(tokenizer, last["content"])
        keep = max(MIN_MESSAGE_TOKENS, n - over - 8)
        if keep >= n:
            break
        last = {"role": last["role"], "content": _cut_middle(tokenizer, last["content"], keep)}
        msgs = simulator_messages(system + [last], persona, goal)
    return msgs


def render_prompt(
    tokenizer,
    context: list[dict[str, str]],
    persona: str | None = None,
    goal: str | None = None,
    max_context_tokens: int | None = None,
) -> str:
    """The simulator's prompt as text: chat template applied, generation prompt appended (the model writes the user
    turn next), older messages dropped from the left to fit `max_context_tokens`."""
    return _render(tokenizer, fit_messages(tokenizer, context, persona, goal, max_context_tokens))


def target_text(record: Any) -> str:
    """The SFT target for a turn record: the user turn, plus END_MARKER when it is the conversation's last."""
    text = record.user_turn if not isinstance(record, dict) else record["user_turn"]
    is_last = record.is_last if not isinstance(record, dict) else bool(record.get("is_last", False))
    return text.rstrip() + END_SEPARATOR + END_MARKER if is_last else text


def strip_end_marker(text: str) -> tuple[str, bool]:
    """(text without the marker, ended). Text after the marker is dropped. A marker cut off by the token limit at the
    very end (at least "<|e") also counts as an end."""
    i = text.find(END_MARKER)
    if i >= 0:
        return text[:i].rstrip(), True
    for k in range(len(END_MARKER) - 1, 2, -1):
        if text.endswith(END_MARKER[:k]):
            return text[:-k].rstrip(), True
    return text, False

"""The agent protocol: plain-text tags, so that any model (or a script) can play.

An agent turn is `[action] <message to the user>` or `[answer] <final answer>`. Parsing is lenient on purpose: small
models rarely follow a format at first, and a training run that rejects every untagged turn gets no learning signal. So:
- the first tag in the text wins; its content runs to the next tag (or the end);
- text with no tag at all is treated as an `[action]` (the whole text goes to the user) and flagged `well_formed=False`,
  which the environments report in `info` and the evaluation counts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ACTION = "action"
ANSWER = "answer"
_TAG = re.compile(r"\[\s*(action|answer)\s*\]", re.IGNORECASE)

PROTOCOL_PROMPT = (
    "You are an assistant talking with a user to solve a task. Each of your turns is one line that starts with a tag:\n"
    "[action] <your message to the user> - to ask the user something or to talk to them;\n"
    "[answer] <your final answer> - to commit to an answer, which ends the conversation.\n"
    "Ask one thing at a time and keep messages short."
)


@dataclass(frozen=True)
class AgentMove:
    kind: str  # ACTION or ANSWER
    content: str
    well_formed: bool


def parse_agent_text(text: str) -> AgentMove:
    """Split an agent turn into its tag and content (see the module docstring for the lenient rules)."""
    text = text or ""
    m = _TAG.search(text)
    if m is None:
        return AgentMove(ACTION, text.strip(), False)
    nxt = _TAG.search(text, m.end())
    content = text[m.end() : nxt.start() if nxt else len(text)].strip()
    return AgentMove(m.group(1).lower(), content, True)


def action(text: str) -> str:
    return f"[action] {text}"


def answer(text: str) -> str:
    return f"[answer] {text}"


# ---- text matching shared by the gyms' reward code and the scripted users -------------------------------------------

_WS = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Lowercase, unify quotes and dashes, collapse whitespace: the form every keyword match runs on."""
    t = (text or "").lower().replace("\u2019", "'").replace("\u2018", "'").replace("\u2013", "-").replace("\u2014", "-")
    return _WS.sub(" ", t).strip()


def mentions(text: str, keyword: str) -> bool:
    """Whole-word (or whole-phrase) match of `keyword` in `text`, case-insensitive: 'pet' does not match 'petrol'."""
    kw = normalize(keyword)
    if not kw:
        return False
    return re.search(r"(?<![a-z0-9])" + re.escape(kw) + r"(?![a-z0-9])", normalize(text)) is not None


def mentions_any(text: str, keywords) -> bool:
    return any(mentions(text, k) for k in keywords)

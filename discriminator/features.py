"""What every detector sees of an item, in one place: the text rendering of (context tail, user turn) and the
hand-made style features. Both the neural and the scikit-learn detectors use these, so they judge the same input."""

from __future__ import annotations

import functools
import re
from typing import Sequence

import numpy as np

from conversations import TurnRecord

# roles are rendered as short tags; the user turn itself is never part of the context text
ROLE_TAGS = {"system": "system", "user": "user", "assistant": "assistant"}


def has_context(item: TurnRecord) -> bool:
    """A context with a user or assistant message. An empty (or system-only) context carries nothing about the turn
    that could leak, so it does not tie items together (else every opening turn would share one group)."""
    return any(m["role"] != "system" for m in item.context)


def render_context(context: Sequence[dict], max_chars: int | None = None) -> str:
    """The messages before the turn as `role: content` lines, oldest first. With `max_chars`, only the tail is kept
    (truncated from the left): the end of the context (the assistant message the user answers) matters most."""
    text = "\n".join(f"{ROLE_TAGS.get(m['role'], m['role'])}: {m['content']}" for m in context)
    if max_chars is not None and len(text) > max_chars:
        text = text[len(text) - max_chars:]
    return text


def render_pair(item: TurnRecord, context_chars: int | None = 2000) -> tuple[str, str]:
    """(context tail, user turn): the input of the pair classifiers."""
    return render_context(item.context, context_chars), item.user_turn


def render_pairs(items: Sequence[TurnRecord], context_chars: int | None = 2000) -> tuple[list[str], list[str]]:
    contexts = [render_context(it.context, context_chars) for it in items]
    turns = [it.user_turn for it in items]
    return contexts, turns


def last_assistant(context: Sequence[dict]) -> str:
    for m in reversed(context):
        if m["role"] == "assistant":
            return m["content"]
    return ""


# --------------------------------------------------------------------------------------------------------------------
# style features: cheap, interpretable signals that separate human turns from LM-written ones

_WORD = re.compile(r"\b\w+\b")
_PUNCT = re.compile(r"[^\w\s]")
_MD_HEADER = re.compile(r"(?m)^\s{0,3}#{1,6}\s")
_MD_BULLET = re.compile(r"(?m)^\s*[-*+]\s+\S")
_MD_NUMBERED = re.compile(r"(?m)^\s*\d+[.)]\s+\S")
_MD_BOLD = re.compile(r"\*\*[^*\n]+\*\*|__[^_\n]+__")
_MD_CODE = re.compile(r"```|`[^`\n]+`")
_SENT_END = re.compile(r"[.!?](\s|$)")
_EMOJI = re.compile("[\U0001F300-\U0001FAFF\u2600-\u27BF]")

STYLE_FEATURES = (
    "log_chars",
    "log_words",
    "log_lines",
    "mean_word_len",
    "punct_ratio",
    "upper_ratio",
    "digit_ratio",
    "non_ascii_ratio",
    "space_ratio",
    "starts_upper",
    "starts_lower",
    "all_lower",
    "ends_punct",
    "ends_question",
    "n_question",
    "n_exclaim",
    "n_comma_per_word",
    "n_sentences",
    "has_ellipsis",
    "apostrophe_per_word",
    "md_header",
    "md_bullets",
    "md_numbered",
    "md_bold",
    "md_code",
    "emoji",
    "double_space",
    "trailing_space",
    "has_context",
    "log_len_ratio_prev",
    "overlap_prev",
    "overlap_context",
)


def _log1p(x: float) -> float:
    return float(np.log1p(x))


def style_vector(item: TurnRecord) -> list[float]:
    """The STYLE_FEATURES of one item, in that order. Cached: cross-fitting featurises every item once per fold."""
    # tuple keys hash fast (a str caches its hash) and hold references, not copies, of the texts
    return list(_style_cached(item.user_turn, tuple((m["role"], m["content"]) for m in item.context)))


@functools.lru_cache(maxsize=1 << 16)
def _style_cached(t: str, context: tuple[tuple[str, str], ...]) -> tuple[float, ...]:
    return tuple(_style_vector(t, [{"role": r, "content": c} for r, c in context]))


def _style_vector(t: str, context: list[dict]) -> list[float]:
    n = max(len(t), 1)
    words = _WORD.findall(t)
    nw = max(len(words), 1)
    stripped = t.strip()
    letters = [c for c in t if c.isalpha()]
    prev = last_assistant(context)
    wset = {w.lower() for w in words}
    prev_words = {w.lower() for w in _WORD.findall(prev)}
    ctx_words = {w.lower() for m in context for w in _WORD.findall(m["content"])}
    return [
        _log1p(len(t)),
        _log1p(len(words)),
        _log1p(t.count("\n") + 1),
        sum(len(w) for w in words) / nw,
        len(_PUNCT.findall(t)) / n,
        sum(c.isupper() for c in t) / n,
        sum(c.isdigit() for c in t) / n,
        sum(ord(c) > 127 for c in t) / n,
        sum(c.isspace() for c in t) / n,
        float(bool(stripped) and stripped[0].isupper()),
        float(bool(stripped) and stripped[0].islower()),
        float(bool(letters) and all(c.islower() for c in letters)),
        float(bool(stripped) and not stripped[-1].isalnum()),
        float(stripped.endswith("?")),
        _log1p(t.count("?")),
        _log1p(t.count("!")),
        t.count(",") / nw,
        _log1p(len(_SENT_END.findall(t))),
        float("..." in t or "\u2026" in t),
        (t.count("'") + t.count("\u2019")) / nw,
        _log1p(len(_MD_HEADER.findall(t))),
        _log1p(len(_MD_BULLET.findall(t))),
        _log1p(len(_MD_NUMBERED.findall(t))),
        _log1p(len(_MD_BOLD.findall(t))),
        _log1p(len(_MD_CODE.findall(t))),
        _log1p(len(_EMOJI.findall(t))),
        float("  " in t),
        float(t != t.rstrip()),
        float(any(m["role"] != "system" for m in context)),
        # how long the turn is next to the message it answers (humans answer long replies briefly)
        float(np.log1p(len(t)) - np.log1p(len(prev))),
        # how much of the turn repeats the previous assistant message / the context (simulators copy)
        len(wset & prev_words) / max(len(wset), 1),
        len(wset & ctx_words) / max(len(wset), 1),
    ]


def style_features(items: Sequence[TurnRecord]) -> np.ndarray:
    """[n_items, len(STYLE_FEATURES)] float64."""
    if not items:
        return np.zeros((0, len(STYLE_FEATURES)))
    return np.asarray([style_vector(it) for it in items], dtype=np.float64)


def normalise_turn_text(text: str) -> str:
    """The form in which two turns count as duplicates: case and whitespace do not make a turn new."""
    return " ".join(text.casefold().split())

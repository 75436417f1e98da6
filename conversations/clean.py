"""Cleaning rules, each counted: a conversation is dropped by the first rule it breaks."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field

from conversations.schema import Conversation

RULES = ("empty", "non_alternating", "too_long", "duplicate")


@dataclass
class CleanReport:
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)  # rule -> count

    def as_dict(self) -> dict:
        return {"kept": self.kept, "dropped": {r: self.dropped.get(r, 0) for r in RULES}}


def _alternates(messages: list[dict[str, str]]) -> bool:
    body = [m["role"] for m in messages if m["role"] != "system"]
    if any(m["role"] == "system" for m in messages[len(messages) - len(body):]):
        return False  # a system message after the first turn
    if not body:
        return False
    # a conversation may open with the assistant: ShareGPT's continuation parts ("abc_1") do
    return all(a != b for a, b in zip(body, body[1:]))


def clean_conversations(
    convs: list[Conversation], *, max_chars: int = 4000, drop_duplicates: bool = True
) -> tuple[list[Conversation], CleanReport]:
    """Drop conversations that are empty, whose roles do not alternate user/assistant (a system message first at most), that
    have a user turn longer than `max_chars`, or that repeat an earlier conversation's messages exactly."""
    report = CleanReport()
    seen: set[str] = set()
    out = []
    for c in convs:
        if not c.messages or all(not m["content"].strip() for m in c.messages):
            rule = "empty"
        elif not _alternates(c.messages):
            rule = "non_alternating"
        elif any(m["role"] == "user" and len(m["content"]) > max_chars for m in c.messages):
            rule = "too_long"
        else:
            rule = None
            if drop_duplicates:
                h = hashlib.sha1(json.dumps(c.messages, sort_keys=True).encode()).hexdigest()
                if h in seen:
                    rule = "duplicate"
                seen.add(h)
        if rule:
            report.dropped[rule] += 1
            continue
        out.append(c)
    report.kept = len(out)
    return out, report

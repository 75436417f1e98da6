"""The one schema: a conversation is an id and a list of {"role", "content"} messages; a turn record is one user turn
with the messages before it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """Bad input, with where it is (file, line or record) and why. CLIs print it as one line and exit non-zero."""

    def __init__(self, reason: str, source: str | None = None):
        self.reason = reason
        self.source = source
        super().__init__(f"{source}: {reason}" if source else reason)


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]
    # where it came from, e.g. "data.jsonl:12" or "sharegpt.json:record 40"; used in error messages
    source: str | None = None
    # key that decides the split; conversations cut into parts (ShareGPT's "abc_0", "abc_1") share one group
    group: str | None = None

    @property
    def split_key(self) -> str:
        return self.group or self.id

    def user_turn_indices(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m["role"] == "user"]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "messages": self.messages}


@dataclass
class TurnRecord:
    """One real or simulated user turn. `context` is every message before the turn (system prompt included)."""

    id: str
    context: list[dict[str, str]]
    user_turn: str
    conversation_id: str | None = None
    # True for the last user turn of its conversation: the simulator learns to end the conversation there
    is_last: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def context_key(self) -> str:
        """Items sharing this key have the same context (a real turn and the simulated turns for its context)."""
        import hashlib
        import json

        return hashlib.sha1(json.dumps(self.context, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "context": self.context, "user_turn": self.user_turn}
        if self.conversation_id is not None:
            d["conversation_id"] = self.conversation_id
        if self.is_last:
            d["is_last"] = True
        if self.meta:
            d["meta"] = self.meta
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | None = None) -> "TurnRecord":
        if not isinstance(d, dict):
            raise DataError(f"a turn record must be a JSON object, got {type(d).__name__}", source)
        for key in ("id", "context", "user_turn"):
            if key not in d:
                raise DataError(f"turn record has no '{key}' field", source)
        if not isinstance(d["user_turn"], str):
            raise DataError(f"'user_turn' must be a string, got {type(d['user_turn']).__name__}", source)
        context = validate_messages(d["context"], source, require_user=False, field_name="context")
        return cls(
            id=str(d["id"]),
            context=context,
            user_turn=d["user_turn"],
            conversation_id=d.get("conversation_id"),
            is_last=bool(d.get("is_last", False)),
            meta=dict(d.get("meta") or {}),
        )


def validate_messages(
    messages: Any, source: str | None, *, require_user: bool = True, field_name: str = "messages"
) -> list[dict[str, str]]:
    """Check the structure of a message list and return it normalised to {"role", "content"} dicts."""
    if not isinstance(messages, list):
        raise DataError(f"'{field_name}' must be a list of messages, got {type(messages).__name__}", source)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{field_name}[{i}] must be an object with 'role' and 'content'", source)
        role, content = m.get("role"), m.get("content")
        if role is None:
            raise DataError(f"{field_name}[{i}] has no 'role'", source)
        if role not in ROLES:
            raise DataError(f"{field_name}[{i}] has unknown role {role!r} (expected one of {', '.join(ROLES)})", source)
        if not isinstance(content, str):
            raise DataError(
                f"{field_name}[{i}] content must be a string, got {type(content).__name__}", source
            )
        if not content.strip() and role != "system":
            raise DataError(f"{field_name}[{i}] ({role}) has empty content", source)
        out.append({"role": role, "content": content})
    if require_user and not any(m["role"] == "user" for m in out):
        raise DataError("conversation has no user turn", source)
    return out

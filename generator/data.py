"""Turn records for the simulator, with end-of-conversation labels that hold across ShareGPT's cut conversations.

`extract_turns` marks the last user turn of each *Conversation* with `is_last`. ShareGPT cuts long conversations into
parts (`abc_0`, `abc_1`, ...) that share a group; only the last part's last user turn ends the real conversation. In
the embedded corpus 8,724 of 15,598 conversations are such parts, so without this fix about 42% of the "ends" would be
mid-conversation cuts and the simulator would learn to stop far too early. The part index comes from the id; the last
part present after cleaning counts as the end (cleaning dropped the true last part of 61 of 9,072 groups).
"""

from __future__ import annotations

import random
from pathlib import Path

from conversations import Conversation, TurnRecord, extract_turns, split_conversations, split_of
from conversations.schema import DataError

SPLIT_CHOICES = ("train", "val", "test", "all")


def _part_index(c: Conversation) -> int | None:
    if not c.group or c.id == c.group:
        return None
    tail = c.id.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else None


def conversation_ends(convs: list[Conversation]) -> set[str]:
    """Ids of the conversations whose last user turn really ends the conversation: every conversation that is not a
    part, and the highest-numbered part of each group."""
    last_part: dict[str, int] = {}
    for c in convs:
        k = _part_index(c)
        if k is not None:
            last_part[c.group] = max(last_part.get(c.group, -1), k)
    return {c.id for c in convs if _part_index(c) is None or _part_index(c) == last_part[c.group]}


def turns_with_ends(
    convs: list[Conversation], *, max_context_messages: int | None = None, skip_first: bool = False
) -> list[TurnRecord]:
    """`extract_turns`, with `is_last` cleared on the last turn of a conversation part that is continued later."""
    ends = conversation_ends(convs)
    records = extract_turns(convs, max_context_messages=max_context_messages, skip_first=skip_first)
    for r in records:
        if r.is_last and r.conversation_id not in ends:
            r.is_last = False
    return records


def load_conversations_for(data: str) -> list[Conversation]:
    """`sharegpt` (the embedded corpus, cleaned and cached) or a conversation file / dataset."""
    if data == "sharegpt":
        from conversations.embedded import load_corpus

        return load_corpus("sharegpt")[0]
    from conversations import clean_conversations, load_conversations

    convs, _ = load_conversations(data)
    return clean_conversations(convs)[0]


def _is_turn_file(data: str) -> bool:
    p = Path(data)
    if data == "sharegpt" or not p.is_file():
        return False
    from conversations.loaders import iter_raw_records

    for _, obj in iter_raw_records(p):
        return isinstance(obj, dict) and "user_turn" in obj and "context" in obj
    return False


def load_turns(
    data: str,
    split: str = "train",
    *,
    max_context_messages: int | None = None,
    max_turn_chars: int | None = None,
    skip_first: bool = False,
    val_frac: float = 0.05,
    test_frac: float = 0.05,
) -> list[TurnRecord]:
    """Turn records of one split of `data` (a conversation source or a turn-record file), `is_last` fixed across
    conversation parts, turns longer than `max_turn_chars` left out. Turn-record files are split by conversation id
    (or record id) and keep their own `is_last`."""
    if split not in SPLIT_CHOICES:
        raise DataError(f"unknown split {split!r} (choose from {', '.join(SPLIT_CHOICES)})")
    if _is_turn_file(data):
        from conversations import load_turn_records

        records, _ = load_turn_records(data)
        if split != "all":
            records = [r for r in records if split_of(r.conversation_id or r.id, val_frac, test_frac) == split]
        if max_context_messages is not None:
            for r in records:
                system = [m for m in r.context if m["role"] == "system"]
                body = [m for m in r.context if m["role"] != "system"]
                r.context = system + (body[-max_context_messages:] if max_context_messages > 0 else [])
    else:
        convs = load_conversations_for(data)
        if split != "all":
            convs = split_conversations(convs, val_frac, test_frac)[split]
        records = turns_with_ends(convs, max_context_messages=max_context_messages, skip_first=skip_first)
    if max_turn_chars is not None:
        records = [r for r in records if len(r.user_turn) <= max_turn_chars]
    return records


def sample_records(records: list[TurnRecord], n: int | None, seed: int = 0) -> list[TurnRecord]:
    """`n` records drawn at random (seeded), kept in their original order; all of them when n is None or larger."""
    if n is None or n >= len(records):
        return list(records)
    keep = sorted(random.Random(seed).sample(range(len(records)), n))
    return [records[i] for i in keep]

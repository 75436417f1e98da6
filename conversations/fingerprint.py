from __future__ import annotations

import hashlib
import json


def fingerprint(items) -> str:
    """sha256 over the ids and messages (or turn records) in order: names the exact data a run used."""
    h = hashlib.sha256()
    for it in items:
        d = it.to_dict() if hasattr(it, "to_dict") else it
        h.update(json.dumps(d, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()

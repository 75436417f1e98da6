"""Deterministic train/val/test split by a hash of the conversation's split key: no conversation (and no part of a
conversation that was cut into pieces) lands in two splits, whatever order the data comes in."""

from __future__ import annotations

import hashlib

from conversations.schema import Conversation

SPLITS = ("train", "val", "test")


def split_of(key: str, val_frac: float = 0.05, test_frac: float = 0.05, salt: str = "mimesis") -> str:
    if not (0 <= val_frac < 1 and 0 <= test_frac < 1 and val_frac + test_frac < 1):
        raise ValueError(f"val_frac + test_frac must be in [0, 1), got {val_frac} + {test_frac}")
    u = int.from_bytes(hashlib.sha256(f"{salt}:{key}".encode()).digest()[:8], "big") / 2**64
    if u < test_frac:
        return "test"
    if u < test_frac + val_frac:
        return "val"
    return "train"


def split_conversations(
    convs: list[Conversation], val_frac: float = 0.05, test_frac: float = 0.05, salt: str = "mimesis"
) -> dict[str, list[Conversation]]:
    out: dict[str, list[Conversation]] = {s: [] for s in SPLITS}
    for c in convs:
        out[split_of(c.split_key, val_frac, test_frac, salt)].append(c)
    return out

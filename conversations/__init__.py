"""The data layer: one conversation schema, loaders for common formats, cleaning, splits and turn extraction.

Everything downstream (generator, discriminator, adversary, agent_rl) reads conversations and turn records
through this package.
"""

from conversations.schema import Conversation, DataError, TurnRecord, ROLES
from conversations.loaders import load_conversations, load_turn_records, read_items, write_jsonl
from conversations.clean import CleanReport, clean_conversations
from conversations.split import split_of, split_conversations
from conversations.turns import extract_turns

__all__ = [
    "Conversation",
    "DataError",
    "TurnRecord",
    "ROLES",
    "load_conversations",
    "load_turn_records",
    "read_items",
    "write_jsonl",
    "CleanReport",
    "clean_conversations",
    "split_of",
    "split_conversations",
    "extract_turns",
]

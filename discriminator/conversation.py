"""Conversation-level realism: whole conversations as the meter's items, and the conversation diagnostics.

`conversation_items(conversations, seed_user_turns)` turns each conversation into one item for the meter
(`discriminator.turing.measure_td`, the same fresh detectors, balancing, grouped cross-fitting and bootstrap as at
the turn level): the item's text is the user side after the seed (the user turns a simulator wrote, or a real
conversation's turns after the same seed), joined by blank lines; its context is the rest of the conversation (the
seed user turns and every assistant reply), so the neural detector reads the user side against what it answers, and
a real conversation and a simulation started from its opening share a context and therefore a fold group.

The conversation diagnostics (termination F1, turns, role and goal adherence, repetition) are
`generator.diagnostics.conversation_diagnostics`.
"""

from __future__ import annotations

from typing import Sequence

from conversations import Conversation, TurnRecord

TURN_JOIN = "\n\n"


def _user_turns(conv) -> list[str]:
    return [m["content"] for m in conv.messages if m["role"] == "user"]


def conversation_items(conversations: Sequence, seed_user_turns: int = 0, label: str = "") -> list[TurnRecord]:
    """One meter item per conversation (see the module docstring). Conversations whose user side after the seed is
    empty are left out (nothing to judge). `conversations`: `Conversation`s (or anything with id and messages)."""
    out = []
    for conv in conversations:
        seen, text_turns, context = 0, [], []
        for m in conv.messages:
            if m["role"] == "user":
                seen += 1
                if seen > seed_user_turns:
                    text_turns.append(m["content"].strip())
                    continue
            if m["role"] in ("user", "assistant", "system"):
                context.append({"role": m["role"], "content": m["content"]})
        if not any(text_turns):
            continue
        out.append(TurnRecord(id=f"{conv.id}{label}", context=context, user_turn=TURN_JOIN.join(text_turns),
                              conversation_id=str(conv.id), meta={"user_turns": len(text_turns)}))
    return out

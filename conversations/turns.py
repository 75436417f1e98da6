"""Turn extraction: every user turn becomes an item {id, context (messages before it), user_turn}."""

from __future__ import annotations

from conversations.schema import Conversation, TurnRecord


def extract_turns(
    convs: list[Conversation], *, max_context_messages: int | None = None, skip_first: bool = False
) -> list[TurnRecord]:
    """`max_context_messages` keeps only the last N non-system messages of each context (the system prompt, if any,
    is kept); `skip_first` drops turns with no assistant message before them (opening requests)."""
    out = []
    for c in convs:
        users = c.user_turn_indices()
        for k, i in enumerate(users):
            context = c.messages[:i]
            if skip_first and not any(m["role"] == "assistant" for m in context):
                continue
            if max_context_messages is not None:
                system = [m for m in context if m["role"] == "system"]
                body = [m for m in context if m["role"] != "system"]
                context = system + (body[-max_context_messages:] if max_context_messages > 0 else [])
            out.append(
                TurnRecord(
                    id=f"{c.id}#{i}",
                    context=[dict(m) for m in context],
                    user_turn=c.messages[i]["content"],
                    conversation_id=c.id,
                    is_last=k == len(users) - 1,
                )
            )
    return out


def cut_conversations(conversations: Sequence[Conversation], max_user_turns: int) -> list[Conversation]:
    """Each conversation up to (and with the assistant's reply to) its `max_user_turns`-th user turn: the real side
    of a comparison capped where the simulations are capped."""
    out = []
    for c in conversations:
        msgs, seen = [], 0
        for m in c.messages:
            if m["role"] == "user":
                seen += 1
                if seen > max_user_turns:
                    break
            msgs.append(dict(m))
        out.append(Conversation(id=c.id, messages=msgs, source=c.source, group=c.group))
    return out

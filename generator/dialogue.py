"""Whole simulated conversations: the simulator and an assistant take turns, in lock-step across many conversations.

Each round samples one user turn for every conversation still going (one engine call) and gets the assistant's
replies (one batched call). A conversation stops when the simulator writes END_MARKER (the assistant still answers
that last message when `respond_to_last`), writes an empty turn, a replayed assistant has no more replies, or after
`max_turns` simulated user turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from conversations import Conversation
from generator.assistants import Assistant
from generator.engine import Engine, SamplingSettings
from generator.sample import per_item, user_turns

Messages = list[dict[str, str]]


@dataclass
class SimulatedConversation:
    id: str
    messages: Messages
    # True when the simulator produced END_MARKER; False when it ran out of turns (or wrote an empty turn)
    ended: bool = False
    user_turns: int = 0  # simulated user turns (the seed's own turns are not counted)
    goal: str | None = None
    persona: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_conversation(self) -> Conversation:
        return Conversation(id=self.id, messages=[dict(m) for m in self.messages], source="simulated")

    def to_dict(self) -> dict[str, Any]:
        d = {"id": self.id, "messages": self.messages, "ended": self.ended, "user_turns": self.user_turns}
        if self.goal is not None:
            d["goal"] = self.goal
        if self.persona is not None:
            d["persona"] = self.persona
        if self.meta:
            d["meta"] = self.meta
        return d


def simulate_conversations(
    engine: Engine,
    assistant: Assistant,
    settings: SamplingSettings,
    *,
    n: int | None = None,
    contexts: Sequence[Messages] | None = None,
    goals: Sequence[str | None] | str | None = None,
    personas: Sequence[str | None] | str | None = None,
    ids: Sequence[str] | None = None,
    max_turns: int = 4,
    seed: int = 0,
    respond_to_last: bool = True,
    progress: Callable[[int, int], None] | None = None,
    turns_fn: Callable | None = None,
) -> list[SimulatedConversation]:
    """Simulate conversations from `contexts` (seed messages, possibly empty; a seed that ends with a user message
    is first answered by the assistant) or from `n` empty ones. `progress(round, live)` is called each round.
    `turns_fn(contexts, goals, personas, seed) -> [SimulatedTurn]` writes the user turns instead of `engine` (an
    endpoint simulator)."""
    if contexts is None:
        if n is None:
            raise ValueError("give either n or contexts")
        contexts = [[] for _ in range(n)]
    k = len(contexts)
    goals_l, personas_l = per_item(goals, k, "goals"), per_item(personas, k, "personas")
    ids = list(ids) if ids is not None else [f"sim-{seed}-{i}" for i in range(k)]
    convs = [SimulatedConversation(id=ids[i], messages=[dict(m) for m in contexts[i]], goal=goals_l[i],
                                   persona=personas_l[i]) for i in range(k)]
    active = list(range(k))
    opening = [i for i in active if convs[i].messages and convs[i].messages[-1]["role"] == "user"]
    active = _answer(assistant, convs, opening, active)
    for turn in range(max_turns):
        if not active:
            break
        if progress is not None:
            progress(turn, len(active))
        ctx, g, p = [convs[i].messages for i in active], [goals_l[i] for i in active], [personas_l[i] for i in active]
        turns = (turns_fn(ctx, g, p, seed + turn) if turns_fn is not None else
                 user_turns(engine, ctx, settings, goals=g, personas=p, seed=seed + turn))
        answer, still = [], []
        for i, t in zip(active, turns):
            c = convs[i]
            if not t.text:
                c.ended = t.ended
                c.meta["stop"] = "marker" if t.ended else "empty_turn"
                continue
            c.messages.append({"role": "user", "content": t.text})
            c.user_turns += 1
            if t.ended:
                c.ended = True
                c.meta["stop"] = "marker"
                if respond_to_last:
                    answer.append(i)
            else:
                answer.append(i)
                still.append(i)
        still = _answer(assistant, convs, answer, still)
        active = still
    for i in active:
        convs[i].meta["stop"] = "max_turns"
    return convs


def _answer(assistant, convs, answer: list[int], still: list[int]) -> list[int]:
    """The assistant answers the conversations in `answer`; returns `still` without those it had no reply for."""
    if not answer:
        return still
    replies = assistant.respond([convs[i].messages for i in answer], ids=[convs[i].id for i in answer])
    gone = set()
    for i, reply in zip(answer, replies):
        if reply is None:  # a replayed conversation ran out of real replies
            convs[i].meta.setdefault("stop", "replay_exhausted")
            gone.add(i)
        else:
            convs[i].messages.append({"role": "assistant", "content": reply})
    return [i for i in still if i not in gone]

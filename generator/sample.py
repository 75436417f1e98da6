"""Simulated user turns for many contexts at once, on the generation engine (`generator.engine.Engine`).

`simulate_records(engine, records, settings)` writes one turn per real record's context (same id, context and
conversation id); `user_turns(engine, contexts, settings)` does the same for bare contexts with optional goals and
personas. Both render the role-flipped prompt (`generator.prompts.render_prompt`, `settings.max_prompt_tokens`),
cut the text after END_MARKER and report whether the simulator ended the conversation or ran out of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from conversations import TurnRecord
from generator.engine import Engine, SamplingSettings
from generator.prompts import END_MARKER, render_prompt, strip_end_marker

Messages = list[dict[str, str]]


@dataclass
class SimulatedTurn:
    text: str  # the turn, END_MARKER and whatever followed it removed, whitespace trimmed
    ended: bool  # the simulator wrote END_MARKER (it would end the conversation here)
    truncated: bool  # it ran out of `max_new_tokens` before ending the turn


def clean_turn(text: str) -> str:
    """Whitespace trimmed; anything after END_MARKER dropped (the marker itself kept so callers see the end)."""
    i = text.find(END_MARKER)
    if i >= 0:
        text = text[: i + len(END_MARKER)]
    return text.strip()


def per_item(values, n: int, name: str) -> list:
    """One value per context: None -> all None, a string -> repeated, a sequence -> checked for length."""
    if values is None:
        return [None] * n
    if isinstance(values, str):
        return [values] * n
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} contexts")
    return values


def user_turns(
    engine: Engine,
    contexts: Sequence[Messages],
    settings: SamplingSettings,
    *,
    goals: Sequence[str | None] | str | None = None,
    personas: Sequence[str | None] | str | None = None,
    seed: int = 0,
    n: int = 1,
) -> list[SimulatedTurn]:
    """`n` sampled user turns per context (the messages before the user's turn, real orientation), context-major.
    Same seed and inputs, same outputs; the caller's torch RNG is left alone."""
    goals, personas = per_item(goals, len(contexts), "goals"), per_item(personas, len(contexts), "personas")
    prompts = [render_prompt(engine.tokenizer, c, persona=p, goal=g, max_context_tokens=settings.max_prompt_tokens)
               for c, g, p in zip(contexts, goals, personas)]
    out = []
    for c in engine.complete_texts(prompts, settings, seed=seed, n=n):
        raw = clean_turn(c.text)
        text, ended = strip_end_marker(raw)
        # a marker cut off by the budget still counts as an end (strip_end_marker), and then the turn was not cut
        out.append(SimulatedTurn(text=text.strip(), ended=ended, truncated=not c.stopped and not ended))
    return out


def simulate_records(engine: Engine, records: Sequence[TurnRecord], settings: SamplingSettings, *,
                     seed: int = 0) -> list[TurnRecord]:
    """A simulated turn for each record's context: same id, context and conversation id; `user_turn` generated with
    the marker stripped; meta = {"ended": produced END_MARKER, "truncated": hit max_new_tokens}. A goal or persona in
    a record's meta is passed to the simulator."""
    turns = user_turns(engine, [r.context for r in records], settings, goals=[r.meta.get("goal") for r in records],
                       personas=[r.meta.get("persona") for r in records], seed=seed)
    return [
        TurnRecord(id=r.id, context=[dict(m) for m in r.context], user_turn=t.text, conversation_id=r.conversation_id,
                   meta={"ended": t.ended, "truncated": t.truncated})
        for r, t in zip(records, turns)
    ]


def simulate_candidates(engine: Engine, records: Sequence[TurnRecord], settings: SamplingSettings, k: int, *,
                        seed: int = 0) -> list[list[TurnRecord]]:
    """`k` simulated turns for each record's context (one prefill per context), as `simulate_records` writes them,
    each with `meta["candidate"]` = its index: [len(records)][k]."""
    turns = user_turns(engine, [r.context for r in records], settings, goals=[r.meta.get("goal") for r in records],
                       personas=[r.meta.get("persona") for r in records], seed=seed, n=k)
    return [
        [TurnRecord(id=r.id, context=[dict(m) for m in r.context], user_turn=t.text, conversation_id=r.conversation_id,
                    meta={"ended": t.ended, "truncated": t.truncated, "candidate": j})
         for j, t in enumerate(turns[i * k : (i + 1) * k])]
        for i, r in enumerate(records)
    ]

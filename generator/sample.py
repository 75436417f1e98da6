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
from conversations.seeds import derive_seed
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


# an empty turn is drawn again up to this many times: the demo's export left 11 of 300 test contexts without a turn
REDRAW_EMPTY = 2
END_DECISION_SEED = 7_919  # the end decisions' draws: their own stream beside the text's seed


def user_turns(
    engine: Engine,
    contexts: Sequence[Messages],
    settings: SamplingSettings,
    *,
    goals: Sequence[str | None] | str | None = None,
    personas: Sequence[str | None] | str | None = None,
    seed: int = 0,
    n: int = 1,
    redraw_empty: int = REDRAW_EMPTY,
) -> list[SimulatedTurn]:
    """`n` sampled user turns per context (the messages before the user's turn, real orientation), context-major.
    A turn that came out empty (no text: the simulator stopped or wrote the end marker at once; no real user sends
    one) is drawn again, up to `redraw_empty` times, for those rows only. Same seed and inputs, same outputs; the
    caller's torch RNG is left alone."""
    goals, personas = per_item(goals, len(contexts), "goals"), per_item(personas, len(contexts), "personas")
    prompts = [render_prompt(engine.tokenizer, c, persona=p, goal=g, max_context_tokens=settings.max_prompt_tokens)
               for c, g, p in zip(contexts, goals, personas)]
    out = [_turn(c) for c in engine.complete_texts(prompts, settings, seed=seed, n=n)]
    for attempt in range(1, redraw_empty + 1):
        empty = [i for i, t in enumerate(out) if not t.text]
        if not empty:
            break
        again = engine.complete_texts([prompts[i // n] for i in empty], settings,
                                      seed=derive_seed(seed, stream=attempt))
        for i, c in zip(empty, again):
            out[i] = _turn(c)
    if settings.end_bias is not None:  # the end decision drawn apart from the text (generator.ending)
        from generator.ending import end_decisions

        ends = end_decisions(engine, [prompts[i // n] for i in range(len(out))], [t.text for t in out],
                             settings.end_bias, seed + END_DECISION_SEED)
        out = [SimulatedTurn(text=t.text, ended=e, truncated=t.truncated) for t, e in zip(out, ends)]
    return out


def _turn(c) -> SimulatedTurn:
    text, ended = strip_end_marker(clean_turn(c.text))
    # a marker cut off by the budget still counts as an end (strip_end_marker), and then the turn was not cut
    return SimulatedTurn(text=text.strip(), ended=ended, truncated=not c.stopped and not ended)


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

"""The meter's conversation level: held-out real conversations continued by the simulator, read beside the turns.

At every reading (`conv_contexts` > 0), each held-out real conversation (test split, opening with a user turn and
with at least one more user turn, so the real side has a continuation to judge) is
seeded with its first real user turn and continued by the simulator for up to `conv_max_turns` user turns against
the replayed assistant (the real conversation's own replies, in order: every reading meets the same assistant, as
`adversary.compare` does). The fresh detector panel then scores whole conversations (`discriminator.conversation`),
and ending is scored against where the real users stopped:
- `conv/td`, `conv/ci_low`, `conv/ci_high`: the panel td on whole conversations;
- `conv/termination_f1`, `conv/termination_precision`, `conv/termination_recall`: "ends here" against the real
  user's last turn (a real conversation longer than the window has no end inside it);
- `conv/ends_per_real`: the simulator's share of ended conversations over the real share within the window (1 is
  human); `conv/turns_per_real`: simulated user turns per conversation over the real ones (window-capped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from conversations.seeds import seed_for

if TYPE_CHECKING:
    from adversary.config import AdversaryConfig, MeterArgs, SamplingArgs

SEED_USER_TURNS = 1  # the real opening turn every continuation starts from


def heldout_conversations(cfg: AdversaryConfig, seed: int) -> list:
    """`conv_contexts` real conversations of the test split that open with a user turn and have another after it,
    drawn with `seed` (the same split as the turn-level contexts: split by conversation id with the loaders'
    fractions)."""
    import random

    from conversations import split_conversations
    from generator.data import load_conversations_for

    if not cfg.conv_contexts:
        return []
    convs = split_conversations(load_conversations_for(cfg.data), 0.05, 0.05)["test"]
    # opening with a user turn and with at least one more: the real side of every item has a continuation to judge
    # (a conversation the user ended after the opening has none; such openings are left out of this level)
    convs = [c for c in convs if (body := [m for m in c.messages if m["role"] != "system"]) and body[0]["role"] == "user"
             and sum(m["role"] == "user" for m in body) > SEED_USER_TURNS]
    n = min(cfg.conv_contexts, len(convs))
    rng = random.Random(seed_for("conversation_pick", seed))
    return [convs[i] for i in sorted(rng.sample(range(len(convs)), n))]


def end_calibration(cfg: AdversaryConfig, train: list, seed: int) -> tuple[list, float | None]:
    """(contexts, target rate) of the calibrated end decision (`end_decision: calibrated`): `end_calibration_contexts`
    train records with an assistant reply before them (the simulator writes a turn after an opening, as in the window),
    and the real users' end rate per turn inside the window, read on the train split's conversations."""
    import random

    from conversations import split_conversations
    from generator.data import load_conversations_for
    from generator.ending import window_end_rate

    if cfg.end_decision != "calibrated" or not cfg.conv_contexts:
        return [], None
    after = [r for r in train if any(m["role"] == "assistant" for m in r.context)]  # not an opening request
    rng = random.Random(seed_for("end_calibration", seed))
    picked = rng.sample(after, min(cfg.end_calibration_contexts, len(after)))
    convs = split_conversations(load_conversations_for(cfg.data), 0.05, 0.05)["train"]
    return picked, window_end_rate(convs, SEED_USER_TURNS, cfg.conv_max_turns)


def calibrated_end_bias(model, tokenizer, records: list, cfg: SamplingArgs, settings, target: float, seed: int,
                        precision: str | None = None) -> float:
    """The logit offset at which the simulator (as it is now) ends `target` of its turns on `records`' contexts: its
    own turns sampled at `settings` (the marker as sampled: the decision is what is being solved), their p_end read,
    the offset solved (generator.ending.solve_end_bias)."""
    import dataclasses

    from generator.engine import Engine
    from generator.ending import end_probabilities, solve_end_bias
    from generator.prompts import render_prompt
    from generator.sample import user_turns

    engine = Engine(model, tokenizer, batch_size=cfg.sim_batch_size, precision=precision)
    contexts = [r.context for r in records]
    turns = user_turns(engine, contexts, dataclasses.replace(settings, end_bias=None), seed=seed)
    prompts = [render_prompt(tokenizer, c, max_context_tokens=settings.max_prompt_tokens) for c in contexts]
    return solve_end_bias(end_probabilities(engine, prompts, [t.text for t in turns]), target)


def simulate_heldout_conversations(model, tokenizer, convs: list, cfg: AdversaryConfig, settings, seed: int,
                                   precision: str | None = None, guide=None):
    """The simulator's continuations of `convs` at `settings` (the meter's) as
    `generator.dialogue.SimulatedConversation`s, ids the real ones'. With a `guide` (`adversary.guidance.Guide`,
    K > 1) every user turn is the one it keeps of K sampled, as a guided export writes them."""
    from generator.assistants import ReplayAssistant
    from generator.dialogue import simulate_conversations
    from generator.engine import Engine

    engine = Engine(model, tokenizer, batch_size=cfg.sim_batch_size, precision=precision)
    turns_fn = None
    if guide is not None and guide.k > 1:
        from adversary.guidance import guided_turns_fn

        turns_fn = guided_turns_fn(engine, guide, settings)
    openings = [[m for m in c.messages if m["role"] != "system"][:SEED_USER_TURNS] for c in convs]
    assistant = ReplayAssistant.from_conversations(convs, start_user_turns=SEED_USER_TURNS)
    return simulate_conversations(engine, assistant, settings, contexts=openings, ids=[str(c.id) for c in convs],
                                  max_turns=cfg.conv_max_turns, seed=seed, turns_fn=turns_fn)


def measure_conversations(real: list, simulated: list, cfg: MeterArgs, seed: int = 0,
                          return_scores: bool = False) -> dict:
    """The `conv/*` entries of a curve row (see the module docstring). With `return_scores`, also "oof": the
    detectors' out-of-fold scores per conversation item (labels, ids, scores), for paired differences between arms."""
    from conversations.turns import cut_conversations
    from discriminator.conversation import conversation_items
    from discriminator.turing import measure_td, oof_record
    from generator.diagnostics import termination_scores

    window = SEED_USER_TURNS + cfg.conv_max_turns
    cut = cut_conversations(real, window)
    rep = measure_td(conversation_items(cut, seed_user_turns=SEED_USER_TURNS),
                     conversation_items([s.to_conversation() for s in simulated], seed_user_turns=SEED_USER_TURNS,
                                        label="@sim"),
                     detectors=tuple(cfg.heldout_detectors), folds=cfg.heldout_folds, seed=seed,
                     return_scores=return_scores)
    n_real = {str(c.id): sum(m["role"] == "user" for m in c.messages) - SEED_USER_TURNS for c in real}
    pairs, sim_turns, real_turns, real_ends = [], [], [], []
    for s in simulated:
        k = sum(m["role"] == "user" for m in s.messages) - SEED_USER_TURNS
        ends = [False] * k
        if s.ended and k:
            ends[-1] = True
        r = n_real.get(str(s.id), 0)
        pairs.append((ends, r if r <= cfg.conv_max_turns else -1))  # -1: the real user went on past the window
        sim_turns.append(k)
        real_turns.append(min(r, cfg.conv_max_turns))
        real_ends.append(r <= cfg.conv_max_turns)
    term = termination_scores(pairs)
    real_end_rate = float(np.mean(real_ends)) if real_ends else float("nan")
    sim_end_rate = float(np.mean([s.ended for s in simulated])) if simulated else float("nan")
    oof = {"oof": oof_record(rep["oof"])} if return_scores else {}
    return {
        **oof,
        "conv/td": rep["td"], "conv/ci_low": rep["td_ci95"][0], "conv/ci_high": rep["td_ci95"][1],
        "conv/auc": rep["auc"], "conv/conversations": len(simulated),
        "conv/termination_f1": term["termination_f1"], "conv/termination_precision": term["termination_precision"],
        "conv/termination_recall": term["termination_recall"],
        "conv/end_rate": sim_end_rate, "conv/real_end_rate": real_end_rate,
        "conv/ends_per_real": sim_end_rate / real_end_rate if real_end_rate else float("nan"),
        "conv/turns_per_real": float(np.mean(sim_turns)) / max(float(np.mean(real_turns)), 1e-9) if real_turns else float("nan"),
    }


def conversation_line(row: dict) -> str:
    """The conversation level of a reading's printed line ('' when the meter reads turns only)."""
    if "conv/td" not in row:
        return ""
    f1 = row["conv/termination_f1"]
    return (f"; conversations: td {row['conv/td']:.1f} ({row['conv/ci_low']:.1f}-{row['conv/ci_high']:.1f}), "
            f"termination F1 {f1:.2f}, ends/real {row['conv/ends_per_real']:.2f}, turns/real "
            f"{row['conv/turns_per_real']:.2f}"
            + (f", end bias {row['conv/end_bias']:+.2f}" if "conv/end_bias" in row else ""))

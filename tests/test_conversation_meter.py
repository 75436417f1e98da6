"""The meter's conversation level: ending scored against where real users stopped (exact values), and the main job
reading both levels with the gate on the conversation one."""

import json
from pathlib import Path

import pytest

from adversary.config import AdversaryConfig
from conversations.schema import Conversation
from generator.dialogue import SimulatedConversation

ROOT = Path(__file__).resolve().parent.parent


def _conv(i, users, prefix="real"):
    msgs = []
    for k in range(users):
        msgs += [{"role": "user", "content": f"{prefix} {i} turn {k}"}, {"role": "assistant", "content": f"reply {k}"}]
    return msgs


def test_termination_and_rates_against_the_real_users_within_the_window():
    cfg = AdversaryConfig(heldout_detectors=["classical"], heldout_folds=2, conv_max_turns=2)
    from adversary.conversation_meter import measure_conversations

    # even ids: the real user stops after 1 turn past the opening, and so does the simulator (an end found);
    # odd ids: the real user goes on for 5 more (past the window: no end to find), the simulator writes 2 and stops
    # without ending (right) -- except id 1, which ends at its 2nd turn (a false end)
    real = [Conversation(id=str(i), messages=_conv(i, 2 if i % 2 == 0 else 6)) for i in range(20)]
    sims = []
    for i in range(20):
        k = 1 if i % 2 == 0 else 2
        msgs = _conv(i, 1 + k, "sim")[:-1]  # the opening, k simulated turns, the last one unanswered
        sims.append(SimulatedConversation(id=str(i), messages=msgs, ended=(i % 2 == 0) or i == 1, user_turns=k))
    row = measure_conversations(real, sims, cfg)
    assert row["conv/termination_precision"] == pytest.approx(10 / 11)  # 10 true ends, 1 false
    assert row["conv/termination_recall"] == 1.0
    assert row["conv/termination_f1"] == pytest.approx(2 * (10 / 11) / (10 / 11 + 1))
    assert row["conv/end_rate"] == pytest.approx(11 / 20) and row["conv/real_end_rate"] == 0.5
    assert row["conv/ends_per_real"] == pytest.approx(1.1)
    assert row["conv/turns_per_real"] == pytest.approx(1.0)  # 1.5 simulated turns against 1.5 real (window-capped)
    assert row["conv/conversations"] == 20 and 0 <= row["conv/td"] <= 50


def test_a_simulator_that_always_ends_at_once_and_one_that_never_ends():
    import math

    from adversary.conversation_meter import measure_conversations

    cfg = AdversaryConfig(heldout_detectors=["classical"], heldout_folds=2, conv_max_turns=2)
    # even ids: the real user stops 1 turn after the opening; odd ids: goes on past the 2-turn window
    real = [Conversation(id=str(i), messages=_conv(i, 2 if i % 2 == 0 else 6)) for i in range(20)]
    at_once = [SimulatedConversation(id=str(i), messages=_conv(i, 2, "sim")[:-1], ended=True, user_turns=1)
               for i in range(20)]
    row = measure_conversations(real, at_once, cfg)
    # 10 ends found, 10 false ends where the real user went on
    assert row["conv/termination_precision"] == 0.5 and row["conv/termination_recall"] == 1.0
    assert row["conv/termination_f1"] == pytest.approx(2 / 3)
    assert row["conv/ends_per_real"] == 2.0 and row["conv/turns_per_real"] == pytest.approx(1 / 1.5)
    never = [SimulatedConversation(id=str(i), messages=_conv(i, 3, "sim")[:-1], ended=False, user_turns=2)
             for i in range(20)]
    row = measure_conversations(real, never, cfg)
    assert row["conv/termination_f1"] == 0.0 and row["conv/termination_recall"] == 0.0
    assert math.isnan(row["conv/termination_precision"])  # it never said "ends here"
    assert row["conv/ends_per_real"] == 0.0 and row["conv/turns_per_real"] == pytest.approx(2 / 1.5)


def test_the_gate_on_the_conversation_level_needs_conversations():
    from conversations.config import ConfigError

    with pytest.raises(ConfigError, match="conv_contexts >= 20"):
        AdversaryConfig(gate_level="conversation")


def test_the_main_job_reads_both_levels_and_the_export_records_them(tmp_path):
    from adversary.train import main

    out = tmp_path / "conv"
    argv = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--output_dir", str(out), "--objective", "dpo_rounds",
            "--round_contexts", "8", "--dpo_batch_size", "4", "--dpo_micro_batch", "2", "--max_rounds", "1", "--round_chosen", "real",
            "--conv_contexts", "24", "--conv_max_turns", "2", "--gate_level", "conversation", "--disc_sees_end", "true",
            "--end_decision", "calibrated", "--end_calibration_contexts", "8"]
    assert main(argv) == 0
    manifest = json.loads((out / "frozen" / "simulator.json").read_text())
    rows = manifest["td_curve"]
    assert [r["step"] for r in rows] == [0, 2]
    assert all(0 <= r["conv/td"] <= 50 and r["conv/conversations"] == 24 and "td/panel" in r for r in rows)
    best = manifest["best"]
    assert best["gate_level"] == "conversation"
    best_row = next(r for r in rows if r["step"] == best["step"])
    assert best["td"] == best_row["conv/td"] and best["turn_td"] == best_row["td/panel"]
    assert best["conversation"]["conv/td"] == best_row["conv/td"]
    assert "conv/termination_f1" in (out / "curves.csv").read_text().splitlines()[0]
    # the calibrated end decision: an offset solved at every reading, the best reading's in the export's settings
    assert all(-20 <= r["conv/end_bias"] <= 20 for r in rows)
    assert manifest["sampling"]["end_bias"] == best_row["conv/end_bias"]
    # the shipped export read at both levels too, beside the others in summary.json, the card and the last line
    summary = json.loads((out / "summary.json").read_text())
    shipped = summary["simulators"]["shipped"]
    assert 0 <= summary["shipped_conv_td"] <= 50 and shipped["conv_td"] == summary["shipped_conv_td"]
    row = next(line for line in (out / "frozen" / "README.md").read_text().splitlines() if line.startswith("| **shipped export**"))
    assert f"{shipped['conv_td']:.1f} [" in row and f"{shipped['td']:.1f} [" in row


@pytest.mark.parametrize("when", ["first_and_best", "best"])
def test_conversations_at_the_first_and_the_best_reading_only(tmp_path, monkeypatch, when):
    import adversary.heldout as heldout
    from adversary.train import main

    measured = heldout.mean_rows
    readings = []

    def falling(rows):  # each reading 10 points below the last: the gate's best is the last round's checkpoint
        row = measured(rows)
        readings.append(row)
        td = 40.0 - 10 * len(readings)
        return {**row, "td/panel": td, "td/ci_low": td - 1, "td/ci_high": td + 1}

    monkeypatch.setattr(heldout, "mean_rows", falling)
    out = tmp_path / "firstbest"
    argv = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--output_dir", str(out), "--objective", "dpo_rounds",
            "--round_contexts", "8", "--dpo_batch_size", "4", "--dpo_micro_batch", "2", "--max_rounds", "2",
            "--round_chosen", "real", "--conv_contexts", "24", "--conv_max_turns", "2", "--end_decision", "calibrated",
            "--end_calibration_contexts", "8", "--conv_readings", when, "--gate_patience", "5"]
    assert main(argv) == 0
    manifest = json.loads((out / "frozen" / "simulator.json").read_text())
    rows = manifest["td_curve"]
    assert [r["step"] for r in rows] == [0, 2, 4] and manifest["best"]["step"] == 4
    if when == "first_and_best":
        assert "conv/td" in rows[0] and "conv/read_after_phase" not in rows[0]
    else:  # best: the step-0 reading reads turns only
        assert not any(k.startswith("conv/") for k in rows[0])
    assert not any(k.startswith("conv/") for k in rows[1])  # not the first, not the best: turns only
    best = rows[2]
    assert best["conv/read_after_phase"] == 1 and 0 <= best["conv/td"] <= 50 and best["conv/conversations"] == 24
    assert manifest["sampling"]["end_bias"] == best["conv/end_bias"]  # the export ends at the best's own offset
    assert manifest["best"]["conversation"]["conv/td"] == best["conv/td"]
    summary = json.loads((out / "summary.json").read_text())
    assert "best_conversations" in summary["stage_seconds"]
    with pytest.raises(Exception, match="set conv_readings every"):
        AdversaryConfig(gate_level="conversation", conv_contexts=24, conv_readings="first_and_best")


def test_the_discriminator_sees_ending_only_when_asked():
    from adversary.discriminator import with_end
    from generator.prompts import END_MARKER

    assert with_end("ok thanks", True, True) == f"ok thanks {END_MARKER}"
    assert with_end("ok thanks", False, True) == "ok thanks" == with_end("ok thanks", True, False)

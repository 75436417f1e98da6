"""`python -m generator.simulate` end to end with the tiny random model."""

import json

import pytest

from conversations import load_turn_records
from generator.simulate import main


def test_simulate_cli_writes_paired_records(tmp_path, capsys):
    sim_path, real_path, report = tmp_path / "sim.jsonl", tmp_path / "real.jsonl", tmp_path / "diag.json"
    argv = [
        "--model", "tiny-random", "--data", "sharegpt", "--split", "test", "--limit", "6",
        "--out", str(sim_path), "--real-out", str(real_path), "--report", str(report),
        "--max-new-tokens", "4", "--batch-size", "4", "--max-context-messages", "2",
    ]  # fmt: skip
    summary = main(argv)
    printed = json.loads(capsys.readouterr().out)
    sim, _ = load_turn_records(sim_path)
    real, _ = load_turn_records(real_path)
    assert len(sim) == len(real) == 6 == summary["n"] == printed["n"]
    assert [s.id for s in sim] == [r.id for r in real]
    assert [s.context_key for s in sim] == [r.context_key for r in real]
    assert all(len(r.context) <= 2 for r in real)
    assert all(set(s.meta) == {"ended", "truncated"} for s in sim)
    assert any(s.user_turn != r.user_turn for s, r in zip(sim, real))
    diag = json.loads(report.read_text())["diagnostics"]
    assert diag["n_pairs"] == 6 and "len_ratio_median" in diag and "assistant_likeness" in diag

    # the written real records are valid input too (a turn-record file, all of it); same seed, same turns
    again = main(argv[:2] + ["--data", str(real_path), "--split", "all", "--out", str(tmp_path / "sim2.jsonl")] + argv[10:])
    capsys.readouterr()
    sim2, _ = load_turn_records(tmp_path / "sim2.jsonl")
    assert again["n"] == 6 and [s.id for s in sim2] == [s.id for s in sim]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--split", "dev"], "--split must be one of"),
        (["--limit", "0"], "limit must be >= 1, got 0"),
        (["--data", "missing.jsonl", "--model", "tiny-random"], "missing.jsonl"),
    ],
)
def test_simulate_cli_bad_input_exits_2(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--out", str(tmp_path / "x.jsonl")])
    assert e.value.code == 2 and message in capsys.readouterr().err

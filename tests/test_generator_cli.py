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


def test_simulate_an_export_samples_with_its_recorded_settings(tmp_path, tiny_lm_path, capsys):
    import shutil

    export = tmp_path / "frozen"
    shutil.copytree(tiny_lm_path, export)
    recorded = {"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_new_tokens": 1,
                "max_prompt_tokens": 64, "end_bias": 1.5}  # a calibrated end decision travels with the rest
    (export / "simulator.json").write_text(json.dumps({"sampling": recorded}))
    base = ["--model", str(export), "--limit", "4", "--out", str(tmp_path / "s.jsonl"), "--batch-size", "4"]
    summary = main(base)
    assert summary["sampling"] == recorded and summary["sampling_source"] == "the export's recorded settings"
    assert "sampling: " in capsys.readouterr().err
    over = main(base + ["--temperature", "0.5"])
    assert over["sampling"] == {**recorded, "temperature": 0.5} and "temperature=0.5" in over["sampling_source"]
    plain = main(["--model", tiny_lm_path, "--limit", "4", "--out", str(tmp_path / "p.jsonl")])
    assert plain["sampling"]["max_new_tokens"] == 96 and plain["batch_size"] == 128
    assert plain["sampling_source"] == "the defaults"

"""`python -m agent_rl.chat`: a person plays the assistant through standard input; the transcript is a messages
record the data layer reads back."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV_KEYS = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def chat(tmp_path, stdin, *extra):
    import os

    out = tmp_path / "chat.jsonl"
    r = subprocess.run([sys.executable, "-m", "agent_rl.chat", "hf:tiny-random", "--out", str(out), *extra],
                       input=stdin, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, **ENV_KEYS})
    assert r.returncode == 0, r.stderr[-2000:]
    return r, out


def test_chat_through_standard_input_saves_a_transcript_that_reads_back(tmp_path):
    from conversations import load_conversations

    r, out = chat(tmp_path, "Hello! How can I help?\nline one\\nline two\n/end\n", "--greeting", "Hi there",
                  "--goal", "find a flight")
    (rec,) = [json.loads(x) for x in out.read_text().splitlines()]
    roles = [m["role"] for m in rec["messages"]]
    # greeting, user, assistant, user, assistant, user: /end stops before a fourth assistant message
    assert roles == ["assistant", "user", "assistant", "user", "assistant", "user"]
    assert rec["messages"][2]["content"] == "Hello! How can I help?"
    assert rec["messages"][4]["content"] == "line one\nline two"  # \n in a line is a line break
    assert rec["meta"]["ended_by"] == "command" and rec["meta"]["goal"] == "find a flight"
    assert rec["meta"]["user_turns"] == 3
    assert r.stdout.count("user> ") == 3  # piped: the conversation on stdout, the banner on stderr
    convs, _ = load_conversations(str(out), "auto")
    assert len(convs) == 1 and len(convs[0].messages) == 6


def test_chat_ends_at_the_end_of_input_and_appends(tmp_path):
    chat(tmp_path, "")
    _, out = chat(tmp_path, "ok\n", "--max-turns", "1")
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["meta"]["ended_by"] for r in recs] == ["end_of_input", "max_turns"]
    assert [len(r["messages"]) for r in recs] == [1, 1]


def test_chat_refuses_a_bad_simulator_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "agent_rl.chat", str(tmp_path / "nope")], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "error:" in r.stderr

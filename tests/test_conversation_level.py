"""Conversation-level realism: the meter on whole conversations, the judge protocols against a scripted judge on
loopback, the conversation diagnostics, and whole simulated conversations through the CLI."""

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conversations import Conversation
from discriminator.conversation import conversation_items
from discriminator.turing import measure_td

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus():
    from generator.data import load_conversations_for

    convs = [c for c in load_conversations_for("sharegpt") if sum(m["role"] == "user" for m in c.messages) >= 2
             and c.messages[0]["role"] == "user"]
    random.Random(0).shuffle(convs)
    return convs


TEMPLATE = ("Thank you so much for your detailed explanation! Could you please elaborate further on each of the points "
            "above, providing comprehensive examples and a structured summary?")


def templated(convs):
    """Assistant-style users: every user turn after the first a polite, complete, tireless request."""
    out = []
    for c in convs:
        msgs, seen = [], 0
        for m in c.messages:
            if m["role"] == "user":
                seen += 1
                if seen > 1:
                    m = {"role": "user", "content": TEMPLATE}
            msgs.append(m)
        out.append(Conversation(id=c.id, messages=msgs))
    return out


def test_real_against_real_conversations_read_near_zero(corpus):
    a, b = corpus[:300], corpus[300:600]
    r = measure_td(conversation_items(a, 1), conversation_items(b, 1, "@b"), detectors=("classical", "style"),
                   folds=5, seed=0, n_boot=300)
    assert r["td"] <= 6, r["detectors"]


def test_templated_assistant_users_read_above_40(corpus):
    real = corpus[:150]
    r = measure_td(conversation_items(real, 1), conversation_items(templated(corpus[150:300]), 1, "@sim"),
                   detectors=("classical", "style"), folds=5, seed=0, n_boot=300)
    assert r["td"] >= 40


def test_conversation_items_leave_out_the_seed_and_group_with_their_source():
    c = Conversation(id="c1", messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                        {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"},
                                        {"role": "user", "content": "bye"}])
    (item,) = conversation_items([c], seed_user_turns=1)
    assert item.user_turn == "more\n\nbye" and item.meta["user_turns"] == 2
    assert [m["content"] for m in item.context] == ["hi", "hello", "ok"]
    sim = Conversation(id="c1", messages=[*c.messages[:2], {"role": "user", "content": "x"}])
    (s,) = conversation_items([sim], 1, "@sim")
    assert s.id == "c1@sim" and s.context[:2] == item.context[:2]
    assert conversation_items([Conversation(id="z", messages=c.messages[:2])], 1) == []  # nothing after the seed


def test_termination_and_conversation_diagnostics_exact():
    from generator.dialogue import SimulatedConversation
    from generator.diagnostics import answers_own_question, repetition, termination_scores

    # conv 1 ends at turn 2 where the real user stopped (TP); conv 2 ends at 1 but the real one went on (FP);
    # conv 3 ran past the real end at turn 2 without ending (FN)
    s = termination_scores([([False, True], 2), ([True], 3), ([False, False, False], 2)])
    assert s == {"termination_precision": 0.5, "termination_recall": 0.5, "termination_f1": 0.5, "termination_support": 2}
    never = termination_scores([([False, False], 2), ([False], 1)])  # a simulator that never ends
    assert never["termination_f1"] == 0.0 and never["termination_recall"] == 0.0 and never["termination_support"] == 2
    assert math.isnan(never["termination_precision"])
    assert repetition(["book a table for two", "book a table for two please"]) == 0.75  # 3 of its 4 trigrams
    assert repetition(["book a table for two", "hm", "book a table for two"]) == 1.0
    assert repetition(["hello there friend", "something else entirely new"]) == 0.0
    assert answers_own_question("What is the capital of France? The capital of France is Paris, a city of about two million.")
    assert not answers_own_question("What is the capital of France?")
    from generator.diagnostics import conversation_diagnostics

    real = [Conversation(id="a", messages=[{"role": "user", "content": "u1"}, {"role": "assistant", "content": "r"},
                                           {"role": "user", "content": "u2"}])]
    sim = [SimulatedConversation(id="a", messages=[{"role": "user", "content": "u1"},
                                                   {"role": "assistant", "content": "r"},
                                                   {"role": "user", "content": "thanks"}], ended=True, user_turns=1)]
    d = conversation_diagnostics(sim, real, seed_user_turns=1)
    assert d["termination_f1"] == 1.0 and d["turns_per_conversation"] == 1 and d["real_turns_per_conversation"] == 1


@pytest.fixture()
def scripted_judge(scripted_endpoint):
    """An OpenAI-compatible judge on loopback. mode 'human': says HUMAN to every conversation and 4 (cannot tell) to
    every pair; mode 'oracle': knows the answer (the templated user's sentence, or the real turns' texts it was given)."""
    state = {"mode": "human", "real_texts": set()}

    def answer(body, headers):
        prompt = body["messages"][-1]["content"]
        if "1 to 7" in prompt:  # pairwise
            a = prompt.split("Message A:\n", 1)[1].split("\n\nMessage B:", 1)[0]
            return "4" if state["mode"] == "human" else ("1" if a in state["real_texts"] else "7")
        return "HUMAN" if state["mode"] == "human" or TEMPLATE not in prompt else "AI"

    ep = scripted_endpoint(answer)
    state["endpoint"] = ep
    return ep.url, state


def test_judges_end_to_end_against_a_scripted_judge(corpus, scripted_judge, tmp_path, monkeypatch):
    from discriminator.judges import judge_pairwise, judge_single, make_judge

    url, state = scripted_judge
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-judge-secret")
    real, sim = corpus[:40], templated(corpus[40:80])
    judge = make_judge(f"openai:judge@{url}", cache_dir=tmp_path / "cache", api_key_env="JUDGE_TEST_KEY")
    rep = judge_single(judge, real, sim, n_boot=200)
    assert rep.accuracy == 50.0 and rep.td == 0.0 and rep.extra["human_rate_on_real"] == 1.0
    assert state["endpoint"].seen[0]["auth"] == "Bearer sk-judge-secret" and "sk-judge" not in repr(judge.client)
    state["mode"] = "oracle"
    rep = judge_single(make_judge(f"openai:judge@{url}", cache_dir=tmp_path / "cache2"), real, sim, n_boot=200)
    assert rep.accuracy == 100.0 and rep.td == 50.0
    # an interrupted evaluation resumes from the cache: the same requests reach the judge no more
    before = len(state["endpoint"].seen)
    again = judge_single(make_judge(f"openai:judge@{url}", cache_dir=tmp_path / "cache2"), real, sim, n_boot=200)
    assert len(state["endpoint"].seen) == before and again.td == 50.0
    # pairwise: real turns and templated ones for the same contexts, order by a hash of the pair
    from conversations import TurnRecord

    rt = [TurnRecord(id=f"t{i}", context=[{"role": "assistant", "content": "How can I help?"}],
                     user_turn=f"real turn number {i} about my printer") for i in range(30)]
    st = [TurnRecord(id=f"t{i}@sim", context=r.context, user_turn=f"Could you kindly help me with item {i}?")
          for i, r in enumerate(rt)]
    state["real_texts"] = {r.user_turn for r in rt}
    p = judge_pairwise(make_judge(f"openai:judge@{url}", cache_dir=tmp_path / "cache3"), rt, st, n_boot=200)
    assert p.td == 50.0 and p.extra["ties"] == 0 and 0.2 < p.extra["real_shown_first"] < 0.8
    state["mode"] = "human"
    p = judge_pairwise(make_judge(f"openai:judge@{url}", cache_dir=tmp_path / "cache4"), rt, st, n_boot=200)
    assert p.extra["ties"] == 30 and p.accuracy == 50.0 and p.td == 0.0


def test_evaluate_cli_conversation_level_and_local_judge(corpus, tmp_path, tiny_lm_path):
    from conversations import write_jsonl

    write_jsonl(tmp_path / "real.jsonl", corpus[:60])
    write_jsonl(tmp_path / "sim.jsonl", templated(corpus[60:120]))
    base = [sys.executable, "-m", "discriminator.evaluate", "--real", str(tmp_path / "real.jsonl"), "--simulated",
            str(tmp_path / "sim.jsonl"), "--level", "conversation", "--seed-user-turns", "1", "--n-boot", "100"]
    r = subprocess.run(base + ["--detectors", "classical", "style", "--out", str(tmp_path / "r.json"), "--quiet"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "r.json").read_text())["td"] >= 40
    r = subprocess.run(base + ["--judge", "single", "--judge-model", f"hf:{tiny_lm_path}", "--out", str(tmp_path / "j.json")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    j = json.loads((tmp_path / "j.json").read_text())
    assert j["protocol"] == "single" and j["n"] == 120 and 0 <= j["td"] <= 50 and j["unparsable"] == 0


def test_simulate_conversations_cli_writes_checkable_conversations(tmp_path, tiny_lm_path):
    out = tmp_path / "convs.jsonl"
    cmd = [sys.executable, "-m", "generator.simulate", "--conversations", "--model", tiny_lm_path, "--assistant",
           "replay", "--limit", "6", "--max_turns", "2", "--max_new_tokens", "6", "--batch_size", "8", "--out",
           str(out), "--real_out", str(tmp_path / "real.jsonl"), "--dtype", "fp32"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout[r.stdout.index("{"):])
    assert summary["n"] == 6 and "termination_f1" in summary["diagnostics"]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 6 and all(1 <= r_["user_turns"] <= 2 for r_ in rows)
    assert all(r_["messages"][0]["role"] == "user" for r_ in rows)  # the real opening is the seed
    check = subprocess.run([sys.executable, "-m", "conversations", "check", str(out)], capture_output=True, text=True,
                           cwd=ROOT, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


def test_compare_cli_pools_seeds_and_pairs_simulators(tmp_path, tiny_lm_path):
    """adversary.compare with --seeds: each simulator samples once per seed at both levels, its td is the mean over
    the seeds, and the second simulator gets its paired difference to the first at both levels."""
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "adversary.compare", "--simulators", "hf:tiny-random", f"hf:{tiny_lm_path}",
           "--out", str(out), "--turn_contexts", "24", "--conversations", "40", "--max_turns", "1",
           "--detectors", "classical", "--folds", "2", "--max_new_tokens", "3", "--seeds", "1", "2",
           "--n_boot", "100", "--end_bias", "2.0", "--dtype", "fp32"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads((out / "compare.json").read_text())
    first, second = doc["rows"]
    for row in (first, second):
        assert [s["seed"] for s in row["per_seed"]] == [1, 2]
        for level in ("turn", "conversation"):
            tds = [s[level]["td"] for s in row["per_seed"]]
            assert row[level]["td"] == pytest.approx(sum(tds) / 2)
            lo, hi = row[level]["td_ci95"]
            assert 0 <= lo <= hi <= 50
    assert "vs_first" not in first
    for level in ("turn", "conversation"):
        d = second["vs_first"][level]
        assert d["td_difference"] == pytest.approx(second[level]["td"] - first[level]["td"])
        assert d["ci95"][0] <= d["ci95"][1]
    # every seed's samples are written, and the two seeds sampled differently
    a, b = (out / "sim_turns_00.jsonl").read_text(), (out / "sim_turns_00.seed2.jsonl").read_text()
    assert len(a.splitlines()) == len(b.splitlines()) == 24 and a != b
    assert "conversation td - hf:tiny-random" in (out / "compare.md").read_text()

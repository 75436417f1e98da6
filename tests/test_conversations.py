import json
import subprocess
import sys

import pytest

from conversations import (
    DataError,
    TurnRecord,
    clean_conversations,
    extract_turns,
    load_conversations,
    load_turn_records,
    read_items,
    split_conversations,
    split_of,
    write_jsonl,
)
from conversations.loaders import LoadReport, iter_conversations
from conversations.schema import Conversation

MSGS = [
    {"role": "user", "content": "hey can u fix my regex"},
    {"role": "assistant", "content": "Sure, share it."},
    {"role": "user", "content": "^a+b$ doesnt match aab"},
]


def _w(tmp_path, name, text, binary=False):
    p = tmp_path / name
    p.write_bytes(text if binary else text.encode())
    return p


# ---------------------------------------------------------------------------------------------------- loaders


def test_messages_jsonl(tmp_path):
    p = _w(tmp_path, "a.jsonl", "\n".join(json.dumps({"id": f"c{i}", "messages": MSGS}) for i in range(3)))
    convs, rep = load_conversations(p)
    assert [c.id for c in convs] == ["c0", "c1", "c2"]
    assert convs[0].messages == MSGS
    assert rep.records == 3 and rep.loaded == 3 and rep.n_invalid == 0


def test_messages_json_array_without_ids_gets_stable_ids(tmp_path):
    p = _w(tmp_path, "a.json", json.dumps([{"messages": MSGS}, {"messages": MSGS[:1]}], indent=1))
    a, _ = load_conversations(p)
    b, _ = load_conversations(p)
    assert [c.id for c in a] == [c.id for c in b] and a[0].id != a[1].id


def test_sharegpt_format_maps_speakers_and_groups_parts(tmp_path):
    rec = {"id": "abc_1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    p = _w(tmp_path, "s.json", json.dumps([rec]))
    (c,), _ = load_conversations(p)
    assert c.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert c.group == "abc" and c.split_key == "abc"


def test_wildchat_format(tmp_path):
    rec = {"conversation_hash": "h1", "conversation": [{"role": "user", "content": "yo", "turn": 1},
                                                       {"role": "assistant", "content": "hi"}]}
    p = _w(tmp_path, "w.jsonl", json.dumps(rec))
    (c,), _ = load_conversations(p, "wildchat")
    assert c.id == "h1" and c.messages[0] == {"role": "user", "content": "yo"}


def test_datasets_folder(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"id": "d0", "messages": MSGS}, {"id": "d1", "messages": MSGS}])
    ds.save_to_disk(str(tmp_path / "ds"))
    convs, _ = load_conversations(tmp_path / "ds")
    assert [c.id for c in convs] == ["d0", "d1"]


def test_turn_records_roundtrip(tmp_path):
    recs = [TurnRecord(id="t1", context=MSGS[:2], user_turn="ok thx", conversation_id="c", is_last=True)]
    write_jsonl(tmp_path / "t.jsonl", recs)
    back, _ = load_turn_records(tmp_path / "t.jsonl")
    assert back[0].to_dict() == recs[0].to_dict()
    assert read_items(tmp_path / "t.jsonl")[0].user_turn == "ok thx"


@pytest.mark.parametrize(
    "name,content,binary,reason,where",
    [
        ("trunc.json", '[{"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"ro', False, "truncated JSON", "trunc.json:1"),
        ("trunc.jsonl", '{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [', False, "invalid JSON", "trunc.jsonl:2"),
        ("roles.jsonl", '{"messages": [{"role": "human", "content": "hi"}]}', False, "unknown role 'human'", "roles.jsonl:1"),
        ("norole.jsonl", '{"messages": [{"content": "hi"}]}', False, "has no 'role'", "norole.jsonl:1"),
        ("empty_content.jsonl", '{"messages": [{"role": "user", "content": "  "}]}', False, "empty content", "empty_content.jsonl:1"),
        ("nonstr.jsonl", '{"messages": [{"role": "user", "content": 5}]}', False, "must be a string", "nonstr.jsonl:1"),
        ("nouser.jsonl", '{"messages": [{"role": "assistant", "content": "hi"}]}', False, "no user turn", "nouser.jsonl:1"),
        ("utf8.jsonl", b'{"messages": [{"role": "user", "content": "ok"}]}\n{"messages": [{"role": "user", "content": "\xff\xfe"}]}', True, "invalid UTF-8", "utf8.jsonl:2"),
        ("empty.jsonl", "", False, "file is empty", "empty.jsonl"),
        ("notobj.jsonl", "[1, 2]", False, "must be a JSON object", "notobj.jsonl:1"),
        ("unknownfmt.jsonl", '{"text": "hi"}', False, "cannot tell the format", "unknownfmt.jsonl:1"),
        ("huge.jsonl", lambda: '{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [{"role": "user", "content": "' + "x" * 50_000_000 + '"}]}', False,
         "line is 50 MB, over the 10 MB limit", "huge.jsonl:2"),
    ],
    ids=lambda v: v if isinstance(v, str) and v.endswith((".json", ".jsonl")) else "",
)
def test_malformed_input_names_location_and_reason(tmp_path, name, content, binary, reason, where):
    p = _w(tmp_path, name, content() if callable(content) else content, binary)  # callable: built only when run
    with pytest.raises(DataError) as e:
        load_conversations(p)
    assert reason in str(e.value)
    assert where in str(e.value)


def test_skip_invalid_counts_and_reports(tmp_path):
    lines = [
        json.dumps({"id": "good", "messages": MSGS}),
        '{"messages": [',
        json.dumps({"messages": [{"role": "user", "content": ""}]}),
        json.dumps({"id": "good2", "messages": MSGS}),
    ]
    p = _w(tmp_path, "m.jsonl", "\n".join(lines))
    rep = LoadReport(str(p))
    convs = list(iter_conversations(p, skip_invalid=True, report=rep))
    assert [c.id for c in convs] == ["good", "good2"]
    assert rep.records == 4 and rep.n_invalid == 2
    assert [w for w, _ in rep.invalid] == ["m.jsonl:2", "m.jsonl:3"]


# ---------------------------------------------------------------------------------------------------- cleaning


def test_cleaning_counts_every_rule():
    convs = [
        Conversation("ok", MSGS),
        Conversation("dup", [dict(m) for m in MSGS]),
        Conversation("alt", [MSGS[0], MSGS[0]]),
        Conversation("long", [{"role": "user", "content": "x" * 50}]),
        Conversation("empty", []),
        Conversation("cont", MSGS[1:]),  # continuation part opening with the assistant: kept
    ]
    kept, rep = clean_conversations(convs, max_chars=40)
    assert [c.id for c in kept] == ["ok", "cont"]
    assert rep.as_dict() == {"kept": 2, "dropped": {"empty": 1, "non_alternating": 1, "too_long": 1, "duplicate": 1}}


# ---------------------------------------------------------------------------------------------------- splits, turns


def test_split_is_deterministic_and_leak_free():
    convs = [Conversation(f"c{i}_{j}", MSGS, group=f"c{i}") for i in range(400) for j in range(2)]
    a = split_conversations(convs)
    b = split_conversations(list(reversed(convs)))
    assert {s: sorted(c.id for c in v) for s, v in a.items()} == {s: sorted(c.id for c in v) for s, v in b.items()}
    groups = {s: {c.split_key for c in v} for s, v in a.items()}
    assert not (groups["train"] & groups["test"]) and not (groups["train"] & groups["val"]) and not (groups["val"] & groups["test"])
    assert 0 < len(a["test"]) < len(a["train"])
    assert split_of("c1") == split_of("c1")
    with pytest.raises(ValueError):
        split_of("x", val_frac=0.6, test_frac=0.5)


def test_extract_turns_contexts_and_last_flag():
    conv = Conversation("c", [{"role": "system", "content": "sys"}] + MSGS)
    turns = extract_turns([conv])
    assert [t.id for t in turns] == ["c#1", "c#3"]
    assert turns[0].context == [{"role": "system", "content": "sys"}]
    assert turns[1].context[-1] == MSGS[1] and turns[1].is_last and not turns[0].is_last
    (t,) = extract_turns([conv], max_context_messages=1)[1:]
    assert t.context == [{"role": "system", "content": "sys"}, MSGS[1]]
    assert turns[0].context_key != turns[1].context_key


# ---------------------------------------------------------------------------------------------------- CLI


def _run(*args):
    return subprocess.run([sys.executable, "-m", "conversations", *args], capture_output=True, text=True, timeout=120)


def test_cli_check_and_export(tmp_path):
    p = _w(tmp_path, "a.jsonl", "\n".join(json.dumps({"id": f"c{i}", "messages": MSGS}) for i in range(5)))
    r = _run("check", str(p), "--no-clean")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["conversations"] == 5 and out["user_turns"] == 10 and out["invalid"] == 0
    r = _run("export-turns", str(p), "--no-clean", "--out", str(tmp_path / "t.jsonl"))
    assert r.returncode == 0, r.stderr
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 10


def test_cli_bad_input_exits_nonzero_without_traceback(tmp_path):
    p = _w(tmp_path, "bad.jsonl", json.dumps({"messages": MSGS}) + '\n{"messages": [{"role": "robot", "content": "x"}]}')
    r = _run("check", str(p))
    assert r.returncode == 2
    assert "bad.jsonl:2" in r.stderr and "unknown role 'robot'" in r.stderr and "Traceback" not in r.stderr
    r = _run("check", str(p), "--skip-invalid")
    assert r.returncode == 0 and json.loads(r.stdout)["invalid"] == 1 and "bad.jsonl:2" in r.stderr


@pytest.mark.slow
def test_embedded_sharegpt_corpus():
    from conversations.embedded import load_corpus

    convs, info = load_corpus("sharegpt")
    n_turns = sum(len(c.user_turn_indices()) for c in convs)
    assert info.records > 17000 and info.invalid > 0  # the packaged corpus has invalid records, counted not hidden
    assert 14000 < len(convs) < 17700 and n_turns > 50000
    assert len(info.fingerprint) == 64
    splits = split_conversations(convs)
    assert not ({c.split_key for c in splits["train"]} & {c.split_key for c in splits["test"]})


def test_jsonl_with_unicode_line_separators_in_strings_round_trips(tmp_path):
    """write_jsonl keeps non-ASCII as is; U+2028, U+0085 and U+001C inside a string are not line breaks of the file."""
    from conversations import Conversation, load_conversations, write_jsonl

    text = "first\u2028second\x85third\x1cfourth"
    write_jsonl(tmp_path / "c.jsonl", [Conversation(id="a", messages=[{"role": "user", "content": text},
                                                                      {"role": "assistant", "content": "ok"}])])
    convs, _ = load_conversations(str(tmp_path / "c.jsonl"))
    assert len(convs) == 1 and convs[0].messages[0]["content"] == text

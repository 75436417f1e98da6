"""Prompt format, end marker and end-of-conversation labels: pure logic, exact values."""

import pytest

from conversations import Conversation, TurnRecord
from generator.data import conversation_ends, sample_records, turns_with_ends
from generator.prompts import (
    DEFAULT_SYSTEM_PROMPT,
    END_MARKER,
    OPENING_MESSAGE,
    PROMPT_FORMAT_VERSION,
    fit_messages,
    render_prompt,
    simulator_messages,
    strip_end_marker,
    system_prompt_for,
    target_text,
)

U, A, S = "user", "assistant", "system"


def m(role, content):
    return {"role": role, "content": content}


def test_role_flip_exact():
    ctx = [m(U, "hi"), m(A, "Hello! How can I help?"), m(U, "tell me a joke"), m(A, "Why did the chicken...")]
    assert simulator_messages(ctx) == [
        m(S, DEFAULT_SYSTEM_PROMPT),
        m(U, OPENING_MESSAGE),
        m(A, "hi"),
        m(U, "Hello! How can I help?"),
        m(A, "tell me a joke"),
        m(U, "Why did the chicken..."),
    ]


def test_first_turn_gets_opening_message():
    assert simulator_messages([]) == [m(S, DEFAULT_SYSTEM_PROMPT), m(U, OPENING_MESSAGE)]


def test_context_opening_with_assistant_needs_no_opening_message():
    # ShareGPT continuation parts open with the assistant
    assert simulator_messages([m(A, "...continued answer")]) == [m(S, DEFAULT_SYSTEM_PROMPT), m(U, "...continued answer")]


def test_original_system_prompt_is_folded_persona_and_goal():
    ctx = [m(S, "You are a pirate."), m(U, "hi"), m(A, "Arr!")]
    msgs = simulator_messages(ctx, persona="a retired teacher", goal="get a refund for order 42")
    assert [x["role"] for x in msgs] == [S, U, A, U]
    assert msgs[0]["content"] == (
        DEFAULT_SYSTEM_PROMPT
        + "\n\nYour persona: a retired teacher"
        + "\n\nYour goal in this conversation (the assistant does not know it): get a refund for order 42"
        + "\n\nThe assistant was given these instructions: You are a pirate."
    )
    assert all("pirate" not in x["content"] for x in msgs[1:])
    assert system_prompt_for() == DEFAULT_SYSTEM_PROMPT
    assert END_MARKER in DEFAULT_SYSTEM_PROMPT and PROMPT_FORMAT_VERSION == "2"


def test_consecutive_same_role_messages_are_joined():
    msgs = simulator_messages([m(U, "a"), m(U, "b"), m(A, "c")])
    assert msgs[1:] == [m(U, OPENING_MESSAGE), m(A, "a\n\nb"), m(U, "c")]


def test_target_text_and_strip_roundtrip():
    last = TurnRecord(id="c#3", context=[], user_turn="thanks, bye! ", is_last=True)
    mid = TurnRecord(id="c#1", context=[], user_turn="and then?")
    assert target_text(last) == "thanks, bye!\n" + END_MARKER
    assert target_text(mid) == "and then?"
    assert target_text({"user_turn": "x", "is_last": True}) == "x\n" + END_MARKER
    assert strip_end_marker(target_text(last)) == ("thanks, bye!", True)
    assert strip_end_marker(target_text(mid)) == ("and then?", False)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("ok" + END_MARKER, ("ok", True)),
        ("ok \n" + END_MARKER + "junk after", ("ok", True)),
        (END_MARKER, ("", True)),
        ("ok <|endconv", ("ok", True)),  # cut off by the token limit
        ("ok <|e", ("ok", True)),
        ("ok <|", ("ok <|", False)),  # too short to tell
        ("a < b", ("a < b", False)),
        ("  spaced  ", ("  spaced  ", False)),
    ],
)
def test_strip_end_marker(text, expected):
    assert strip_end_marker(text) == expected


def test_render_prompt_chatml(tiny_lm_path):
    from generator.model import load_tokenizer

    tok = load_tokenizer(tiny_lm_path)
    text = render_prompt(tok, [m(U, "hi"), m(A, "Hello!")])
    assert text == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{OPENING_MESSAGE}<|im_end|>\n"
        "<|im_start|>assistant\nhi<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_render_prompt_truncates_from_the_left_keeping_the_system_prompt(tiny_lm_path):
    from generator.model import load_tokenizer

    tok = load_tokenizer(tiny_lm_path)
    ctx = [m(S, "Be brief.")]
    for i in range(6):
        ctx += [m(U, f"question {i} " + "word " * 30), m(A, f"answer {i} " + "word " * 30)]
    n = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    full = render_prompt(tok, ctx)
    budget = n(full) - 70  # two messages too many
    msgs = fit_messages(tok, ctx, max_context_tokens=budget)
    text = render_prompt(tok, ctx, max_context_tokens=budget)
    assert n(text) <= budget
    assert msgs[0]["content"].endswith("The assistant was given these instructions: Be brief.")
    assert "question 0" not in text and "answer 5" in text
    assert msgs[-1] == m(U, ctx[-1]["content"])  # the newest message is kept whole
    assert render_prompt(tok, ctx, max_context_tokens=10**6) == full


def test_render_prompt_cuts_an_overlong_last_message_in_the_middle(tiny_lm_path):
    from generator.model import load_tokenizer

    tok = load_tokenizer(tiny_lm_path)
    long = "START " + "filler " * 2000 + "THE END"
    text = render_prompt(tok, [m(U, "hi"), m(A, long)], max_context_tokens=300)
    assert len(tok(text, add_special_tokens=False)["input_ids"]) <= 300
    assert "START" in text and "THE END" in text and "[...]" in text


def _conv(cid, n_user, group=None, open_with_assistant=False):
    msgs = [m(A, "cont")] if open_with_assistant else []
    for k in range(n_user):
        msgs += [m(U, f"{cid} u{k}"), m(A, f"{cid} a{k}")]
    return Conversation(id=cid, messages=msgs, group=group)


def test_end_labels_across_sharegpt_parts():
    convs = [
        _conv("abc_0", 2, "abc"),
        _conv("abc_1", 1, "abc", open_with_assistant=True),
        _conv("abc_2", 2, "abc", open_with_assistant=True),
        _conv("solo", 2),
        _conv("one_0", 1, "one"),
    ]
    assert conversation_ends(convs) == {"abc_2", "solo", "one_0"}
    recs = turns_with_ends(convs)
    assert [(r.id, r.is_last) for r in recs] == [
        ("abc_0#0", False), ("abc_0#2", False),  # the conversation goes on in abc_1
        ("abc_1#1", False),
        ("abc_2#1", False), ("abc_2#3", True),
        ("solo#0", False), ("solo#2", True),
        ("one_0#0", True),
    ]


def test_sample_records_is_seeded_and_keeps_order():
    recs = [TurnRecord(id=str(i), context=[], user_turn="x") for i in range(20)]
    a, b = sample_records(recs, 5, seed=3), sample_records(recs, 5, seed=3)
    assert [r.id for r in a] == [r.id for r in b]
    assert [int(r.id) for r in a] == sorted(int(r.id) for r in a)
    assert len(sample_records(recs, None)) == 20 and len(sample_records(recs, 50)) == 20

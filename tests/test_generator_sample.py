"""Model loading, batched sampling and conversation simulation with the tiny random model (seconds each)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

from conversations import TurnRecord
from conversations.schema import DataError
from generator.model import LoraSettings, count_trainable, load_generator, pick_dtype
from generator.prompts import END_MARKER
from generator.sample import (
    LocalAssistant,
    OpenAIAssistant,
    clean_turn,
    generate_user_turns,
    simulate_conversation,
    simulate_conversations,
    simulate_records,
    stop_token_ids,
)

CTX = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}]


@pytest.fixture(scope="module")
def tiny(tiny_lm_path):
    return load_generator(tiny_lm_path)


def test_load_generator_tokenizer_and_dtype(tiny):
    model, tok = tiny
    assert tok.padding_side == "left" and tok.pad_token is not None
    assert next(model.parameters()).dtype == torch.float32  # CPU: fp32
    assert pick_dtype("auto", "cuda") in (torch.bfloat16, torch.float16)
    assert pick_dtype("bf16") == torch.bfloat16


def test_load_generator_with_lora_trains_only_the_adapter(tiny_lm_path):
    model, _ = load_generator("tiny-random", lora=LoraSettings(r=4, alpha=8), gradient_checkpointing=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    trainable, total = count_trainable(model)
    assert 0 < trainable < total


def test_stop_tokens_cover_end_of_turn(tiny):
    _, tok = tiny
    stops = stop_token_ids(tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") in stops and tok.convert_tokens_to_ids("<|im_start|>") in stops


def test_clean_turn():
    assert clean_turn("  hi  ") == "hi"
    assert clean_turn("bye" + END_MARKER + " more text") == "bye" + END_MARKER


def test_generation_is_seeded_and_one_turn_per_context(tiny):
    model, tok = tiny
    contexts = [CTX, [], CTX[:1] + [{"role": "assistant", "content": "ok"}], CTX, []]
    kw = dict(max_new_tokens=6, batch_size=2, seed=7)
    rng_before = torch.random.get_rng_state()
    a = generate_user_turns(model, tok, contexts, **kw)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the caller's RNG is left alone
    b = generate_user_turns(model, tok, contexts, **kw)
    c = generate_user_turns(model, tok, contexts, **{**kw, "seed": 8})
    assert len(a) == len(contexts) and all(isinstance(t, str) and t for t in a)
    assert a == b and a != c
    assert model.training is False


def test_generation_with_goals_and_personas(tiny):
    model, tok = tiny
    out = generate_user_turns(
        model, tok, [CTX, CTX], goals=["book a flight", None], personas="a student", max_new_tokens=4, temperature=0
    )
    assert len(out) == 2
    with pytest.raises(ValueError, match="goals has 1 entries for 2 contexts"):
        generate_user_turns(model, tok, [CTX, CTX], goals=["x"], max_new_tokens=2)


def test_simulate_records_keeps_ids_and_contexts(tiny):
    model, tok = tiny
    real = [
        TurnRecord(id="c#1", context=CTX, user_turn="real text", conversation_id="c", is_last=True),
        TurnRecord(id="d#0", context=[], user_turn="other", conversation_id="d", meta={"goal": "buy shoes"}),
    ]
    sim = simulate_records(model, tok, real, max_new_tokens=5, batch_size=4)
    assert [s.id for s in sim] == ["c#1", "d#0"]
    assert [s.context for s in sim] == [r.context for r in real]
    assert [s.conversation_id for s in sim] == ["c", "d"]
    for s in sim:
        assert set(s.meta) == {"ended", "truncated"} and END_MARKER not in s.user_turn
        assert s.is_last is False and s.user_turn != "real text"


class _ScriptedSimulator:
    """Stands in for the simulator model: a fixed script of user turns (the tiny random model never ends)."""


def test_simulate_conversations_stop_at_marker(tiny, monkeypatch):
    model, tok = tiny
    import generator.sample as sample

    script = iter([["first", "hello"], ["bye" + END_MARKER, "more"], ["again"]])
    monkeypatch.setattr(sample, "_generate_turns_detailed", lambda *a, **k: [(t, False) for t in next(script)])

    class Echo:
        def respond(self, convs):
            return [f"echo: {c[-1]['content']}" for c in convs]

    convs = simulate_conversations(model, tok, Echo(), n=2, max_turns=3, goals=["g1", "g2"])
    a, b = convs
    assert a.ended and a.user_turns == 2 and a.meta["stop"] == "marker"
    assert [m["role"] for m in a.messages] == ["user", "assistant"] * 2
    assert a.messages[-2]["content"] == "bye" and a.messages[-1]["content"] == "echo: bye"
    assert not b.ended and b.user_turns == 3 and b.meta["stop"] == "max_turns" and b.goal == "g2"
    assert a.to_conversation().messages == a.messages and json.dumps(a.to_dict())


def test_simulate_conversation_against_local_assistant(tiny):
    model, tok = tiny
    assistant = LocalAssistant(model, tok, max_new_tokens=4)
    conv = simulate_conversation(model, tok, assistant, goal="plan a trip", max_turns=2, max_new_tokens=4)
    assert conv.user_turns == 2 and not conv.ended
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    assert all(isinstance(m["content"], str) for m in conv.messages)


class _ChatHandler(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _ChatHandler.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        if body["model"] == "broken":
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "bad model"}')
            return
        reply = {"choices": [{"message": {"role": "assistant", "content": f"re: {body['messages'][-1]['content']}"}}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture()
def chat_server():
    server = HTTPServer(("127.0.0.1", 0), _ChatHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _ChatHandler.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_openai_assistant_sends_key_from_env_and_never_shows_it(chat_server, monkeypatch):
    monkeypatch.setenv("TEST_SIM_KEY", "sk-secret-123")
    a = OpenAIAssistant(chat_server, "m1", api_key_env="TEST_SIM_KEY", system_prompt="Be nice.")
    out = a.respond([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]])
    assert out == ["re: hi", "re: yo"]
    seen = sorted(_ChatHandler.seen, key=lambda s: s["body"]["messages"][-1]["content"])
    assert seen[0]["path"] == "/v1/chat/completions" and seen[0]["auth"] == "Bearer sk-secret-123"
    assert seen[0]["body"]["messages"][0] == {"role": "system", "content": "Be nice."}
    assert "sk-secret" not in repr(a) and "sk-secret" not in json.dumps(vars(a), default=str)
    with pytest.raises(DataError, match="HTTP 400") as e:
        OpenAIAssistant(chat_server, "broken", api_key_env="TEST_SIM_KEY", retries=0).respond([[{"role": "user", "content": "x"}]])
    assert "sk-secret" not in str(e.value)


def test_openai_assistant_in_a_simulation(chat_server, tiny, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    model, tok = tiny
    conv = simulate_conversation(model, tok, OpenAIAssistant(chat_server, "m"), max_turns=2, max_new_tokens=3)
    assert conv.messages[1]["content"] == "re: " + conv.messages[0]["content"]
    assert _ChatHandler.seen[0]["auth"] is None  # no key set: unauthenticated, still works


def test_shared_prefix_cache_layout_and_same_tokens(tiny):
    """Prompts that share the system prompt: the batch is laid out prefix + pads + rest with one cache for the
    prefix, and greedy decoding gives the same tokens as plain left padding."""
    from generator.prompts import render_prompt
    from generator.sample import generate_texts, prefix_cache_batch

    model, tok = tiny
    contexts = [CTX, [{"role": "user", "content": "book me a table for four tonight somewhere quiet please"}],
                [{"role": "user", "content": "x"}]]
    prompts = [render_prompt(tok, c) for c in contexts]
    rows = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    ids, mask, kw = prefix_cache_batch(model, rows, tok.pad_token_id, "cpu")
    (cache,) = kw.values()
    p = cache.get_seq_length()
    assert p >= 16 and all(r[:p] == rows[0][:p] for r in rows)
    for row, i, m in zip(rows, ids.tolist(), mask.tolist()):
        assert [t for t, keep in zip(i, m) if keep] == row  # masking the pads gives back the row
        assert m[:p] == [1] * p and sum(m) == len(row)
    assert prefix_cache_batch(model, rows[:1], tok.pad_token_id, "cpu") is None  # one row: nothing to share
    # the same next-token logits at every decoding step as plain left padding, and they differ between rows
    greedy = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True,
                  pad_token_id=tok.pad_token_id)
    with torch.inference_mode():
        shared = model.generate(input_ids=ids, attention_mask=mask, **kw, **greedy).logits
        plain_batch = tok.pad({"input_ids": rows}, padding=True, padding_side="left", return_tensors="pt")
        plain = model.generate(**plain_batch, **greedy).logits
    for a, b in zip(shared, plain):  # (B, vocab) per step
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert (plain[0][0] - plain[0][1]).abs().max() > 1e-3
    texts = dict(max_new_tokens=4, temperature=0, batch_size=3)
    assert generate_texts(model, tok, prompts, share_prefix=True, **texts) == \
        generate_texts(model, tok, prompts, share_prefix=False, **texts)


@pytest.mark.parametrize("temperature,top_p,top_k,candidates", [
    (1.0, 0.9, 0, 64),   # nucleus inside the candidates
    (1.3, 0.95, 0, 3),   # nucleus wider than the candidates: the full-sort rows
    (0.7, 1.0, 0, 5),    # no top-p: every token can be drawn
    (1.0, 0.8, 4, 64),   # top-k, then top-p within it
])
def test_nucleus_sampler_draws_from_transformers_sampling_distribution(temperature, top_p, top_k, candidates):
    """Never a token transformers' warpers remove, every token they keep that is likely enough to show up in 40k
    draws, and the same frequencies within sampling error."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from generator.sample import NucleusSampler

    g = torch.Generator().manual_seed(0)
    vocab, n = 16, 40_000
    logits = torch.randn(1, vocab, generator=g) * 2
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    want = ref.softmax(-1)[0]
    torch.manual_seed(1)
    out = NucleusSampler(temperature, top_p, top_k, candidates=candidates)(None, logits.expand(n, vocab).clone())
    assert ((out == 0).sum(-1) == 1).all() and torch.isinf(out).sum() == n * (vocab - 1)  # one token per row
    freq = torch.bincount(out.argmax(-1), minlength=vocab).float() / n
    assert not ((freq > 0) & (want == 0)).any()
    assert (freq[want > 1e-3] > 0).all()
    assert (freq - want).abs().max() < 0.01  # 40k draws: the standard error is <= 0.0025


def test_nucleus_sampler_is_seeded_by_the_torch_rng():
    from generator.sample import NucleusSampler

    scores = torch.randn(8, 100)
    torch.manual_seed(3)
    a = NucleusSampler(1.0, 0.95)(None, scores.clone())
    torch.manual_seed(3)
    b = NucleusSampler(1.0, 0.95)(None, scores.clone())
    assert torch.equal(a, b)

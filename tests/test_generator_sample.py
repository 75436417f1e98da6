"""Model loading, the generation engine, batched turn sampling and conversation simulation with the tiny random
model (seconds each)."""

import json

import pytest
import torch

from conversations import TurnRecord
from conversations.schema import DataError
from generator.assistants import LocalAssistant, OpenAIAssistant, ReplayAssistant
from generator.dialogue import simulate_conversations
from generator.engine import Engine, NucleusSampler, SamplingSettings, stop_token_ids
from generator.model import LoraSettings, count_trainable, load_generator, pick_dtype
from generator.prompts import END_MARKER
from generator.sample import clean_turn, simulate_records, user_turns

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


def _engine(tiny, **kw):
    model, tok = tiny
    return Engine(model, tok, **{"batch_size": 2, **kw})


def test_generation_is_seeded_and_one_turn_per_context(tiny):
    model, _ = tiny
    contexts = [CTX, [], CTX[:1] + [{"role": "assistant", "content": "ok"}], CTX, []]
    s = SamplingSettings(max_new_tokens=6)
    rng_before = torch.random.get_rng_state()
    a = [t.text for t in user_turns(_engine(tiny), contexts, s, seed=7)]
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the caller's RNG is left alone
    b = [t.text for t in user_turns(_engine(tiny), contexts, s, seed=7)]
    c = [t.text for t in user_turns(_engine(tiny), contexts, s, seed=8)]
    assert len(a) == len(contexts) and all(isinstance(t, str) and t for t in a)
    assert a == b and a != c
    assert model.training is False


def test_generation_with_goals_and_personas(tiny):
    s = SamplingSettings(max_new_tokens=4, temperature=0)
    out = user_turns(_engine(tiny), [CTX, CTX], s, goals=["book a flight", None], personas="a student")
    assert len(out) == 2
    with pytest.raises(ValueError, match="goals has 1 entries for 2 contexts"):
        user_turns(_engine(tiny), [CTX, CTX], s, goals=["x"])


def test_simulate_records_keeps_ids_and_contexts(tiny):
    real = [
        TurnRecord(id="c#1", context=CTX, user_turn="real text", conversation_id="c", is_last=True),
        TurnRecord(id="d#0", context=[], user_turn="other", conversation_id="d", meta={"goal": "buy shoes"}),
    ]
    sim = simulate_records(_engine(tiny, batch_size=4), real, SamplingSettings(max_new_tokens=5))
    assert [s.id for s in sim] == ["c#1", "d#0"]
    assert [s.context for s in sim] == [r.context for r in real]
    assert [s.conversation_id for s in sim] == ["c", "d"]
    for s in sim:
        assert set(s.meta) == {"ended", "truncated"} and END_MARKER not in s.user_turn
        assert s.is_last is False and s.user_turn != "real text"
        assert s.meta["truncated"]  # the tiny random model never stops within 5 tokens


def test_sampling_settings_are_validated_and_round_trip():
    s = SamplingSettings(max_new_tokens=80, temperature=0.9, top_p=0.9, max_prompt_tokens=200)
    assert SamplingSettings.from_dict({**s.to_dict(), "unknown": 1}) == s
    assert s.replace(temperature=None, top_p=0.5) == SamplingSettings(max_new_tokens=80, temperature=0.9, top_p=0.5,
                                                                      max_prompt_tokens=200)
    for bad in ({"max_new_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2},
                {"max_prompt_tokens": 3}):
        with pytest.raises(DataError, match=next(iter(bad))):
            SamplingSettings(**bad)


class _ScriptedSimulator:
    """Stands in for the simulator model: a fixed script of user turns (the tiny random model never ends)."""


def test_simulate_conversations_stop_at_marker(tiny, monkeypatch):
    import generator.dialogue as dialogue
    from generator.sample import SimulatedTurn

    script = iter([["first", "hello"], ["bye", "more"], ["again"]])
    ends = iter([[False, False], [True, False], [False]])
    monkeypatch.setattr(dialogue, "user_turns", lambda *a, **k: [SimulatedTurn(t, e, False)
                                                                for t, e in zip(next(script), next(ends))])

    class Echo:
        def respond(self, convs, ids=None):
            return [f"echo: {c[-1]['content']}" for c in convs]

    convs = simulate_conversations(_engine(tiny), Echo(), SamplingSettings(), n=2, max_turns=3, goals=["g1", "g2"])
    a, b = convs
    assert a.ended and a.user_turns == 2 and a.meta["stop"] == "marker"
    assert [m["role"] for m in a.messages] == ["user", "assistant"] * 2
    assert a.messages[-2]["content"] == "bye" and a.messages[-1]["content"] == "echo: bye"
    assert not b.ended and b.user_turns == 3 and b.meta["stop"] == "max_turns" and b.goal == "g2"
    assert a.to_conversation().messages == a.messages and json.dumps(a.to_dict())


def test_simulate_conversation_against_local_assistant(tiny):
    assistant = LocalAssistant(_engine(tiny), settings=SamplingSettings(max_new_tokens=4))
    (conv,) = simulate_conversations(_engine(tiny), assistant, SamplingSettings(max_new_tokens=4), contexts=[[]],
                                     goals=["plan a trip"], max_turns=2)
    assert conv.user_turns == 2 and not conv.ended and conv.meta["stop"] == "max_turns"
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    assert all(isinstance(m["content"], str) for m in conv.messages)


def test_replay_assistant_gives_the_real_replies_then_stops_the_conversation(tiny):
    from conversations import Conversation

    real = Conversation(id="r1", messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A1"},
                                           {"role": "user", "content": "u2"}, {"role": "assistant", "content": "A2"}])
    replay = ReplayAssistant.from_conversations([real], start_user_turns=1)
    (conv,) = simulate_conversations(_engine(tiny), replay, SamplingSettings(max_new_tokens=3),
                                     contexts=[real.messages[:1]], ids=["r1"], max_turns=4)
    assert [m["content"] for m in conv.messages if m["role"] == "assistant"] == ["A1", "A2"]
    assert conv.user_turns == 2 and conv.meta["stop"] == "replay_exhausted"


@pytest.fixture()
def chat_server(scripted_endpoint):
    """Echoes the last message as 're: ...'; a request for the model 'broken' gets an HTTP 400."""

    def answer(body, headers):
        if body["model"] == "broken":
            return 400, {"error": "bad model"}
        return f"re: {body['messages'][-1]['content']}"

    return scripted_endpoint(answer)


def test_openai_assistant_sends_key_from_env_and_never_shows_it(chat_server, monkeypatch):
    monkeypatch.setenv("TEST_SIM_KEY", "sk-secret-123")
    a = OpenAIAssistant(chat_server.url, "m1", api_key_env="TEST_SIM_KEY", system_prompt="Be nice.")
    out = a.respond([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]])
    assert out == ["re: hi", "re: yo"]
    seen = sorted(chat_server.seen, key=lambda s: s["body"]["messages"][-1]["content"])
    assert seen[0]["path"] == "/v1/chat/completions" and seen[0]["auth"] == "Bearer sk-secret-123"
    assert seen[0]["body"]["messages"][0] == {"role": "system", "content": "Be nice."}
    assert "sk-secret" not in repr(a) and "sk-secret" not in json.dumps(vars(a.client), default=str)
    with pytest.raises(DataError, match="HTTP 400") as e:
        OpenAIAssistant(chat_server.url, "broken", api_key_env="TEST_SIM_KEY", retries=0).respond([[{"role": "user", "content": "x"}]])
    assert "sk-secret" not in str(e.value)


def test_openai_assistant_in_a_simulation(chat_server, tiny, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    (conv,) = simulate_conversations(_engine(tiny), OpenAIAssistant(chat_server.url, "m"), SamplingSettings(max_new_tokens=3),
                                     n=1, max_turns=2)
    assert conv.messages[1]["content"] == "re: " + conv.messages[0]["content"]
    assert chat_server.seen[0]["auth"] is None  # no key set: unauthenticated, still works


@pytest.fixture(scope="module")
def varied(varied_lm):
    return varied_lm


@pytest.mark.parametrize("options", [{}, {"share_prefix": False}, {"compact": False}, {"growing_cache": False},
                                     {"share_prefix": False, "compact": False, "growing_cache": False},
                                     {"prefill_tokens": 1}, {"prefill_tokens": 1, "share_prefix": False}])
def test_engine_greedy_tokens_equal_transformers_generate(varied, options):
    """Prompts that share the system prompt, of different lengths: the shared-prefix cache, the compaction of
    finished rows, the growing cache and the prefill in row chunks (`prefill_tokens: 1`: one row a forward) give
    exactly the tokens of transformers' greedy `generate` on each prompt alone."""
    from generator.prompts import render_prompt

    model, tok = varied
    contexts = [CTX, [{"role": "user", "content": "book me a table for four tonight somewhere quiet please"}],
                [{"role": "user", "content": "x"}]]
    rows = [tok(render_prompt(tok, c), add_special_tokens=False)["input_ids"] for c in contexts]
    with torch.inference_mode():
        free = [model.generate(torch.tensor([r]), max_new_tokens=6, do_sample=False,
                               pad_token_id=tok.pad_token_id)[0, len(r):].tolist() for r in rows]
    stop = free[1][2]  # row 1 ends after its third token, the others run on: compaction happens mid-batch
    assert stop not in free[0] and stop not in free[2]
    engine = Engine(model, tok, batch_size=3, stop_ids=[stop], **options)
    got = engine.complete(rows, SamplingSettings(max_new_tokens=6, temperature=0, min_new_tokens=0))
    assert [c.ids for c in got] == [free[0], free[1][:3], free[2]]
    assert got[1].stopped and got[1].stop_id == stop and not got[0].stopped
    assert got[1].text == tok.decode(free[1][:2], skip_special_tokens=True)


@pytest.mark.parametrize("options", [{}, {"share_prefix": False}, {"growing_cache": False}, {"prefill_tokens": 1}])
def test_engine_n_samples_repeat_one_prefill(varied, options):
    """n completions per prompt from one prefill: greedy, each of the n equals the n=1 completion (the repeated cache
    is the same cache); sampled, they are prompt-major, seeded and not all equal."""
    from generator.prompts import render_prompt

    model, tok = varied
    contexts = [CTX, [{"role": "user", "content": "book me a table for four tonight somewhere quiet please"}],
                [{"role": "user", "content": "x"}]]
    rows = [tok(render_prompt(tok, c), add_special_tokens=False)["input_ids"] for c in contexts]
    greedy = SamplingSettings(max_new_tokens=6, temperature=0, min_new_tokens=0)
    one = Engine(model, tok, batch_size=8, **options).complete(rows, greedy)
    three = Engine(model, tok, batch_size=8, **options).complete(rows, greedy, n=3)
    assert [c.ids for c in three] == [c.ids for c in one for _ in range(3)]
    hot = SamplingSettings(max_new_tokens=6, temperature=1.5, top_p=1.0, min_new_tokens=6)
    a = Engine(model, tok, batch_size=4, **options).complete(rows, hot, seed=3, n=4)  # 1 prompt a batch
    b = Engine(model, tok, batch_size=4, **options).complete(rows, hot, seed=3, n=4)
    assert len(a) == 12 and [c.ids for c in a] == [c.ids for c in b]
    assert all(len({tuple(c.ids) for c in a[i * 4:(i + 1) * 4]}) > 1 for i in range(3))
    with pytest.raises(ValueError, match="n must be >= 1"):
        Engine(model, tok).complete(rows, hot, n=0)


@pytest.mark.parametrize("options", [{}, {"prefill_tokens": 1}, {"share_prefix": False}])
def test_engine_resumes_a_prompt_from_the_cache_of_the_one_it_extends(varied, options):
    """Turn 2 of three episodes (turn 1's prompt + its sampled tokens + a new observation), prefilled from turn 1's
    `PromptCache`s: exactly the greedy tokens of transformers' `generate` on each whole prompt alone. One row has
    no state and one a state that is not its prefix: both are prefilled whole in the same batch."""
    from generator.engine.resume import PromptCache
    from generator.prompts import render_prompt

    model, tok = varied
    contexts = [CTX, [{"role": "user", "content": "book me a table for four tonight somewhere quiet please"}],
                [{"role": "user", "content": "x"}]]
    rows = [tok(render_prompt(tok, c), add_special_tokens=False)["input_ids"] for c in contexts]
    greedy = SamplingSettings(max_new_tokens=5, temperature=0, min_new_tokens=5)
    engine = Engine(model, tok, batch_size=3, **options)
    states = [None, None, None]
    first = engine.complete(rows, greedy, states=states)
    assert [s.ids for s in states] == [tuple(r) for r in rows]  # each prompt's cache, not the sampled tokens
    obs = [tok(t, add_special_tokens=False)["input_ids"] for t in (" ok then", " no, the other one please", " hm")]
    turn2 = [r + c.ids + o for r, c, o in zip(rows, first, obs)]
    states[1] = None  # an episode whose cache was dropped (over the budget)
    stale = (turn2[2][0] + 1, *states[2].ids[1:])  # the same length, another first token: not a prefix of row 2
    states[2] = PromptCache(stale, states[2].keys, states[2].values)
    with torch.inference_mode():
        free = [model.generate(torch.tensor([r]), max_new_tokens=5, do_sample=False,
                               pad_token_id=tok.pad_token_id)[0, len(r):].tolist() for r in turn2]
    got = engine.complete(turn2, greedy, states=states)
    assert [c.ids for c in got] == free
    assert [s.ids for s in states] == [tuple(r) for r in turn2]
    third = [r + c.ids + o for r, c, o in zip(turn2, got, obs)]  # a third turn from the second's caches
    with torch.inference_mode():
        free = [model.generate(torch.tensor([r]), max_new_tokens=5, do_sample=False,
                               pad_token_id=tok.pad_token_id)[0, len(r):].tolist() for r in third]
    assert [c.ids for c in engine.complete(third, greedy, states=states)] == free
    with pytest.raises(ValueError, match="states needs n = 1"):
        engine.complete(rows, greedy, n=2, states=[None] * 3)


def test_simulate_candidates_shape_and_meta(tiny):
    from generator.sample import simulate_candidates

    recs = [TurnRecord(id=f"r{i}", context=CTX, user_turn="real", conversation_id=f"c{i}") for i in range(3)]
    cands = simulate_candidates(_engine(tiny, batch_size=4), recs, SamplingSettings(max_new_tokens=4), 2, seed=1)
    assert [[c.id for c in cs] for cs in cands] == [["r0", "r0"], ["r1", "r1"], ["r2", "r2"]]
    assert [c.meta["candidate"] for cs in cands for c in cs] == [0, 1] * 3
    assert all(c.conversation_id == r.conversation_id and c.context == r.context for r, cs in zip(recs, cands) for c in cs)


def test_engine_min_new_tokens_and_cancel(tiny):
    model, tok = tiny
    rows = [tok("hello there", add_special_tokens=False)["input_ids"]] * 3
    with torch.inference_mode():
        greedy_first = model.generate(torch.tensor(rows[:1]), max_new_tokens=1, do_sample=False,
                                      pad_token_id=tok.pad_token_id)[0, -1].item()
    engine = Engine(model, tok, batch_size=3, stop_ids=[greedy_first])
    out = engine.complete(rows, SamplingSettings(max_new_tokens=4, temperature=0, min_new_tokens=2))
    assert all(c.ids[0] != greedy_first for c in out)  # the stop token is masked before min_new_tokens
    calls = {"n": 0}

    def gone():  # the client of request 1 leaves after its second token
        calls["n"] += 1
        return calls["n"] > 1

    out = engine.complete(rows, SamplingSettings(max_new_tokens=5, temperature=1.0, min_new_tokens=5),
                          cancelled=[None, gone, None])
    assert [len(c.ids) for c in out] == [5, 2, 5] and not out[1].stopped


@pytest.mark.parametrize("temperature,top_p,top_k,floors,vocab", [
    (1.0, 0.9, 0, (1e-4,), 16),     # nucleus inside the candidates (a vocabulary of one partial block)
    (1.0, 0.9, 0, (1e-4,), 256),    # the same through the vocabulary's blocks
    (1.3, 0.95, 0, (0.2,), 16),     # nucleus wider than the candidates: the full-sort rows
    (1.3, 0.95, 0, (0.3, 0.01), 256),  # two floors (blocks), then the full sort
    (20.0, 0.9, 0, (3e-5, 1e-5), 256),  # a high temperature: no token as likely as FLAT / V, the cut by value
    (0.7, 1.0, 0, (0.5,), 16),      # no top-p: every token can be drawn
    (1.0, 0.8, 4, (0.5,), 16),      # top-k, then top-p within it
])
def test_nucleus_sampler_draws_from_transformers_sampling_distribution(temperature, top_p, top_k, floors, vocab):
    """Never a token transformers' warpers remove, every token they keep that is likely enough to show up in 40k
    draws, and the same frequencies within sampling error."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    n = 40_000
    logits = torch.randn(1, vocab, generator=g) * (2 if vocab <= 16 else 4)
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    want = ref.softmax(-1)[0]
    torch.manual_seed(1)
    ids = NucleusSampler(temperature, top_p, top_k, floors=floors)(logits.expand(n, vocab).clone())
    assert ids.shape == (n,) and ids.min() >= 0 and ids.max() < vocab
    freq = torch.bincount(ids, minlength=vocab).float() / n
    assert not ((freq > 0) & (want == 0)).any()
    assert (freq[want > 1e-3] > 0).all()
    assert (freq - want).abs().max() < 0.01  # 40k draws: the standard error is <= 0.0025


def test_whole_vocabulary_draws_never_pick_a_masked_token():
    """No top-p, no top-k (the inverse-CDF draw): a -inf score (a stop token held back by `min_new_tokens`), the first
    entry included, is never drawn, and a row with one finite score always draws it."""
    scores = torch.randn(4000, 32, generator=torch.Generator().manual_seed(0))
    scores[:, 0] = scores[:, 7] = scores[:, 31] = float("-inf")
    scores[-1] = float("-inf")
    scores[-1, 12] = 0.0
    torch.manual_seed(2)
    ids = NucleusSampler(1.0, 1.0)(scores)
    assert not torch.isin(ids[:-1], torch.tensor([0, 7, 31])).any() and int(ids[-1]) == 12
    assert len(ids[:-1].unique()) == 29  # every finite token shows up in 4k draws of 29 Gaussian scores


def test_nucleus_sampler_rows_of_different_widths_in_one_batch():
    """Rows that fit the first floor, the second, and none, side by side: each row's draws follow its own nucleus
    (the candidates of all rows are ordered in one sort)."""
    from transformers import TopPLogitsWarper

    g = torch.Generator().manual_seed(2)
    vocab, n = 128, 6_000
    peaked = torch.randn(vocab, generator=g) * 6   # nucleus of a few tokens
    middle = torch.randn(vocab, generator=g) * 1.5
    flat = torch.randn(vocab, generator=g) * 0.1   # nucleus of most of the vocabulary
    rows = torch.stack([peaked, middle, flat])  # (3, V)
    sampler = NucleusSampler(1.0, 0.9, floors=(0.02, 0.005))
    torch.manual_seed(0)
    ids = sampler(rows.repeat(n, 1)).view(n, 3)  # (n, 3)
    for k in range(3):
        want = TopPLogitsWarper(0.9)(None, rows[k : k + 1].clone()).softmax(-1)[0]
        freq = torch.bincount(ids[:, k], minlength=vocab).float() / n
        assert not ((freq > 0) & (want == 0)).any(), k
        assert (freq - want).abs().max() < 0.03, k  # 6k draws: the standard error is <= 0.0065


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU (bench/gpu_check.py runs it on one)"))])
def test_nucleus_sampler_row_with_no_token_above_any_floor(device):
    """A flat row has no candidate at floors above 1/V: it goes to the full sort, and its draws cover the nucleus.
    On a GPU a batch of only such rows once indexed a CPU tensor with GPU indices (random weights on an H200)."""
    vocab, n = 64, 20_000
    torch.manual_seed(0)
    ids = NucleusSampler(1.0, 0.45, floors=(0.5, 0.1))(torch.zeros(n, vocab, device=device))
    assert ids.device.type == device
    freq = torch.bincount(ids.cpu(), minlength=vocab).float() / n
    assert (freq > 0).sum() == 29  # 29 / 64 is the first mass >= 0.45 (ties: which 29 is the sort's choice)
    assert (freq[freq > 0] - 1 / 29).abs().max() < 0.01


def test_flat_rows_cut_the_nucleus_where_transformers_does():
    """Rows with no token as likely as FLAT / V (random weights, a high temperature) are cut by value, from the
    bottom: from the smallest m scores (1,024 of 4,096 here), or from all of them for a row whose m smallest hold
    too little (half the vocabulary nearly impossible). The cut keeps exactly the tokens transformers' top-p keeps,
    and no draw falls outside them."""
    from transformers import TopPLogitsWarper

    g = torch.Generator().manual_seed(4)
    V = 4096
    flat = torch.randn(V, generator=g) * 0.3
    tail = flat.clone()
    tail[: V // 2] = -30.0
    rows = torch.stack([flat, tail])  # (2, V)
    sampler = NucleusSampler(1.0, 0.9)
    norm = rows.logsumexp(-1)
    assert ((rows.amax(-1) - norm).exp() * V < sampler.FLAT).all()  # both rows take the flat path
    torch.manual_seed(0)
    ids = sampler(rows.repeat(2000, 1)).view(2000, 2)
    for k, found_in_m in ((0, True), (1, False)):
        keep = TopPLogitsWarper(0.9)(None, rows[k : k + 1].clone())[0] > float("-inf")  # (V,)
        assert keep[ids[:, k]].all()
        n, cut = sampler._flat_cut(rows[k : k + 1], norm[k : k + 1], 1024)
        assert (int(n) > 0) == found_in_m
        n, cut = sampler._flat_cut(rows[k : k + 1], norm[k : k + 1], V)
        assert int(n) == int(keep.sum()) and float(cut) == float(rows[k][keep].min())


def test_nucleus_sampler_is_seeded_by_the_torch_rng():
    scores = torch.randn(8, 100)
    torch.manual_seed(3)
    a = NucleusSampler(1.0, 0.95)(scores.clone())
    torch.manual_seed(3)
    b = NucleusSampler(1.0, 0.95)(scores.clone())
    assert torch.equal(a, b)


def test_an_empty_turn_is_drawn_again_for_that_row_only(tiny_lm_path):
    from generator.sample import user_turns

    from generator.engine import Completion
    from generator.model import load_generator

    _, tok = load_generator(tiny_lm_path)

    class Scripted:  # an engine whose first draw leaves row 1 empty, the redraw fills it
        def __init__(self):
            self.tokenizer, self.calls = tok, []

        def complete_texts(self, prompts, settings, seed=0, n=1):
            self.calls.append((len(prompts), seed))
            texts = ["fix it", "", f"thanks {END_MARKER}"] if len(self.calls) == 1 else ["ok then"] * len(prompts)
            return [Completion(ids=[1], text=t, stopped=True, stop_id=1) for t in texts[:len(prompts)]]

    eng = Scripted()
    turns = user_turns(eng, [[{"role": "assistant", "content": "hi"}]] * 3, SamplingSettings(), seed=5)
    assert [t.text for t in turns] == ["fix it", "ok then", "thanks"] and turns[2].ended
    assert eng.calls == [(3, 5), (1, 5 + 104_729)]  # one more draw, of the empty row alone, with its own seed
    eng = Scripted()
    assert [t.text for t in user_turns(eng, [[{"role": "assistant", "content": "hi"}]] * 3, SamplingSettings(),
                                       redraw_empty=0)][1] == ""

"""The calibrated end decision (generator.ending): p_end read from the model against a brute-force reading, the
offset solved exactly, the real end rate inside the window, and the decision drawn apart from the text."""

import math

import numpy as np
import pytest
import torch

from conversations import Conversation
from generator.engine import Engine, SamplingSettings
from generator.ending import decide_ends, end_probabilities, solve_end_bias, window_end_rate
from generator.model import load_generator
from generator.prompts import END_MARKER, END_SEPARATOR, render_prompt
from generator.sample import user_turns

CTX = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}]


@pytest.fixture(scope="module")
def tiny(tiny_lm_path):
    return load_generator(tiny_lm_path, dtype="fp32")


def _brute_force(model, tok, prompt, text):
    head = tok(prompt, add_special_tokens=False)["input_ids"] + tok(text, add_special_tokens=False)["input_ids"]
    suffix = tok(END_SEPARATOR + END_MARKER, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([head + suffix])).logits[0].float(), -1)
    lp_end = sum(logp[len(head) - 1 + j, t].item() for j, t in enumerate(suffix))
    lp_eos = logp[len(head) - 1, tok.eos_token_id].item()
    return math.exp(lp_end) / (math.exp(lp_end) + math.exp(lp_eos))


def test_end_probabilities_match_a_forward_per_row_whatever_the_padding(tiny):
    model, tok = tiny
    prompts = [render_prompt(tok, CTX), render_prompt(tok, []), render_prompt(tok, CTX[:1])]
    texts = ["ok thanks", "what about the second part of the plan, the one with the long name", "no"]
    p = end_probabilities(Engine(model, tok), prompts, texts, batch_size=3)  # one left-padded batch of three lengths
    assert p.shape == (3,) and np.all((p > 0) & (p < 1))
    for i in range(3):
        assert p[i] == pytest.approx(_brute_force(model, tok, prompts[i], texts[i]), rel=1e-4)


def test_the_offset_is_solved_exactly_and_the_draws_follow_it():
    assert solve_end_bias(np.full(10, 0.5), 0.5) == pytest.approx(0.0, abs=1e-3)
    assert solve_end_bias(np.full(10, 0.5), 0.25) == pytest.approx(math.log(1 / 3), abs=1e-3)
    # p_end 0.1 brought to 0.5: the offset is logit(0.5) - logit(0.1) = log 9
    assert solve_end_bias(np.full(4, 0.1), 0.5) == pytest.approx(math.log(9), abs=1e-3)
    with pytest.raises(ValueError, match="target_rate"):
        solve_end_bias(np.full(4, 0.1), 0.0)
    p = np.full(4000, 0.2)
    assert decide_ends(p, 0.0, seed=3).tolist() == decide_ends(p, 0.0, seed=3).tolist()
    assert decide_ends(p, 0.0, seed=3).mean() == pytest.approx(0.2, abs=0.03)
    assert decide_ends(p, math.log(4), seed=3).mean() == pytest.approx(0.5, abs=0.03)  # logit(0.2) + log 4 = 0
    assert decide_ends(p, 20.0, seed=3).all() and not decide_ends(p, -20.0, seed=3).any()


def test_the_real_end_rate_counts_ends_and_turns_inside_the_window():
    def conv(i, users):
        msgs = []
        for k in range(users):
            msgs += [{"role": "user", "content": f"u{k}"}, {"role": "assistant", "content": f"a{k}"}]
        return Conversation(id=str(i), messages=msgs)

    # 1, 2 and 5 user turns after the opening, window 2: turns 1 + 2 + 2, ends 1 + 1 + 0; the one-turn conversation
    # has nothing after its opening and is left out
    convs = [conv(0, 2), conv(1, 3), conv(2, 6), conv(3, 1)]
    assert window_end_rate(convs, seed_user_turns=1, max_turns=2) == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="after the opening"):
        window_end_rate([conv(3, 1)], seed_user_turns=1, max_turns=2)


def test_the_decision_is_drawn_apart_from_the_text(tiny, monkeypatch):
    import generator.ending as ending
    from generator.sample import END_DECISION_SEED

    model, tok = tiny
    engine = Engine(model, tok, batch_size=8)
    contexts = [CTX, CTX[:1] + [{"role": "assistant", "content": "sure"}], CTX] * 4
    s = SamplingSettings(max_new_tokens=8)
    plain = user_turns(engine, contexts, s, seed=5)
    read = []  # what the decision was drawn from: this model's p_end on exactly the sampled texts
    real_p = ending.end_probabilities

    def spy(engine_, prompts, texts, **kw):
        read.append(list(texts))
        return real_p(engine_, prompts, texts, **kw)

    monkeypatch.setattr(ending, "end_probabilities", spy)
    biased = user_turns(engine, contexts, s.replace(end_bias=3.0), seed=5)
    assert [t.text for t in biased] == [t.text for t in plain] == read[0]  # the text is untouched
    p = real_p(engine, [render_prompt(tok, c) for c in contexts], [t.text for t in plain])
    assert [t.ended for t in biased] == [bool(e and t.text) for e, t in
                                         zip(decide_ends(p, 3.0, 5 + END_DECISION_SEED), plain)]
    monkeypatch.setattr(ending, "end_probabilities", lambda *a, **k: np.full(len(a[2]), 0.5))
    always = user_turns(engine, contexts, s.replace(end_bias=20.0), seed=5)
    never = user_turns(engine, contexts, s.replace(end_bias=-20.0), seed=5)
    assert [t.ended for t in always] == [bool(t.text) for t in plain] and not any(t.ended for t in never)
    with pytest.raises(Exception, match="end_bias"):
        SamplingSettings(end_bias=50.0)
    assert SamplingSettings.from_dict(s.replace(end_bias=1.5).to_dict()).end_bias == 1.5

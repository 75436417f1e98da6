"""User simulator backends (frozen export, local LM, OpenAI-compatible endpoint) and the simulator server."""

import json
import logging
import os
import shutil
import stat
import threading
import urllib.error
import urllib.request

import pytest

from agent_rl.gyms import get_gym
from agent_rl.gyms.base import UserRequest
from agent_rl.users import LMUser, OpenAIUser, load_simulator, short_label
from generator.engine import SamplingSettings
from conversations import DataError


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def frozen_dir(tmp_path_factory, tiny_lm_path):
    from adversary.export import export_frozen
    from generator.model import load_generator

    model, tok = load_generator(tiny_lm_path)
    return export_frozen(model, tok, tmp_path_factory.mktemp("export") / "sim", {"base_model": "tiny-random"})


def _requests(n=3):
    gym = get_gym("intention")
    tasks = gym.tasks("train")[:n]
    return [
        UserRequest(
            context=[{"role": "user", "content": t.opening}, {"role": "assistant", "content": "What is your budget?"}],
            goal=gym.user_goal(t),
            gym="intention",
            task=t,
        )
        for t in tasks
    ]


SMALL = SamplingSettings(max_new_tokens=6, temperature=0.0)


def test_frozen_export_loads_and_replies_in_one_batch(frozen_dir):
    sim = load_simulator(f"frozen:{frozen_dir}", SMALL)
    assert isinstance(sim, LMUser) and sim.manifest["base_model"] == "tiny-random"
    replies = sim.reply(_requests(3))
    assert len(replies) == 3 and all(isinstance(r, str) and r for r in replies) and sim.calls == 1
    assert load_simulator(str(frozen_dir), SMALL).spec == f"frozen:{frozen_dir}"  # a bare export folder
    assert short_label(f"frozen:{frozen_dir}") == "frozen:sim"


def test_an_lm_user_resumes_each_episode_from_its_last_user_turn(varied_lm):
    """An LM user keeps each episode's cache between its turns: every user turn after an episode's first resumes
    from it (the template appends, so the last prompt is a prefix of the next), the replies are the ones a user that
    prefills everything again writes (greedy), and finished episodes leave nothing behind."""
    from agent_rl.agents import ScriptedAgent
    from agent_rl.rollout import episode_specs, run_episodes
    from generator.engine import Engine

    model, tok = varied_lm
    specs = episode_specs(["intention", "travel"], "train", 2, max_turns=4)

    def play(kv_cache_mb):
        user = LMUser(Engine(model, tok, batch_size=8), "hf:varied", SamplingSettings(max_new_tokens=4, temperature=0,
                                                                                      min_new_tokens=4),
                      kv_cache_mb=kv_cache_mb)
        complete, calls = user.engine.complete, []

        def spy(prompts, settings, seed=0, states=None, **kw):
            calls.append(sum(st is not None and st.covers(p) for st, p in zip(states or [], prompts)))
            return complete(prompts, settings, seed, states=states, **kw)

        user.engine.complete = spy
        results = run_episodes(ScriptedAgent("random"), user, specs)
        assert not len(user.kv)
        return [r.messages for r in results], calls

    kept, resumed = play(1024)
    fresh, none = play(0)
    assert kept == fresh
    assert resumed[0] == 0 and len(resumed) > 1 and all(k > 0 for k in resumed[1:])
    assert set(none) == {0}


def test_frozen_refuses_a_tampered_export(frozen_dir, tmp_path):
    from adversary.export import ExportError

    bad = tmp_path / "tampered"
    shutil.copytree(frozen_dir, bad)
    cfg = bad / "config.json"
    os.chmod(cfg, stat.S_IRUSR | stat.S_IWUSR)
    data = json.loads(cfg.read_text())
    data["num_hidden_layers"] = 1
    cfg.write_text(json.dumps(data))
    with pytest.raises(ExportError, match="config.json: changed"):
        load_simulator(f"frozen:{bad}", SMALL)
    (bad / "simulator.json").chmod(0o644)
    (bad / "simulator.json").unlink()
    with pytest.raises(DataError, match="manifest missing"):
        load_simulator(f"frozen:{bad}", SMALL)


def test_frozen_export_defaults_to_the_settings_it_was_measured_with(tmp_path, tiny_lm_path):
    from adversary.export import export_frozen
    from generator.model import load_generator

    model, tok = load_generator(tiny_lm_path)
    recorded = SamplingSettings(max_new_tokens=96, temperature=0.9, top_p=0.9, max_prompt_tokens=144)
    d = export_frozen(model, tok, tmp_path / "sim", {"base_model": "tiny-random", "sampling": recorded.to_dict()})
    assert load_simulator(f"frozen:{d}").settings == recorded
    assert load_simulator(f"frozen:{d}", SMALL).settings == SMALL  # the caller's choice wins


def test_an_export_with_a_calibrated_end_decision_draws_it(frozen_dir, monkeypatch):
    import numpy as np

    import generator.ending as ending

    monkeypatch.setattr(ending, "end_probabilities", lambda *a, **k: np.full(len(a[2]), 0.5))
    some_text = SamplingSettings(max_new_tokens=6, temperature=1.0, min_new_tokens=4)  # no empty turn: it never ends
    turns = load_simulator(f"frozen:{frozen_dir}", some_text.replace(end_bias=20.0)).turns(_requests(3))
    assert [t.ended for t in turns] == [True, True, True]  # the decision, not a marker the tiny model never writes
    never = load_simulator(f"frozen:{frozen_dir}", some_text.replace(end_bias=-20.0)).turns(_requests(3))
    assert not any(t.ended for t in never) and [t.text for t in never] == [t.text for t in turns]


def test_unknown_specs_are_refused():
    for spec in ("nope:x", "scripted:chatty", "openai:model-without-url", "hf:"):
        with pytest.raises(DataError):
            load_simulator(spec)


def test_openai_user_sends_role_flipped_messages_with_the_key(scripted_endpoint, monkeypatch, caplog):
    """A stand-in OpenAI-compatible endpoint records what it receives and answers 'reply N'."""
    import itertools

    n = itertools.count(1)  # next() on a count is atomic: the server answers from several threads
    ep = scripted_endpoint(lambda body, headers: f"reply {next(n)}")
    url = ep.url
    monkeypatch.setenv("AGENT_RL_TEST_KEY", "k-123")
    sim = load_simulator(f"openai:gpt-user@{url}", SamplingSettings(max_new_tokens=4), api_key_env="AGENT_RL_TEST_KEY")
    assert isinstance(sim, OpenAIUser) and "k-123" not in repr(sim)
    reqs = _requests(2)
    with caplog.at_level(logging.DEBUG):
        replies = sim.reply(reqs)
    assert sorted(replies) == ["reply 1", "reply 2"]
    assert "k-123" not in caplog.text
    for req in ep.seen:
        body = req["body"]
        assert req["auth"] == "Bearer k-123" and req["path"] == "/v1/chat/completions"
        assert body["model"] == "gpt-user" and body["max_tokens"] == 4
        msgs = body["messages"]
        # the user's point of view: the goal in the system prompt, the agent's question last, as 'user'
        assert msgs[0]["role"] == "system" and "reveal a detail only when" in msgs[0]["content"].lower()
        assert msgs[-1] == {"role": "user", "content": "What is your budget?"}
        assert {"role": "assistant", "content": reqs[0].context[0]["content"]} in msgs

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


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny models gain nothing from intra-op threads, and on a shared 2-core machine they lose a lot to contention
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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


def test_unknown_specs_are_refused():
    for spec in ("nope:x", "scripted:chatty", "openai:model-without-url", "hf:"):
        with pytest.raises(DataError):
            load_simulator(spec)


@pytest.fixture
def fake_openai():
    """A stand-in OpenAI-compatible endpoint that records what it receives and answers 'reply N'."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"auth": self.headers.get("Authorization"), "path": self.path, **body})
            data = json.dumps({"choices": [{"message": {"role": "assistant", "content": f"reply {len(seen)}"}}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1", seen
    srv.shutdown()
    srv.server_close()


def test_openai_user_sends_role_flipped_messages_with_the_key(fake_openai, monkeypatch, caplog):
    url, seen = fake_openai
    monkeypatch.setenv("AGENT_RL_TEST_KEY", "k-123")
    sim = load_simulator(f"openai:gpt-user@{url}", SamplingSettings(max_new_tokens=4), api_key_env="AGENT_RL_TEST_KEY")
    assert isinstance(sim, OpenAIUser) and "k-123" not in repr(sim)
    reqs = _requests(2)
    with caplog.at_level(logging.DEBUG):
        replies = sim.reply(reqs)
    assert sorted(replies) == ["reply 1", "reply 2"]
    assert "k-123" not in caplog.text
    for body in seen:
        assert body["auth"] == "Bearer k-123" and body["path"] == "/v1/chat/completions"
        assert body["model"] == "gpt-user" and body["max_tokens"] == 4
        msgs = body["messages"]
        # the user's point of view: the goal in the system prompt, the agent's question last, as 'user'
        assert msgs[0]["role"] == "system" and "reveal a detail only when" in msgs[0]["content"].lower()
        assert msgs[-1] == {"role": "user", "content": "What is your budget?"}
        assert {"role": "assistant", "content": reqs[0].context[0]["content"]} in msgs

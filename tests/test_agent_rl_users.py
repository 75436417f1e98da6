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
from agent_rl.serve import make_server
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


def test_unknown_specs_are_refused():
    for spec in ("nope:x", "scripted:chatty", "openai:model-without-url", "hf:"):
        with pytest.raises(DataError):
            load_simulator(spec)


@pytest.fixture(scope="module")
def server(tiny_lm_path):
    sim = load_simulator(f"hf:{tiny_lm_path}", SamplingSettings(max_new_tokens=6, temperature=0.0))
    srv = make_server(sim, "127.0.0.1", 0, api_key_env="AGENT_RL_TEST_KEY", model_name="tiny-sim")
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    srv.batcher.close()


def _call(port, path, body=None, key=None):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_server_answers_a_chat_request_over_loopback(server, monkeypatch):
    monkeypatch.delenv("AGENT_RL_TEST_KEY", raising=False)
    assert server.server_address[0] == "127.0.0.1"
    port = server.server_address[1]
    body = {
        "model": "tiny-sim",
        "messages": [
            {"role": "system", "content": "You want a hotel near the beach under $120."},
            {"role": "user", "content": "I need a hotel."},
            {"role": "assistant", "content": "Which area would you like?"},
        ],
        "max_tokens": 4,
    }
    status, out = _call(port, "/v1/chat/completions", body)
    assert status == 200 and out["object"] == "chat.completion"
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str) and msg["content"]
    status, models = _call(port, "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "tiny-sim"
    # the conversation must end with the agent's message: the user answers it
    status, err = _call(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "agent" in err["error"]["message"]
    assert _call(port, "/v1/chat/completions", {"messages": "nope"})[0] == 400
    assert _call(port, "/v1/nothing", {"messages": []})[0] == 404


def test_server_requires_the_key_when_set(server, monkeypatch, caplog):
    port = server.server_address[1]
    monkeypatch.setenv("AGENT_RL_TEST_KEY", "s3cret-key")
    body = {"messages": [{"role": "assistant", "content": "Hello! What can I do for you?"}], "max_tokens": 3}
    with caplog.at_level(logging.INFO):
        assert _call(port, "/v1/chat/completions", body)[0] == 401
        assert _call(port, "/v1/chat/completions", body, key="wrong")[0] == 401
        assert _call(port, "/v1/models")[0] == 401
        assert _call(port, "/v1/chat/completions", body, key="s3cret-key")[0] == 200
    assert "s3cret-key" not in caplog.text


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


def test_server_batches_concurrent_requests(server, monkeypatch):
    monkeypatch.delenv("AGENT_RL_TEST_KEY", raising=False)
    port = server.server_address[1]
    before = server.batcher.batches
    body = {"messages": [{"role": "assistant", "content": "Hi, how can I help?"}], "max_tokens": 3}
    out = []
    threads = [threading.Thread(target=lambda: out.append(_call(port, "/v1/chat/completions", body)))
               for _ in range(4)]
    server.batcher.wait_s = 0.5  # a wide window so that the four land in one batch even on a busy machine
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.batcher.wait_s = 0.01
    assert [s for s, _ in out] == [200] * 4
    assert server.batcher.batches - before < 4

"""The simulator server under real clients: the official `openai` client on loopback, UserRL's request shapes (built
here from UserRL's documented behaviour, not copied), a scripted judge upstream, abandoned and malformed requests."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from agent_rl.serve import make_server, upstream_client
from agent_rl.userrl import parse_roleplay
from agent_rl.users import load_simulator
from generator.engine import SamplingSettings

BUDGET = SamplingSettings(max_new_tokens=8, temperature=1.0, top_p=0.95, max_prompt_tokens=256)


def intention_request(question="What is your budget for the trip?", history=(("Where to?", "somewhere warm"),)):
    """A user-simulation request in the shape of UserRL's IntentionGym: one role-play `user` message holding the task,
    the helper's question and the exchange so far as Helper:/You: lines, asking for JSON with `response`."""
    lines = "\n".join(f"Helper: {q}\nYou: {a}" for q, a in history)
    prompt = (
        "You play someone who asked for help with a vague request and now answers a helper.\n\n"
        "ORIGINAL TASK REQUEST: {'task': 'Plan a short holiday for me', 'category': 'travel'}\n"
        "CATEGORY: travel\n\n"
        f"CURRENT QUESTION FROM HELPER: {question}\n\n"
        f"CONVERSATION HISTORY:\n{lines or 'This is the first question.'}\n\n"
        "Answer as that person. Reply in this json format:\n"
        '{\n    "thought": "why you answer this way",\n    "response": "what you say"\n}\n'
    )
    return [{"role": "system", "content": "You help someone answer questions about their request."},
            {"role": "user", "content": prompt}]


def telepathy_request(question="Is it an animal?"):
    """UserRL TelepathyGym's question turn: markdown sections for the entity and the question, JSON with `response`."""
    system = ("## **Task**\nYou think of an entity; the player asks yes/no questions about it.\n\n"
              "## **Example Format**\n```json\n{\n    \"thought\": \"...\",\n    \"response\": \"Yes\" or \"No\"\n}\n```")
    user = ("## **Note**\n- Answer in JSON.\n\n### Target Entity You Are Thinking Of\nan octopus\n\n"
            f"### User's Current Question\n{question}\n\n### Your Response\n```json\n")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def judge_request():
    """A judge call of the same gyms: it asks for other fields (`judgment`, `feedback`)."""
    return [{"role": "system", "content": "## **Task**\nJudge whether the final guess names the entity.\n"
                                          '```json\n{"thought": "...", "judgment": "Yes", "feedback": "..."}\n```'},
            {"role": "user", "content": "### Target Entity\nan octopus\n\n### User's Final Guess\nsquid"}]


def test_roleplay_recognition_extracts_goal_question_and_history():
    rp = parse_roleplay(intention_request())
    assert rp is not None and rp.question == "What is your budget for the trip?"
    assert "Plan a short holiday" in rp.goal and "Category: travel" in rp.goal and "Helper" not in rp.goal
    assert rp.history == [{"role": "assistant", "content": "Where to?"}, {"role": "user", "content": "somewhere warm"}]
    assert rp.context()[-1] == {"role": "assistant", "content": "What is your budget for the trip?"}
    assert rp.fields == ["thought", "response"] and json.loads(rp.reply("about 500")) == {"thought": "", "response": "about 500"}
    tp = parse_roleplay(telepathy_request())
    assert tp is not None and tp.question == "Is it an animal?" and "an octopus" in tp.goal and tp.history == []
    assert parse_roleplay(judge_request()) is None  # judgment/feedback: not a user turn
    assert parse_roleplay([{"role": "user", "content": "hello there"}]) is None


@pytest.fixture(scope="module")
def upstream():
    """A scripted OpenAI-compatible judge on loopback: answers every request with a fixed judgment, records them."""
    from conftest import ScriptedEndpoint

    ep = ScriptedEndpoint(lambda body, headers: '{"judgment": "No", "feedback": "Not quite."}')
    yield ep.url, ep.seen
    ep.close()


@pytest.fixture(scope="module")
def server(tiny_lm_path, upstream):
    import torch

    torch.set_num_threads(1)
    sim = load_simulator(f"hf:{tiny_lm_path}", BUDGET, dtype="fp32")
    judge = upstream_client(f"openai:judge-model@{upstream[0]}", "NO_SUCH_KEY_ENV")
    srv = make_server(sim, "127.0.0.1", 0, api_key_env="AGENT_RL_SERVE_TEST_KEY", model_name="tiny-sim", userrl=True,
                      judge=judge, batch_wait_s=0.01)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()
    srv.batcher.close()


def client(server, **kw):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1",
                         **{"api_key": "unused", "max_retries": 0, "timeout": 30, **kw})


def test_userrl_request_is_answered_in_the_gyms_json(server):
    """UserRL's own call: [system, user], temperature 0, max_tokens 2048, timeout 10, through the official client."""
    out = client(server, timeout=10).chat.completions.create(model="whatever", messages=intention_request(),
                                                             temperature=0.0, max_tokens=2048)
    reply = json.loads(out.choices[0].message.content)
    assert set(reply) == {"thought", "response"} and isinstance(reply["response"], str)
    import ast

    assert ast.literal_eval(out.choices[0].message.content)["response"] == reply["response"]  # TelepathyGym's parser
    assert out.usage.completion_tokens <= BUDGET.max_new_tokens  # 2048 clamped to the simulator's turn budget
    assert out.usage.prompt_tokens > 0 and out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.choices[0].finish_reason == ("length" if out.usage.completion_tokens == BUDGET.max_new_tokens else "stop")
    extra = out.model_extra["simulator"]
    assert extra["userrl"] and extra["temperature"] == BUDGET.temperature and extra["max_tokens"] == BUDGET.max_new_tokens
    assert any("temperature 0.0 replaced" in n for n in extra["notes"]) and any("clamped" in n for n in extra["notes"])
    tel = client(server).chat.completions.create(model="m", messages=telepathy_request(), temperature=0.0)
    assert "response" in json.loads(tel.choices[0].message.content)


def test_judge_calls_are_forwarded_upstream(server, upstream):
    url, seen = upstream
    before = len(seen)
    out = client(server).chat.completions.create(model="m", messages=judge_request(), temperature=0.0, max_tokens=64)
    assert json.loads(out.choices[0].message.content) == {"judgment": "No", "feedback": "Not quite."}
    last = seen[-1]["body"]
    assert len(seen) == before + 1 and last["messages"] == judge_request() and last["max_tokens"] == 64
    assert last["model"] == "judge-model" and last["temperature"] == 0.0


def test_standard_and_agent_orientations(server):
    c = client(server)
    standard = [{"role": "system", "content": "You want a cheap hotel."}, {"role": "user", "content": "Which city?"}]
    agent_view = [{"role": "system", "content": "You want a cheap hotel."}, {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "Which city?"}]
    # not UserRL-shaped either: a plain chat goes to the upstream in --userrl mode, so use a server without it
    assert c is not None
    sim = server.batcher.simulator
    plain = make_server(sim, "127.0.0.1", 0, api_key_env="", model_name="p")
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    try:
        pc = client(plain)
        for msgs in (standard, agent_view):
            out = pc.chat.completions.create(model="p", messages=msgs, max_tokens=4)
            assert isinstance(out.choices[0].message.content, str) and out.usage.completion_tokens <= 4
    finally:
        plain.shutdown()
        plain.server_close()
        plain.batcher.close()


def _raw(port, method, path, body: bytes | None = None, headers=None, chunked=False, read=True):
    """One request on a raw socket (keep-alive), returning (status, json) and the socket."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    h = {"Host": "x", "Content-Type": "application/json", **(headers or {})}
    if body is not None and not chunked:
        h["Content-Length"] = str(len(body))
    if chunked:
        h["Transfer-Encoding"] = "chunked"
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
    payload = head.encode()
    if body is not None:
        payload += (b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in (body[:10], body[10:])) + b"0\r\n\r\n"
                    if chunked else body)
    s.sendall(payload)
    if not read:
        return s
    f = s.makefile("rb")
    status = int(f.readline().split()[1])
    length = 0
    while (line := f.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length"):
            length = int(line.split(b":")[1])
    return status, json.loads(f.read(length)), s


def test_malformed_requests_get_a_4xx_that_says_what_is_expected(server):
    port = server.server_address[1]
    cases = [
        (b"not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"messages": []}).encode(), "non-empty list"),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), "role of system, user or assistant"),
        (json.dumps({"messages": intention_request(), "n": 2}).encode(), "n must be 1"),
        (json.dumps({"messages": intention_request(), "temperature": -1}).encode(), "temperature must be >= 0"),
        (json.dumps({"messages": intention_request(), "stream": True}).encode(), "stream=true is not supported"),
        (json.dumps({"messages": intention_request(), "max_tokens": "many"}).encode(), "'max_tokens' must be a number"),
        (b"", "body is empty"),
    ]
    for body, want in cases:
        status, doc, s = _raw(port, "POST", "/v1/chat/completions", body)
        s.close()
        assert 400 <= status < 500 and want in doc["error"]["message"], (body, status, doc)
    status, doc, s = _raw(port, "POST", "/v1/nowhere", b"{}")
    assert status == 404 and "POST /v1/chat/completions" in doc["error"]["message"]
    s.close()


def test_error_bodies_are_drained_and_chunked_bodies_read(server, monkeypatch):
    port = server.server_address[1]
    body = json.dumps({"messages": telepathy_request(), "max_tokens": 3}).encode()
    monkeypatch.setenv("AGENT_RL_SERVE_TEST_KEY", "k3y")
    # a 401 before the body is looked at: the body is still read, so the same connection serves the next request
    status, doc, s = _raw(port, "POST", "/v1/chat/completions", body)
    assert status == 401
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    f = s.makefile("rb")
    assert int(f.readline().split()[1]) == 200  # the health route stays open without the key
    s.close()
    monkeypatch.delenv("AGENT_RL_SERVE_TEST_KEY")
    status, doc, s = _raw(port, "POST", "/v1/chat/completions", body, chunked=True)
    s.close()
    assert status == 200 and "response" in json.loads(doc["choices"][0]["message"]["content"])


def test_an_oversized_body_gets_a_413_the_client_can_read(server):
    """5 MiB through urllib and the official client: each reads the 413 and its message, not a broken pipe; the
    server answers the next request."""
    import openai

    big = json.dumps({"messages": [{"role": "user", "content": "x" * (5 << 20)}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions", data=big,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 413 and "over 4 MiB" in json.loads(e.value.read())["error"]["message"]
    with pytest.raises(openai.APIStatusError) as e:
        client(server).chat.completions.create(model="m", messages=[{"role": "user", "content": "y" * (5 << 20)}])
    assert e.value.status_code == 413
    out = client(server).chat.completions.create(model="m", messages=telepathy_request(), max_tokens=3)
    assert out.choices[0].message.content is not None


def test_an_abandoned_request_is_cancelled_and_does_not_delay_the_next(tiny_lm_path):
    """A client that gives up (UserRL's 10 s timeout): its request is dropped from the batch at the next token, so a
    request that arrives after it is answered without waiting for the abandoned one's full budget."""
    import torch

    torch.set_num_threads(1)
    slow = SamplingSettings(max_new_tokens=400, min_new_tokens=400, temperature=1.0, max_prompt_tokens=256)
    sim = load_simulator(f"hf:{tiny_lm_path}", slow, dtype="fp32")
    srv = make_server(sim, "127.0.0.1", 0, api_key_env="", model_name="t", batch_wait_s=0.0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        t0 = time.perf_counter()
        full = client(srv).chat.completions.create(model="t", messages=[{"role": "user", "content": "hello?"}])
        alone = time.perf_counter() - t0
        assert full.usage.completion_tokens == 400
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
        s = _raw(port, "POST", "/v1/chat/completions", body, read=False)
        time.sleep(alone / 8)  # it is generating now
        s.close()  # the client gives up
        t1 = time.perf_counter()
        nxt = client(srv).chat.completions.create(model="t", messages=[{"role": "user", "content": "again"}],
                                                  max_tokens=4)
        waited = time.perf_counter() - t1
        assert nxt.usage.completion_tokens <= 4
        assert waited < 0.6 * alone, (waited, alone)  # not queued behind the abandoned 400-token turn
        deadline = time.time() + 5
        while srv.batcher.cancelled < 1 and time.time() < deadline:
            time.sleep(0.05)
        assert srv.batcher.cancelled >= 1
    finally:
        srv.shutdown()
        srv.server_close()
        srv.batcher.close()


def test_concurrent_requests_are_batched(server):
    before = server.batcher.batches
    out = []
    server.batcher.wait_s = 0.5  # a wide window so that the four land in one batch even on a busy machine
    try:
        threads = [threading.Thread(target=lambda: out.append(client(server).chat.completions.create(
            model="m", messages=intention_request(), max_tokens=3))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.batcher.wait_s = 0.01
    assert len(out) == 4 and server.batcher.batches - before < 4


def test_server_requires_the_key_when_set_and_never_logs_it(server, monkeypatch, caplog):
    import logging

    import openai

    monkeypatch.setenv("AGENT_RL_SERVE_TEST_KEY", "s3cret-key")
    with caplog.at_level(logging.INFO):
        with pytest.raises(openai.AuthenticationError):
            client(server).chat.completions.create(model="m", messages=telepathy_request(), max_tokens=2)
        ok = client(server, api_key="s3cret-key").chat.completions.create(model="m", messages=telepathy_request(),
                                                                           max_tokens=2)
        assert ok.choices[0].message.content
    assert "s3cret-key" not in caplog.text
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/health", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/v1/models", timeout=10)
    assert e.value.code == 401


def test_refuse_policy_says_what_temperature_is_expected(tiny_lm_path):
    import openai

    sim = load_simulator(f"hf:{tiny_lm_path}", BUDGET, dtype="fp32")
    srv = make_server(sim, "127.0.0.1", 0, api_key_env="", temperature_policy="refuse")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(openai.BadRequestError, match="trained and measured at 1.0"):
            client(srv).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0)
    finally:
        srv.shutdown()
        srv.server_close()
        srv.batcher.close()

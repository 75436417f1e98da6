"""Serve a frozen user simulator as an OpenAI-compatible chat endpoint, so that agent-RL frameworks that take an
OpenAI base URL for their user model can use it unchanged.

    python -m agent_rl.serve DIR [--port 8000] [--host 127.0.0.1] [--api-key-env AGENT_RL_API_KEY]

- POST /v1/chat/completions: `messages` is the conversation from the AGENT's point of view (the agent is `assistant`,
  the user is `user`), ending with the agent's message (or empty: the user opens). The role flip happens here; the
  reply's `choices[0].message.content` is the user's next turn (role `assistant`, as OpenAI clients expect of a
  completion). The user's hidden goal / profile: the request's `goal` (and `persona`) field if given (system messages
  are then the agent's own instructions, which the simulator sees as such); otherwise the system messages are the goal.
  `max_tokens`, `temperature`, `top_p` are honoured; `stream` is not supported.
- GET /v1/models lists the one model; GET /health answers {"status": "ok"}.
- Binds 127.0.0.1 unless `--host` says otherwise. When the environment variable named by `--api-key-env` is set, every
  request needs `Authorization: Bearer <key>` (401 otherwise); the key is never logged.
- Concurrent requests are batched: one generate for everything that arrives within `--batch-wait-ms`.
DIR is a frozen export (hashes verified, a modified export is refused); any LM simulator spec (hf:MODEL, frozen:DIR,
openai:...) also works.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hmac
import json
import logging
import os
import queue
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from conversations import DataError
from conversations.cli_util import friendly_errors

from agent_rl.gyms import UserRequest
from agent_rl.users import DEFAULT_SETTINGS, ScriptedUser, load_simulator, short_label
from generator.engine import SamplingSettings

log = logging.getLogger("agent_rl.serve")
DEFAULT_KEY_ENV = "AGENT_RL_API_KEY"
MAX_BODY = 4 << 20  # bytes: a conversation, not a file upload


class BadRequest(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class Batcher:
    """Collects concurrent requests for up to `wait_s` (or `max_batch` of them) and answers them with one simulator
    call per distinct sampling setting."""

    def __init__(self, simulator, max_batch: int = 16, wait_s: float = 0.01):
        self.simulator, self.max_batch, self.wait_s = simulator, max_batch, wait_s
        self.q: queue.Queue = queue.Queue()
        self.batches = 0
        self._thread = threading.Thread(target=self._loop, name="simulator-batcher", daemon=True)
        self._thread.start()

    def submit(self, request: UserRequest, settings: SamplingSettings, timeout: float = 600.0) -> str:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.q.put((request, settings, fut))
        return fut.result(timeout=timeout)

    def close(self):
        self.q.put(None)

    def _loop(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            batch, deadline = [item], time.monotonic() + self.wait_s
            while len(batch) < self.max_batch:
                try:
                    nxt = self.q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    self.q.put(None)
                    break
                batch.append(nxt)
            groups: dict[Any, list] = {}
            for req, settings, fut in batch:
                groups.setdefault(settings, []).append((req, fut))
            for settings, items in groups.items():
                try:
                    texts = self.simulator.reply([r for r, _ in items], settings=settings)
                    for (_, fut), text in zip(items, texts):
                        fut.set_result(text)
                except Exception as e:  # noqa: BLE001 - handed to every waiting request
                    for _, fut in items:
                        fut.set_exception(e)
            self.batches += 1


def _text(content: Any) -> str:
    """OpenAI message content: a string or a list of parts (text parts kept)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    if content is None:
        return ""
    raise BadRequest(400, "message content must be a string or a list of text parts")


def parse_chat_request(body: dict[str, Any], defaults: SamplingSettings) -> tuple[UserRequest, SamplingSettings]:
    """An OpenAI chat request (agent's point of view) as a simulator request plus its sampling settings."""
    if not isinstance(body, dict):
        raise BadRequest(400, "the body must be a JSON object")
    if body.get("stream"):
        raise BadRequest(400, "stream=true is not supported")
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise BadRequest(400, "'messages' must be a list of {role, content}")
    messages = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise BadRequest(400, "each message needs a role of system, user or assistant")
        role = "system" if m["role"] == "developer" else m["role"]
        messages.append({"role": role, "content": _text(m.get("content"))})
    goal = body.get("goal")
    system = [m["content"] for m in messages if m["role"] == "system" and m["content"].strip()]
    if goal is None:  # no explicit goal: the system messages describe the user to simulate
        goal = "\n\n".join(system) or None
        messages = [m for m in messages if m["role"] != "system"]
    body_msgs = [m for m in messages if m["role"] != "system"]
    if body_msgs and body_msgs[-1]["role"] != "assistant":
        raise BadRequest(400, "the conversation (agent's point of view) must end with the agent's (assistant) "
                              "message: the user's next turn answers it")
    settings = defaults
    overrides = (("max_new_tokens", "max_tokens", int), ("max_new_tokens", "max_completion_tokens", int),
                 ("temperature", "temperature", float), ("top_p", "top_p", float))
    for field_name, key, cast in overrides:
        if body.get(key) is not None:
            try:
                settings = dataclasses.replace(settings, **{field_name: cast(body[key])})
            except DataError as e:
                raise BadRequest(400, f"'{key}': {e}") from None
            except (TypeError, ValueError):
                raise BadRequest(400, f"'{key}' must be a number") from None
    if not 1 <= settings.max_new_tokens <= 4096:
        raise BadRequest(400, "max_tokens must be between 1 and 4096")
    persona = body.get("persona")
    req = UserRequest(context=messages, goal=goal, gym="", task=None, persona=persona)
    return req, settings


def make_server(simulator, host: str = "127.0.0.1", port: int = 8000, *, api_key_env: str = DEFAULT_KEY_ENV,
                model_name: str | None = None, max_batch: int = 16, batch_wait_s: float = 0.01) -> ThreadingHTTPServer:
    """A ready (not yet serving) HTTP server; `serve_forever()` runs it, `server_address[1]` is its port (0: any)."""
    if isinstance(simulator, ScriptedUser):
        raise DataError("scripted users need a gym's hidden task; serve an LM simulator (frozen:DIR or hf:MODEL)")
    model_name = model_name or short_label(simulator.spec)
    batcher = Batcher(simulator, max_batch=max_batch, wait_s=batch_wait_s)
    defaults = getattr(simulator, "settings", DEFAULT_SETTINGS)
    created = int(time.time())

    class Handler(BaseHTTPRequestHandler):
        server_version = "agent-rl-simulator/1"
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # the request line only; headers (the key) are never logged
            log.info("%s %s", self.address_string(), fmt % args)

        def _send(self, status: int, payload: dict[str, Any]):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, e: BadRequest):
            self._send(e.status, {"error": {"message": e.message, "type": e.code, "code": e.status}})

        def _authorised(self) -> bool:
            key = os.environ.get(api_key_env) if api_key_env else None
            if not key:
                return True
            got = self.headers.get("Authorization", "")
            token = got[7:] if got.startswith("Bearer ") else self.headers.get("x-api-key", "")
            return hmac.compare_digest(token.encode(), key.encode())

        def do_GET(self):
            if not self._authorised():
                return self._error(BadRequest(401, "missing or wrong API key", "invalid_api_key"))
            path = self.path.split("?")[0].rstrip("/")
            if path in ("/v1/models", "/models"):
                return self._send(200, {"object": "list", "data": [
                    {"id": model_name, "object": "model", "created": created, "owned_by": "agent_rl"}]})
            if path == "/health":
                return self._send(200, {"status": "ok"})
            self._error(BadRequest(404, f"no route {self.path}", "not_found"))

        def do_POST(self):
            try:
                if not self._authorised():
                    raise BadRequest(401, "missing or wrong API key", "invalid_api_key")
                if self.path.split("?")[0].rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                    raise BadRequest(404, f"no route {self.path}", "not_found")
                n = int(self.headers.get("Content-Length") or 0)
                if n <= 0 or n > MAX_BODY:
                    raise BadRequest(400 if n <= 0 else 413, "missing or oversized body")
                try:
                    body = json.loads(self.rfile.read(n))
                except json.JSONDecodeError:
                    raise BadRequest(400, "the body is not valid JSON") from None
                req, settings = parse_chat_request(body, defaults)
                text = batcher.submit(req, settings)
            except BadRequest as e:
                return self._error(e)
            except Exception as e:  # noqa: BLE001 - a simulator failure is a 500 for this request, not a dead server
                log.exception("simulator failed")
                return self._error(BadRequest(500, f"simulator error: {type(e).__name__}", "server_error"))
            self._send(200, {
                "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model") or model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            })

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.batcher = batcher  # type: ignore[attr-defined]
    return server


@friendly_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent_rl.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("simulator", help="a frozen export folder (or any LM simulator spec: frozen:DIR, hf:MODEL)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key-env", default=DEFAULT_KEY_ENV,
                   help="environment variable holding the API key; when it is set, requests must carry it")
    p.add_argument("--model-name", default=None, help="the id /v1/models reports (default: from the folder name)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--batch-wait-ms", type=float, default=10.0)
    p.add_argument("--device", default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    spec = a.simulator if ":" in a.simulator else f"frozen:{a.simulator}"
    settings = SamplingSettings(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                                max_prompt_tokens=768)
    simulator = load_simulator(spec, settings, batch_size=a.max_batch, device=a.device)
    if a.host not in ("127.0.0.1", "localhost", "::1") and not os.environ.get(a.api_key_env):
        log.warning("listening on %s without an API key: set %s to require one", a.host, a.api_key_env)
    server = make_server(simulator, a.host, a.port, api_key_env=a.api_key_env, model_name=a.model_name,
                         max_batch=a.max_batch, batch_wait_s=a.batch_wait_ms / 1000)
    host, port = server.server_address[:2]
    log.info("serving %s at http://%s:%d/v1 (auth %s)", spec, host, port,
             "on" if os.environ.get(a.api_key_env) else "off")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.batcher.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

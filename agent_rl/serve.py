"""Serve a frozen user simulator as an OpenAI-compatible chat endpoint, so that agent-RL frameworks that take an
OpenAI base URL for their user model (UserRL among them) can use it unchanged.

    python -m agent_rl.serve DIR [--port 8000] [--host 127.0.0.1]
    python -m agent_rl.serve DIR --userrl --judge-upstream openai:MODEL@URL      # UserRL's gyms, unchanged

POST /v1/chat/completions. `messages` is the conversation with the agent; the simulator writes the user's next turn,
returned as `choices[0].message.content` (role `assistant`, as OpenAI clients expect of a completion). Orientation:
- a conversation ending with a `user` message is the standard one: the client (the agent) speaks as `user`, the
  simulator's earlier turns are `assistant`;
- a conversation ending with an `assistant` message is the agent's point of view: the agent is `assistant`, the user
  `user` (what `agent_rl.users` sends);
- system messages describe the user to simulate (its hidden goal), unless the body has a `goal` (and `persona`) field;
- with `--userrl`, a request in UserRL's user-simulation shape (`agent_rl.userrl`: a role-play prompt asking for JSON
  with a `response` field) is answered in that JSON; every other request (the gyms' judge calls) is forwarded to
  `--judge-upstream`, so rewards stay the upstream model's; a request that is neither gets a 400 saying so.
Sampling: the export's recorded settings are the defaults (token budget, temperature, top-p). `max_tokens` is
clamped to the simulator's turn budget (`finish_reason: "length"` when a turn hits it). A temperature the simulator
was not made for (below `--min-temperature`; UserRL asks for 0, and greedy decoding turns the export into an
assistant) is replaced by the export's own (`--temperature-policy override`, said in the reply's `simulator` field
and the log) or refused with a 400 (`refuse`). `n` > 1, negative temperatures and `stream: true` are refused with
a 400 that says what is expected. `usage` counts tokens.
Robustness: concurrent requests are batched into one engine call (arrivals within `--batch-wait-ms`); a request whose
client has gone is dropped from its batch at the next token; request bodies are read (and drained on errors) with
Content-Length or chunked transfer; bodies over 4 MiB get a 413.
GET /v1/models lists the one model; GET /health answers {"status": "ok"} (no key needed). Binds 127.0.0.1 unless
`--host` says otherwise; when the environment variable named by `--api-key-env` is set, every other route needs
`Authorization: Bearer <key>` (401); the key is never logged.
DIR is a frozen export (hashes verified, a modified export is refused); any LM simulator spec (hf:MODEL, frozen:DIR,
openai:...) also works.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hmac
import json
import logging
import os
import select
import socket
import sys
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from conversations import DataError
from conversations.cli_util import friendly_errors

from agent_rl.batcher import Batcher, Job
from agent_rl.gyms import UserRequest
from agent_rl.openai_requests import BadRequest, Policy, read_messages, sampling_for, to_request
from agent_rl.userrl import RolePlay, parse_roleplay
from agent_rl.users import DEFAULT_SETTINGS, EMPTY_REPLY, ScriptedUser, load_simulator, short_label

log = logging.getLogger("agent_rl.serve")
DEFAULT_KEY_ENV = "AGENT_RL_API_KEY"
MAX_BODY = 4 << 20  # bytes: a conversation, not a file upload
# an oversized body is still read (and thrown away) up to this size before the 413 goes out: a server that answers
# and closes while the client is still sending resets the connection, and the client sees a broken pipe instead of
# the 413 (measured with requests and httpx at 5 MiB); beyond it the connection is closed unread
DRAIN_LIMIT = 64 << 20


def make_server(simulator, host: str = "127.0.0.1", port: int = 8000, *, api_key_env: str = DEFAULT_KEY_ENV,
                model_name: str | None = None, max_batch: int = 16, batch_wait_s: float = 0.01, userrl: bool = False,
                judge=None, min_temperature: float = 0.3, temperature_policy: str = "override") -> ThreadingHTTPServer:
    """A ready (not yet serving) HTTP server; `serve_forever()` runs it, `server_address[1]` is its port (0: any).
    `judge`: a `conversations.openai_client.ChatClient` that non-simulation requests are forwarded to (`--userrl`)."""
    if isinstance(simulator, ScriptedUser):
        raise DataError("scripted users need a gym's hidden task; serve an LM simulator (frozen:DIR or hf:MODEL)")
    if temperature_policy not in ("override", "refuse"):
        raise DataError(f"temperature policy must be override or refuse, got {temperature_policy!r}")
    model_name = model_name or short_label(simulator.spec)
    batcher = Batcher(simulator, max_batch=max_batch, wait_s=batch_wait_s)
    policy = Policy(getattr(simulator, "settings", DEFAULT_SETTINGS), min_temperature, temperature_policy)
    created = int(time.time())
    stats = {"simulated": 0, "userrl": 0, "forwarded": 0, "refused": 0}

    class Handler(BaseHTTPRequestHandler):
        server_version = "agent-rl-simulator/2"
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # the request line only; headers (the key) are never logged
            log.info("%s %s", self.address_string(), fmt % args)

        def _send(self, status: int, payload: dict[str, Any]):
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client has gone: nothing to answer

        def _error(self, e: BadRequest):
            stats["refused"] += 1
            self._send(e.status, {"error": {"message": e.message, "type": e.code, "code": e.status}})

        def _authorised(self) -> bool:
            key = os.environ.get(api_key_env) if api_key_env else None
            if not key:
                return True
            got = self.headers.get("Authorization", "")
            token = got[7:] if got.startswith("Bearer ") else self.headers.get("x-api-key", "")
            return hmac.compare_digest(token.encode(), key.encode())

        def _read_body(self) -> bytes:
            """The whole request body, by Content-Length or chunked transfer; always read, so that an error reply
            leaves the connection in step for the client's next request."""
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                parts, total = [], 0
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                            pass
                        break
                    total += size
                    if total > DRAIN_LIMIT:
                        break
                    data = self.rfile.read(size)
                    if total <= MAX_BODY:
                        parts.append(data)
                    self.rfile.readline()  # the chunk's CRLF
                if total > MAX_BODY:
                    self.close_connection = True
                    raise BadRequest(413, f"the body is over {MAX_BODY >> 20} MiB", "request_too_large")
                return b"".join(parts)
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                self.close_connection = True
                if n <= DRAIN_LIMIT:
                    left = n
                    while left > 0:  # read and dropped, so that the client gets to read the 413
                        got = self.rfile.read(min(left, 1 << 20))
                        if not got:
                            break
                        left -= len(got)
                raise BadRequest(413, f"the body is over {MAX_BODY >> 20} MiB", "request_too_large")
            return self.rfile.read(n) if n > 0 else b""

        def _client_gone(self) -> bool:
            """The client closed its end (a timeout on its side): readable with nothing to read."""
            try:
                r, _, _ = select.select([self.connection], [], [], 0)
                return bool(r) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except (OSError, ValueError):
                return True

        def do_GET(self):
            path = self.path.split("?")[0].rstrip("/")
            if path == "/health":
                return self._send(200, {"status": "ok", **stats, "batches": batcher.batches,
                                        "cancelled": batcher.cancelled})
            if not self._authorised():
                return self._error(BadRequest(401, "missing or wrong API key", "invalid_api_key"))
            if path in ("/v1/models", "/models"):
                return self._send(200, {"object": "list", "data": [
                    {"id": model_name, "object": "model", "created": created, "owned_by": "agent_rl"}]})
            self._error(BadRequest(404, f"no route {self.path}; POST /v1/chat/completions, GET /v1/models, GET /health",
                                   "not_found"))

        def do_POST(self):
            try:
                raw = self._read_body()
                if not self._authorised():
                    raise BadRequest(401, "missing or wrong API key", "invalid_api_key")
                if self.path.split("?")[0].rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                    raise BadRequest(404, f"no route {self.path}; POST /v1/chat/completions", "not_found")
                if not raw:
                    raise BadRequest(400, "the body is empty: send a JSON chat completion request")
                try:
                    body = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise BadRequest(400, "the body is not valid JSON") from None
                if not isinstance(body, dict):
                    raise BadRequest(400, "the body must be a JSON object")
                self._answer(body)
            except BadRequest as e:
                return self._error(e)
            except Exception as e:  # noqa: BLE001 - a simulator failure is a 500 for this request, not a dead server
                log.exception("simulator failed")
                return self._error(BadRequest(500, f"simulator error: {type(e).__name__}", "server_error"))

        def _answer(self, body: dict[str, Any]):
            messages = read_messages(body)
            settings, notes = sampling_for(body, policy)
            roleplay: RolePlay | None = parse_roleplay(messages) if userrl else None
            if userrl and roleplay is None:
                return self._forward(body, messages)
            if roleplay is not None:
                request = UserRequest(context=roleplay.context(), goal=roleplay.goal, gym="userrl", task=None)
            else:
                request = to_request(messages, body)
            job = batcher.submit(Job(request, settings))
            while True:  # wait, watching for a client that gives up (its request is then dropped from the batch)
                try:
                    turn = job.future.result(timeout=0.05)
                    break
                except concurrent.futures.TimeoutError:
                    if self._client_gone():
                        job.gone.set()
                        self.close_connection = True
                        log.info("client gone: request dropped")
                        return
                except concurrent.futures.CancelledError:
                    return
            text = turn.text if turn.text != EMPTY_REPLY else ""
            stats["userrl" if roleplay is not None else "simulated"] += 1
            for note in notes:
                log.info("%s", note)
            self._send(200, {
                "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or model_name,
                "choices": [{"index": 0, "message": {"role": "assistant",
                                                     "content": roleplay.reply(text) if roleplay else text},
                             "finish_reason": "length" if turn.truncated else "stop"}],
                "usage": {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens,
                          "total_tokens": turn.prompt_tokens + turn.completion_tokens},
                "simulator": {"temperature": settings.temperature, "max_tokens": settings.max_new_tokens,
                              "ended": turn.ended, "userrl": roleplay is not None, "notes": notes},
            })

        def _forward(self, body: dict[str, Any], messages: list[dict[str, str]]):
            if judge is None:
                raise BadRequest(400, "this request is not a user-simulation request (no role-play prompt asking "
                                      "for a JSON 'response' with a labelled question) and no --judge-upstream is "
                                      "set to forward it to")
            params = {k: body[k] for k in ("temperature", "max_tokens", "top_p", "stop") if body.get(k) is not None}
            try:
                content = judge.complete(messages, **params)
            except DataError as e:
                raise BadRequest(502, f"judge upstream failed: {e}", "upstream_error") from None
            stats["forwarded"] += 1
            self._send(200, {
                "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or judge.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                "simulator": {"forwarded_to": judge.model},
            })

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.batcher = batcher  # type: ignore[attr-defined]
    server.stats = stats  # type: ignore[attr-defined]
    return server


def upstream_client(spec: str, api_key_env: str):
    """`openai:MODEL@URL` as a ChatClient (the key read from `api_key_env` at each request)."""
    from conversations.openai_client import ChatClient

    kind, _, rest = spec.partition(":")
    model, at, url = rest.partition("@")
    if kind != "openai" or not model or not at or not url:
        raise DataError(f"--judge-upstream must be openai:MODEL@BASE_URL, got '{spec}'")
    return ChatClient(url, model, api_key_env=api_key_env, timeout=60.0, retries=2)


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
    p.add_argument("--max-new-tokens", type=int, default=None, help="turn budget (default: the export's)")
    p.add_argument("--temperature", type=float, default=None, help="default temperature (default: the export's)")
    p.add_argument("--top-p", type=float, default=None, help="default top-p (default: the export's)")
    p.add_argument("--min-temperature", type=float, default=0.3,
                   help="requests below this temperature get the simulator's own (or a 400, see --temperature-policy)")
    p.add_argument("--temperature-policy", choices=("override", "refuse"), default="override")
    p.add_argument("--userrl", action="store_true",
                   help="answer UserRL's user-simulation requests in its JSON; forward other requests upstream")
    p.add_argument("--judge-upstream", default=None, metavar="openai:MODEL@URL",
                   help="where requests that are not user simulation go (UserRL's judge calls)")
    p.add_argument("--judge-api-key-env", default="OPENAI_API_KEY", help="environment variable of the upstream's key")
    p.add_argument("--guidance", type=int, default=None, metavar="K",
                   help="sample K turns a request and keep one by the export's guide (default: the K a guided export "
                        "records; 1: off)")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--batch-wait-ms", type=float, default=10.0)
    p.add_argument("--device", default=None)
    a = p.parse_args(argv)
    for name in ("max_new_tokens", "max_batch", "port"):
        v = getattr(a, name)
        if v is not None and v < (0 if name == "port" else 1):
            raise DataError(f"--{name.replace('_', '-')} must be >= {0 if name == 'port' else 1}, got {v}")
    if a.batch_wait_ms < 0 or a.min_temperature < 0:
        raise DataError("--batch-wait-ms and --min-temperature must be >= 0")
    if a.judge_upstream and not a.userrl:
        raise DataError("--judge-upstream needs --userrl (only UserRL's judge calls are forwarded)")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from conversations.cli_util import start_process

    start_process()
    spec = a.simulator if ":" in a.simulator else f"frozen:{a.simulator}"
    if a.guidance is not None:
        if a.guidance < 1:
            raise DataError(f"--guidance must be >= 1, got {a.guidance}")
        spec += f"#guidance={a.guidance}"
    judge = upstream_client(a.judge_upstream, a.judge_api_key_env) if a.judge_upstream else None
    simulator = load_simulator(spec, None, batch_size=a.max_batch, device=a.device)
    base = getattr(simulator, "settings", DEFAULT_SETTINGS)
    simulator.settings = base.replace(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p)
    if a.host not in ("127.0.0.1", "localhost", "::1") and not os.environ.get(a.api_key_env):
        log.warning("listening on %s without an API key: set %s to require one", a.host, a.api_key_env)
    server = make_server(simulator, a.host, a.port, api_key_env=a.api_key_env, model_name=a.model_name,
                         max_batch=a.max_batch, batch_wait_s=a.batch_wait_ms / 1000, userrl=a.userrl, judge=judge,
                         min_temperature=a.min_temperature, temperature_policy=a.temperature_policy)
    host, port = server.server_address[:2]
    s = simulator.settings
    log.info("serving %s at http://%s:%d/v1 (auth %s; turn budget %d tokens, temperature %s, top-p %s%s)", spec, host,
             port, "on" if os.environ.get(a.api_key_env) else "off", s.max_new_tokens, s.temperature, s.top_p,
             f"; UserRL mode, judge calls to {judge.model}" if a.userrl and judge else "; UserRL mode" if a.userrl else "")
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

"""One client for OpenAI-compatible chat endpoints (`POST {base_url}/chat/completions`), standard library only.

Every caller that talks to such an endpoint uses it: an endpoint assistant in simulated conversations, an endpoint
user simulator, LLM judges, and the simulator server's judge forwarding. What it guarantees:
- the API key is read from an environment variable at each request and never stored, printed or logged (without
  it, requests go unauthenticated: local vLLM / llama.cpp servers accept that);
- transient failures (HTTP 408/409/429/5xx, connection errors, timeouts) are retried with exponential backoff; other
  HTTP errors become a `DataError` naming the status and the start of the body;
- `complete_many` sends a batch concurrently, at most `max_workers` at a time;
- with `cache_dir`, each reply is stored under the sha256 of the request (URL, model, messages, parameters), so an
  interrupted evaluation resumes without paying for what it already has.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from conversations.schema import DataError

log = logging.getLogger(__name__)
TRANSIENT = (408, 409, 429, 500, 502, 503, 504)


class ChatClient:
    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = "OPENAI_API_KEY", timeout: float = 60.0,
                 retries: int = 3, max_workers: int = 8, cache_dir: str | os.PathLike | None = None,
                 backoff_s: float = 1.0):
        if not str(base_url).startswith(("http://", "https://")):
            raise DataError(f"base URL must start with http:// or https://, got {base_url!r}")
        if max_workers < 1 or retries < 0 or timeout <= 0:
            raise DataError(f"need max_workers >= 1, retries >= 0, timeout > 0; got {max_workers}, {retries}, {timeout}")
        self.base_url = str(base_url).rstrip("/")
        self.model = model
        self.api_key_env = api_key_env
        self.timeout, self.retries, self.max_workers, self.backoff_s = timeout, retries, max_workers, backoff_s
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.requests_sent = 0  # requests that reached the network (cache hits do not count)
        self._warned_no_key = False

    def __repr__(self) -> str:  # never the key, only where it comes from
        return f"ChatClient(base_url={self.base_url!r}, model={self.model!r}, api_key_env={self.api_key_env!r})"

    @property
    def url(self) -> str:
        return f"{self.base_url}/chat/completions"

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        elif self.api_key_env and not self._warned_no_key:
            self._warned_no_key = True
            log.warning("%s is not set: calling %s without an API key", self.api_key_env, self.base_url)
        return headers

    def _cache_path(self, payload: dict) -> Path | None:
        if self.cache_dir is None:
            return None
        h = hashlib.sha256(json.dumps({"url": self.url, **payload}, sort_keys=True).encode()).hexdigest()
        return self.cache_dir / h[:2] / f"{h}.json"

    def complete(self, messages: Sequence[dict[str, Any]], **params) -> str:
        """The reply's `choices[0].message.content` ("" when null). `params` go into the request body as they are
        (temperature, max_tokens, ...)."""
        payload = {"model": self.model, "messages": list(messages), **{k: v for k, v in params.items() if v is not None}}
        cached = self._cache_path(payload)
        if cached is not None and cached.exists():
            return json.loads(cached.read_text())["content"]
        content = self._post(payload)
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"content": content}))
            os.replace(tmp, cached)
        return content

    def complete_many(self, batch: Sequence[Sequence[dict[str, Any]]], **params) -> list[str]:
        if not batch:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, len(batch)))) as pool:
            return list(pool.map(lambda m: self.complete(m, **params), batch))

    def _post(self, payload: dict) -> str:
        body = json.dumps(payload).encode()
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.url, data=body, headers=self._headers(), method="POST")
            self.requests_sent += 1
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    data = json.loads(resp.read().decode())
                return data["choices"][0]["message"]["content"] or ""
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace")  # drained: the connection can be reused
                if e.code in TRANSIENT and attempt < self.retries:
                    time.sleep(self.backoff_s * 2**attempt)
                    continue
                raise DataError(f"HTTP {e.code} from the endpoint: {detail}", self.url) from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt < self.retries:
                    time.sleep(self.backoff_s * 2**attempt)
                    continue
                reason = getattr(e, "reason", None) or type(e).__name__
                raise DataError(f"cannot reach the endpoint ({reason})", self.url) from None
            except (KeyError, IndexError, TypeError, json.JSONDecodeError):
                raise DataError("the endpoint's reply is not a chat completion", self.url) from None
        raise AssertionError("unreachable")

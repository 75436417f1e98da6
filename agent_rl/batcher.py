"""The simulator server's batcher: concurrent requests answered with one simulator call per sampling setting, a request
whose client has gone dropped at the next token."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from generator.engine import SamplingSettings

from agent_rl.gyms import UserRequest
from agent_rl.users import LMUser


@dataclass
class Job:
    """One request on its way through the batcher."""

    request: UserRequest
    settings: SamplingSettings
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    gone: threading.Event = field(default_factory=threading.Event)  # the client disconnected


class Batcher:
    """Collects concurrent requests for up to `wait_s` (or `max_batch` of them) and answers them with one simulator
    call per distinct sampling setting. A job whose client has gone is skipped, or dropped from its batch at the next
    token (`Engine.complete(cancelled=...)`)."""

    def __init__(self, simulator, max_batch: int = 16, wait_s: float = 0.01):
        self.simulator, self.max_batch, self.wait_s = simulator, max_batch, wait_s
        self.q: queue.Queue = queue.Queue()
        self.batches = 0
        self.cancelled = 0
        self._thread = threading.Thread(target=self._loop, name="simulator-batcher", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        self.q.put(job)
        return job

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
            live = []
            for job in batch:
                if job.gone.is_set():
                    self.cancelled += 1
                    job.future.cancel()
                else:
                    live.append(job)
            groups: dict[Any, list[Job]] = {}
            for job in live:
                groups.setdefault(job.settings, []).append(job)
            for settings, jobs in groups.items():
                try:
                    if isinstance(self.simulator, LMUser):
                        turns = self.simulator.turns([j.request for j in jobs], settings,
                                                     cancelled=[j.gone.is_set for j in jobs])
                    else:  # an endpoint simulator: no token-level control
                        turns = [Turn(t) for t in self.simulator.reply([j.request for j in jobs], settings=settings)]
                    for job, turn in zip(jobs, turns):
                        if job.gone.is_set():
                            self.cancelled += 1
                        if not job.future.done():
                            job.future.set_result(turn)
                except Exception as e:  # noqa: BLE001 - handed to every waiting request
                    for job in jobs:
                        if not job.future.done():
                            job.future.set_exception(e)
            self.batches += 1


@dataclass
class Turn:
    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    truncated: bool = False
    ended: bool = False

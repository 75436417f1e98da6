"""What the simulator server reads from an OpenAI chat request: the messages, the sampling values under the server's
policy, and the simulator's request in either orientation (agent_rl/serve.py's docstring has the rules). A request
the server cannot answer raises `BadRequest` with the status and the message the client gets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from generator.engine import SamplingSettings

from agent_rl.gyms import UserRequest

ROLES = ("system", "user", "assistant", "developer")


class BadRequest(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _text(content: Any) -> str:
    """OpenAI message content: a string or a list of parts (text parts kept)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    if content is None:
        return ""
    raise BadRequest(400, "message content must be a string or a list of text parts")


def read_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest(400, "'messages' must be a non-empty list of {role, content}")
    out = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(400, "each message needs a role of system, user or assistant")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": _text(m.get("content"))})
    return out


@dataclass(frozen=True)
class Policy:
    """How the server treats a request's sampling values."""

    budget: SamplingSettings  # the simulator's own settings: defaults and the token budget
    min_temperature: float = 0.3
    temperature_policy: str = "override"  # override | refuse


def sampling_for(body: dict[str, Any], policy: Policy) -> tuple[SamplingSettings, list[str]]:
    """The request's sampling settings under the policy, and notes on what was changed."""
    notes = []
    n = body.get("n", 1)
    if n not in (None, 1):
        raise BadRequest(400, "n must be 1: the simulator writes one user turn per request")
    if body.get("stream"):
        raise BadRequest(400, "stream=true is not supported; send stream=false (the default)")
    s = policy.budget
    changes: dict[str, Any] = {}
    for key, name, cast in (("max_tokens", "max_new_tokens", int), ("max_completion_tokens", "max_new_tokens", int),
                            ("temperature", "temperature", float), ("top_p", "top_p", float)):
        if body.get(key) is None:
            continue
        try:
            changes[name] = cast(body[key])
        except (TypeError, ValueError):
            raise BadRequest(400, f"'{key}' must be a number") from None
    if "max_new_tokens" in changes:
        if changes["max_new_tokens"] < 1:
            raise BadRequest(400, "max_tokens must be >= 1")
        if changes["max_new_tokens"] > s.max_new_tokens:
            notes.append(f"max_tokens {changes['max_new_tokens']} clamped to the simulator's turn budget {s.max_new_tokens}")
            changes["max_new_tokens"] = s.max_new_tokens
    if "temperature" in changes:
        t = changes["temperature"]
        if t < 0:
            raise BadRequest(400, "temperature must be >= 0")
        if t < policy.min_temperature:
            if policy.temperature_policy == "refuse":
                raise BadRequest(400, f"temperature {t} is below {policy.min_temperature}: this simulator was trained "
                                      f"and measured at {s.temperature} (low temperatures make it write like an "
                                      "assistant); send a higher temperature or omit it")
            notes.append(f"temperature {t} replaced by the simulator's {s.temperature} (below {policy.min_temperature}, "
                         "it writes like an assistant)")
            changes["temperature"] = s.temperature
    if "top_p" in changes and not 0 < changes["top_p"] <= 1:
        raise BadRequest(400, "top_p must be in (0, 1]")
    return s.replace(**changes), notes


def to_request(messages: list[dict[str, str]], body: dict[str, Any]) -> UserRequest:
    """The simulator's request from a chat in either orientation (see the module docstring)."""
    goal = body.get("goal")
    system = [m["content"] for m in messages if m["role"] == "system" and m["content"].strip()]
    convo = [m for m in messages if m["role"] != "system"]
    if goal is None:  # no explicit goal: the system messages describe the user to simulate
        goal = "\n\n".join(system) or None
        extra_system = []
    else:
        extra_system = [{"role": "system", "content": s} for s in system]
    if not convo:
        raise BadRequest(400, "the conversation needs at least one user or assistant message (the agent's)")
    if convo[-1]["role"] == "user":  # standard orientation: the agent speaks as `user`; flip to the agent's view
        convo = [{"role": "assistant" if m["role"] == "user" else "user", "content": m["content"]} for m in convo]
    return UserRequest(context=extra_system + convo, goal=goal, gym="", task=None, persona=body.get("persona"))

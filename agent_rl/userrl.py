"""Requests in UserRL's user-simulation shape, recognised and turned into simulator requests.

UserRL's gyms reach their user model through the `openai` client: one chat request of `[system, user]`, where the
`user` message is a whole role-play prompt. A user-simulation request holds the hidden task (labelled sections such
as `ORIGINAL TASK REQUEST: ...` or a markdown heading `### Target Entity ...` followed by its text), the helper's
(the agent's) latest question in a section whose label names a question, optionally the earlier exchange as
`Helper: ... / You: ...` (or `Q1: ... / A1: ...`) lines, and asks for a JSON object with a `response` field, of which
the gym reads only `response`. The gyms' other requests to the same base URL are judge calls (question coverage,
checking a final guess) that ask for other fields (`judgment`, `covered_detail_indices`, ...): those are not ours to
answer and go to an upstream model (`agent_rl.serve --judge-upstream`).

Recognised here by structure, not by any gym's exact wording: a requested JSON field `response` and a labelled
question section. `parse_roleplay(messages)` returns None for anything else.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

# a section label: `LABEL:` in capitals at the start of a line (the value may follow on the same line), or a
# markdown heading (`## ...`, `### ...`), the text following until the next label
_LABEL = re.compile(r"^(?:(?P<caps>[A-Z][A-Z0-9 '()/_-]{2,60}):[ \t]*(?P<rest>.*)$|(?P<hash>#{2,4})[ \t]+(?P<head>.+?)\s*$)",
                    re.MULTILINE)
_JSON_FIELD = re.compile(r'"(?P<key>[A-Za-z_][A-Za-z0-9_]*)"\s*:')
_GOAL_WORDS = ("task", "request", "goal", "category", "entity", "target", "prefer", "persona", "profile", "scenario",
               "story", "stance", "situation", "background", "need", "information")
_SKIP_WORDS = ("response", "format", "note", "instruction", "example", "guideline", "rule", "important", "output")
# exchange lines: the agent's side, the user's side
_AGENT = re.compile(r"^\s*(?:Helper|Agent|Assistant|AI|Q\d*)\s*:\s*(?P<t>.*)$", re.IGNORECASE)
_USER = re.compile(r"^\s*(?:You|Me|User|A\d*)\s*:\s*(?P<t>.*)$", re.IGNORECASE)
GOAL_CHARS = 800  # the goal goes into the simulator's system prompt: the hidden task, not the whole role-play text


@dataclass
class RolePlay:
    goal: str  # the hidden task in words
    question: str  # the agent's latest message, which the user answers
    history: list[dict] = field(default_factory=list)  # earlier exchange, real orientation (agent = assistant)
    fields: list[str] = field(default_factory=list)  # the JSON fields the reply must carry

    def context(self) -> list[dict]:
        """The conversation as the simulator sees it (real orientation): history, then the agent's question."""
        return [*self.history, {"role": "assistant", "content": self.question}]

    def reply(self, text: str) -> str:
        """The JSON the gym parses: `response` holds the simulator's turn; other requested text fields are empty
        (strings only: the gyms parse with json.loads or ast.literal_eval, and both read this)."""
        return json.dumps({k: (text if k == "response" else "") for k in (self.fields or ["response"])},
                          ensure_ascii=False)


def _sections(text: str) -> list[tuple[str, str]]:
    """(label, body) for every labelled section of `text`, in order; text before the first label is ('', ...)."""
    out, last_label, last_end, first_rest = [], "", 0, ""
    for m in _LABEL.finditer(text):
        body = (first_rest + "\n" + text[last_end:m.start()]).strip()
        out.append((last_label, body))
        last_label = (m.group("caps") or m.group("head") or "").strip().strip("*").strip()
        first_rest = m.group("rest") or ""
        last_end = m.end()
    out.append((last_label, (first_rest + "\n" + text[last_end:]).strip()))
    return [(lab, body) for lab, body in out if lab or body]


def _exchange(body: str) -> list[dict]:
    """Helper:/You: (or Q1:/A1:) lines as messages; an unprefixed line continues the previous message, until a blank
    line: the prompt's own text after the exchange is not part of it."""
    msgs: list[dict] = []
    blank = False
    for line in body.splitlines():
        a, u = _AGENT.match(line), _USER.match(line)
        if a and a.group("t").strip():
            msgs.append({"role": "assistant", "content": a.group("t").strip()})
        elif u and u.group("t").strip():
            msgs.append({"role": "user", "content": u.group("t").strip()})
        elif not line.strip():
            blank = True
            continue
        elif msgs and not blank:  # a continuation line of the previous message
            msgs[-1]["content"] += "\n" + line.strip()
        elif msgs:
            break
        blank = False
    return msgs


def requested_fields(text: str) -> list[str]:
    """The JSON fields the prompt's example reply names, in order."""
    seen: list[str] = []
    for m in _JSON_FIELD.finditer(text):
        if m.group("key") not in seen:
            seen.append(m.group("key"))
    return seen


def parse_roleplay(messages: list[dict]) -> RolePlay | None:
    """A UserRL user-simulation request as a `RolePlay`, or None when the request is not one (see the module
    docstring). `messages`: the request's messages, roles and text contents."""
    text = "\n\n".join(m["content"] for m in messages if m.get("role") in ("system", "user", "developer"))
    fields = requested_fields(text)
    if "response" not in fields:
        return None
    goal_parts, question, history = [], None, []
    for label, body in _sections(text):
        low = label.lower()
        if not body:
            continue
        if "question" in low:
            question = body.split("\n\n")[0].strip()
        elif "history" in low or "conversation" in low or "previous" in low:
            history = _exchange(body)
        elif any(w in low for w in _GOAL_WORDS) and not any(w in low for w in _SKIP_WORDS):
            goal_parts.append(f"{label.title()}: {body}" if label else body)
    if not question:
        return None
    if history and history[-1]["role"] == "assistant" and history[-1]["content"] == question:
        history = history[:-1]
    # the simulator's context alternates and its history opens with the agent
    while history and history[0]["role"] == "user":
        history = history[1:]
    goal = "\n".join(goal_parts).strip() or text.strip()
    return RolePlay(goal=goal[:GOAL_CHARS], question=question, history=history, fields=fields)

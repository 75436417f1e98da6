"""travel: the user has hidden preferences over hotel options that the environment lists; the agent elicits them and
chooses one with [answer].

Rewards, by code:
- elicited preference: +0.2 the first time a user reply contains that preference's key phrase ("beach", "breakfast",
  "150", ...), on the turn of that reply;
- the choice (the `[answer]` must name exactly one option, by its name or as "option B"): the best option (meets all
  three preferences) 1.0; an acceptable one (meets the two most important) 0.8; any other 0.
Maximum: 3 x 0.2 + 1.0 = 1.6. Tasks are generated so that exactly one option is best and at least one is acceptable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from agent_rl.gyms.base import ORACLE, Gym
from agent_rl.protocol import action, answer, mentions, mentions_any, normalize

ELICIT = 0.2
BEST, ACCEPTABLE = 1.0, 0.8
N_OPTIONS = 5
N_TASKS = 40
AREAS = ("beach", "old town", "airport", "downtown")
NAMES = ("Harbor Inn", "Grand Plaza", "Sunset Lodge", "Old Mill Hotel", "City Nest", "Palm Court", "Blue Door B&B",
         "Station Hotel", "Maple House", "Lighthouse Suites")
LETTERS = "ABCDE"


@dataclass(frozen=True)
class PrefKind:
    name: str
    question: str
    ask: tuple[str, ...]
    # (arg) -> (statement, key phrase, predicate over an option)
    make: Callable[[object], tuple[str, str, Callable[[dict], bool]]]
    args: tuple


def _area(a):
    where = {"beach": "near the beach", "old town": "in the old town", "airport": "near the airport",
             "downtown": "downtown"}[a]
    return f"I want to stay {where}.", a, lambda o: o["area"] == a


def _price(p):
    return f"I don't want to pay more than ${p} a night.", str(p), lambda o: o["price"] <= p


PREF_KINDS = (
    PrefKind("area", "Which area would you like to stay in?", ("area", "where", "location", "neighborhood",
                                                               "neighbourhood", "part of town"), _area, AREAS),
    PrefKind("price", "What is your budget per night?", ("budget", "price", "cost", "spend", "afford", "per night",
                                                         "how much"), _price, (90, 120, 150)),
    PrefKind("breakfast", "Do you need breakfast included?", ("breakfast", "meal", "meals"),
             lambda _: ("Breakfast has to be included.", "breakfast", lambda o: o["breakfast"]), (None,)),
    PrefKind("pets", "Are you traveling with any pets?", ("pet", "pets", "dog", "animal", "animals"),
             lambda _: ("I'm bringing my dog, so pets must be allowed.", "dog", lambda o: o["pets"]), (None,)),
    PrefKind("rating", "What minimum star rating do you want?", ("rating", "stars", "star", "quality", "reviews"),
             lambda _: ("It should have at least 4 stars.", "4 stars", lambda o: o["stars"] >= 4), (None,)),
    PrefKind("pool", "Do you want a pool?", ("pool", "swim", "swimming"),
             lambda _: ("I'd really like a pool.", "pool", lambda o: o["pool"]), (None,)),
)
_KIND = {k.name: k for k in PREF_KINDS}


def _pref(p: dict):
    """A hidden preference {kind, arg} as (kind, statement, key, predicate)."""
    kind = _KIND[p["kind"]]
    statement, key, pred = kind.make(p["arg"])
    return kind, statement, key, pred


def describe_option(letter: str, o: dict) -> str:
    return (
        f"{letter}) {o['name']}: {o['area']}, ${o['price']}/night, {o['stars']} stars, "
        f"{'breakfast included' if o['breakfast'] else 'no breakfast'}, "
        f"{'pets allowed' if o['pets'] else 'no pets'}, {'pool' if o['pool'] else 'no pool'}"
    )


class TravelGym(Gym):
    name = "travel"
    max_turns = 6
    instructions = (
        "Task: the user must pick a hotel from the listed options but has preferences they have not told you. Ask "
        "about their preferences, one at a time, then choose with [answer] <hotel name>."
    )

    def build_tasks(self, rng):
        out = []
        while len(out) < N_TASKS:
            kinds = rng.sample(PREF_KINDS, 3)  # most important first
            prefs = [{"kind": k.name, "arg": rng.choice(k.args)} for k in kinds]
            preds = [_pref(p)[3] for p in prefs]
            names = rng.sample(NAMES, N_OPTIONS)
            options = [
                {"name": n, "area": rng.choice(AREAS), "price": rng.randrange(60, 260, 10), "stars": rng.randint(2, 5),
                 "breakfast": rng.random() < 0.5, "pets": rng.random() < 0.4, "pool": rng.random() < 0.4}
                for n in names
            ]
            best = [i for i, o in enumerate(options) if all(p(o) for p in preds)]
            acceptable = [i for i, o in enumerate(options) if preds[0](o) and preds[1](o) and not preds[2](o)]
            if len(best) != 1 or not acceptable or len(best) + len(acceptable) == N_OPTIONS:
                continue  # rejection sampling: one best, some acceptable, some wrong
            listing = "\n".join(describe_option(LETTERS[i], o) for i, o in enumerate(options))
            opening = f"I need to book a hotel. These are the options I found:\n{listing}\nWhich one should I take?"
            out.append((opening, {"options": options, "prefs": prefs, "best": best[0], "acceptable": acceptable}))
        return out

    # ---- helpers ----------------------------------------------------------------------------------------------------
    def asked_prefs(self, task, question):
        return [i for i, p in enumerate(task.hidden["prefs"]) if mentions_any(question, _KIND[p["kind"]].ask)]

    def revealed_prefs(self, task, reply):
        return [i for i, p in enumerate(task.hidden["prefs"]) if mentions(reply, _pref(p)[2])]

    @staticmethod
    def chosen_option(task, text: str) -> int | None:
        """The option an answer names (by name, or 'option X' / 'hotel X'), if it names exactly one."""
        t = normalize(text)
        named = {i for i, o in enumerate(task.hidden["options"]) if mentions(t, o["name"])}
        for m in re.finditer(r"\b(?:option|hotel|choice)\s+([a-e])\b", t):
            named.add(LETTERS.lower().index(m.group(1)))
        return named.pop() if len(named) == 1 else None

    # ---- user side --------------------------------------------------------------------------------------------------
    def user_goal(self, task):
        lines = [f"{n}. {_pref(p)[1]}" for n, p in enumerate(task.hidden["prefs"], 1)]
        return (
            "You are choosing a hotel from the options you listed. Your preferences, most important first:\n"
            + "\n".join(lines)
            + "\nTell the assistant a preference only when it asks about it. Answer briefly."
        )

    def scripted_user(self, task, context, mode):
        asked = self.asked_prefs(task, context[-1]["content"])
        if mode == ORACLE:
            if not asked:
                return "I don't have a strong opinion on that. Ask me about what matters to me."
            return " ".join(_pref(task.hidden["prefs"][i])[1] for i in asked)
        if len(asked) != 1:
            return "Don't know."
        return _pref(task.hidden["prefs"][asked[0]])[2].capitalize() + "."

    # ---- rewards ----------------------------------------------------------------------------------------------------
    def new_state(self, task):
        return {"elicited": []}

    def score_reply(self, task, state, question, reply):
        new = [i for i in self.revealed_prefs(task, reply) if i not in state["elicited"]]
        state["elicited"] += new
        return ELICIT * len(new), False, {"elicited": new}

    def score_answer(self, task, state, answer_text):
        choice = self.chosen_option(task, answer_text)
        if choice is None:
            return 0.0, {"choice": None}
        reward = BEST if choice == task.hidden["best"] else ACCEPTABLE if choice in task.hidden["acceptable"] else 0.0
        return reward, {"choice": choice}

    def max_return(self, task):
        return ELICIT * len(task.hidden["prefs"]) + BEST

    # ---- reference agents -------------------------------------------------------------------------------------------
    def oracle_turn(self, task, turn):
        prefs = task.hidden["prefs"]
        if turn < len(prefs):
            return action(_KIND[prefs[turn]["kind"]].question)
        return answer(f"I recommend {task.hidden['options'][task.hidden['best']]['name']}.")

    def random_turn(self, task, rng, turn):
        if turn >= 1 and rng.random() < 0.4 or turn >= self.max_turns - 1:
            return answer(f"Take {rng.choice(task.hidden['options'])['name']}.")
        return action(rng.choice(("Which one do you like?", "Any thoughts?", "Shall I pick one for you?")))

"""intention: a vague request with hidden missing details of importance 3 / 2 / 1.

Detection, by code:
- a detail is *uncovered* when a user reply contains its value's key phrase (whole-word match, e.g. "lisbon", "1500");
  each detail is credited once, on the turn whose reply first reveals it: importance 3 / 2 / 1 -> 1.0 / 0.7 / 0.4;
- a question *asks about* a detail when it contains one of that slot's ask keywords ("budget", "how long", ...);
  a question that asks about n > 1 of the task's hidden details costs 0.2 x (n - 1) (UserRL's multi-question penalty).
- `[answer]` (the agent's summary of the request) ends the episode and scores 0.
Each turn's reward = the credits of the details its reply uncovers - the penalty of its question. Maximum: 2.1.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from agent_rl.gyms.base import ORACLE, Gym, Task
from agent_rl.protocol import action, answer, mentions, mentions_any

CREDIT = {3: 1.0, 2: 0.7, 1: 0.4}
MULTI_PENALTY = 0.2
DETAILS_PER_TASK = 3
TASKS_PER_SCENARIO = 6


@dataclass(frozen=True)
class Slot:
    name: str
    question: str  # how the oracle agent asks about it (targets this slot only)
    ask: tuple[str, ...]  # keywords that make a question about this slot
    statement: str  # how the oracle user states it: "{v}" is the value phrase
    values: tuple[tuple[str, str], ...]  # (phrase, key): the key is what a reply must contain to reveal the detail


@dataclass(frozen=True)
class Scenario:
    name: str
    request: str
    slots: tuple[Slot, ...]


_BUDGET_ASK = ("budget", "spend", "cost", "afford", "price", "how much money")

SCENARIOS = (
    Scenario("trip", "Can you help me plan a trip?", (
        Slot("destination", "Where would you like to go?", ("where", "destination", "which city", "which country"),
             "I want to go to {v}.", (("Lisbon", "lisbon"), ("Kyoto", "kyoto"), ("Vancouver", "vancouver"))),
        Slot("timing", "When are you planning to travel?", ("when", "what dates", "which month", "time of year"),
             "I'm thinking {v}.", (("in April", "april"), ("over Christmas", "christmas"),
                                   ("in mid September", "september"))),
        Slot("budget", "What is your budget?", _BUDGET_ASK, "My budget is {v}.",
             (("about $1500", "1500"), ("under $800", "800"), ("around $3000", "3000"))),
        Slot("companions", "Who will be traveling with you?", ("who", "travel with", "traveling with", "companions"),
             "I'll be traveling {v}.", (("with my two kids", "kids"), ("alone", "alone"),
                                        ("with my partner", "partner"))),
        Slot("duration", "How long should the trip be?", ("how long", "how many days", "how many nights", "duration"),
             "I want it to last {v}.", (("five days", "five days"), ("two weeks", "two weeks"),
                                        ("a long weekend", "long weekend"))),
    )),
    Scenario("gift", "I need to buy a gift. Any ideas?", (
        Slot("recipient", "Who is the gift for?", ("who", "for whom", "recipient"), "It's for {v}.",
             (("my grandmother", "grandmother"), ("my boss", "boss"), ("my ten-year-old nephew", "nephew"))),
        Slot("occasion", "What's the occasion?", ("occasion", "celebrate", "celebrating", "celebration", "event"),
             "It's for {v}.", (("her retirement", "retirement"), ("a birthday", "birthday"),
                               ("a housewarming", "housewarming"))),
        Slot("budget", "How much do you want to spend?", _BUDGET_ASK + ("how much",), "I can spend {v}.",
             (("up to $50", "50"), ("around $200", "200"), ("no more than $25", "25"))),
        Slot("interests", "What are they interested in?", ("interest", "interests", "interested", "hobby", "hobbies",
                                                             "enjoy"),
             "They love {v}.", (("gardening", "gardening"), ("jazz music", "jazz"), ("board games", "board games"))),
        Slot("deadline", "When do you need it by?", ("when", "deadline", "need it by", "deliver", "delivery"),
             "I need it {v}.", (("by Friday", "friday"), ("within two days", "two days"),
                                ("before the end of the month", "end of the month"))),
    )),
    Scenario("resume", "Can you help me improve my resume?", (
        Slot("role", "What job are you applying for?", ("job", "role", "position", "applying"),
             "I'm applying for {v}.", (("a data analyst position", "data analyst"), ("a nursing job", "nursing"),
                                       ("a junior web developer role", "web developer"))),
        Slot("experience", "How many years of experience do you have?", ("experience", "years", "worked"),
             "I have {v}.", (("three years of experience", "three years"),
                             ("no professional experience yet", "no professional experience"),
                             ("about ten years in retail", "ten years"))),
        Slot("length", "How many pages can it be?", ("pages", "page limit", "length"), "It has to fit on {v}.",
             (("one page", "one page"), ("two pages", "two pages"))),
        Slot("format", "What file format do you need?", ("format", "file type", "pdf", "word document"),
             "I need it as {v}.", (("a PDF", "pdf"), ("a Word document", "word document"),
                                   ("plain text", "plain text"))),
        Slot("deadline", "When is the application due?", ("when", "due", "deadline"), "The application is due {v}.",
             (("tomorrow", "tomorrow"), ("next Monday", "monday"), ("in two weeks", "two weeks"))),
    )),
    Scenario("dinner", "I want to cook dinner tonight. What should I make?", (
        Slot("guests", "How many people are you cooking for?", ("how many people", "how many guests", "cooking for",
                                                                 "guests"),
             "I'm cooking for {v}.", (("six people", "six people"), ("just myself", "myself"),
                                      ("two people", "two people"))),
        Slot("diet", "Do you have any dietary restrictions?", ("dietary", "diet", "allergy", "allergies",
                                                                "restrictions", "vegetarian", "vegan"),
             "It has to be {v}.", (("vegetarian", "vegetarian"), ("gluten-free", "gluten"),
                                   ("nut-free because of an allergy", "nut"))),
        Slot("time", "How much time do you have to cook?", ("how much time", "how long", "minutes", "quick"),
             "I have {v}.", (("30 minutes", "30 minutes"), ("about an hour", "an hour"),
                             ("the whole afternoon", "afternoon"))),
        Slot("cuisine", "What kind of cuisine do you like?", ("cuisine", "kind of food", "type of food", "flavors"),
             "I'd like {v}.", (("something Thai", "thai"), ("Italian food", "italian"),
                               ("Mexican dishes", "mexican"))),
        Slot("equipment", "What cooking equipment do you have?", ("equipment", "oven", "appliance", "appliances",
                                                                   "stove"),
             "I only have {v}.", (("a stovetop and no oven", "stovetop"), ("a slow cooker", "slow cooker"),
                                  ("a microwave", "microwave"))),
    )),
    Scenario("workout", "I want to start working out. Can you make me a plan?", (
        Slot("goal", "What is your main goal?", ("goal", "aim", "achieve"), "My goal is {v}.",
             (("to run a 10k", "10k"), ("to lose about 10 kilos", "kilos"),
              ("to build upper body strength", "upper body"))),
        Slot("schedule", "How many days a week can you train?", ("days a week", "how often", "times a week",
                                                                  "schedule"),
             "I can train {v}.", (("three days a week", "three days"), ("every morning", "every morning"),
                                  ("only on weekends", "weekends"))),
        Slot("equipment", "What equipment do you have access to?", ("equipment", "gym", "weights", "access to"),
             "I have {v}.", (("no equipment at home", "no equipment"), ("a full gym membership", "membership"),
                             ("a pair of dumbbells", "dumbbells"))),
        Slot("injury", "Do you have any injuries or health issues?", ("injury", "injuries", "health", "pain",
                                                                       "medical"),
             "I have {v}.", (("a bad knee", "knee"), ("lower back pain", "back pain"), ("mild asthma", "asthma"))),
        Slot("level", "What is your current fitness level?", ("fitness level", "current level", "beginner",
                                                               "how fit"),
             "I'm {v}.", (("a complete beginner", "complete beginner"), ("fairly active already", "fairly active"),
                          ("returning after a long break", "long break"))),
    )),
    Scenario("laptop", "I need a new laptop. Which one should I get?", (
        Slot("use", "What will you mainly use it for?", ("use it for", "used for", "mainly use", "purpose"),
             "I'll mainly use it for {v}.", (("video editing", "video editing"), ("programming", "programming"),
                                             ("browsing and email", "email"))),
        Slot("budget", "What's your budget?", _BUDGET_ASK + ("how much",), "My budget is {v}.",
             (("under $700", "700"), ("around $1200", "1200"), ("up to $2000", "2000"))),
        Slot("os", "Which operating system do you prefer?", ("operating system", "windows", "mac", "linux"),
             "I prefer {v}.", (("macOS", "macos"), ("Windows", "windows"), ("Linux", "linux"))),
        Slot("size", "What screen size do you want?", ("screen", "size", "inch", "display"), "I want {v}.",
             (("a 13-inch screen", "13"), ("a 15-inch screen", "15"), ("the biggest screen possible", "biggest"))),
        Slot("battery", "How important is battery life?", ("battery", "charge", "unplugged"), "I need {v}.",
             (("all-day battery life", "all-day"), ("at least 10 hours of battery", "10 hours"),
              ("nothing special for battery", "nothing special"))),
    )),
    Scenario("party", "Help me organise a party.", (
        Slot("guests", "How many guests are you expecting?", ("how many", "guests", "people"), "I'm expecting {v}.",
             (("about 20 guests", "20"), ("around 50 people", "50"), ("a dozen friends", "dozen"))),
        Slot("kind", "What kind of party is it?", ("kind of party", "type of party", "occasion"), "It's {v}.",
             (("a surprise birthday", "surprise"), ("a graduation party", "graduation"),
              ("an engagement party", "engagement"))),
        Slot("venue", "Where will the party be?", ("where", "venue", "location", "place"), "It will be {v}.",
             (("in my backyard", "backyard"), ("at a rented hall", "rented hall"),
              ("in a small apartment", "apartment"))),
        Slot("date", "When is the party?", ("when", "date", "what day"), "It's {v}.",
             (("on Saturday the 14th", "14th"), ("next Friday evening", "friday"), ("in three weeks", "three weeks"))),
        Slot("food", "What food would you like to serve?", ("food", "catering", "menu", "serve"), "I want {v}.",
             (("a barbecue", "barbecue"), ("finger food only", "finger food"), ("a sit-down dinner", "sit-down"))),
    )),
    Scenario("language", "I want to learn a new language. Where do I start?", (
        Slot("language", "Which language do you want to learn?", ("which language", "what language"),
             "I want to learn {v}.", (("Japanese", "japanese"), ("Spanish", "spanish"), ("German", "german"))),
        Slot("reason", "Why do you want to learn it?", ("why", "reason", "motivation"), "It's because {v}.",
             (("I'm moving abroad next year", "moving abroad"), ("I want to watch films without subtitles",
                                                                 "subtitles"),
              ("my partner's family speaks it", "family"))),
        Slot("time", "How much time can you study each day?", ("how much time", "each day", "per day", "hours"),
             "I can study {v}.", (("20 minutes a day", "20 minutes"), ("about two hours a day", "two hours"),
                                  ("only on weekends", "weekends"))),
        Slot("level", "Do you already know any of it?", ("already know", "level", "beginner", "any of it"),
             "I {v}.", (("know a few basic phrases", "basic phrases"), ("am a total beginner", "total beginner"),
                        ("studied it in school years ago", "in school"))),
        Slot("style", "How do you like to learn?", ("like to learn", "learning style", "apps", "classes",
                                                    "prefer to learn"),
             "I prefer {v}.", (("apps on my phone", "apps"), ("a class with a teacher", "teacher"),
                               ("books and podcasts", "podcasts"))),
    )),
)

_GENERIC_QUESTIONS = (
    "Can you tell me more?",
    "Anything else I should know?",
    "Sounds good. Shall I go ahead?",
    "Is there anything specific on your mind?",
    "Could you elaborate a bit?",
)


def _scenario(name: str) -> Scenario:
    return next(s for s in SCENARIOS if s.name == name)


class IntentionGym(Gym):
    name = "intention"
    max_turns = 6
    instructions = (
        "Task: the user's request is vague. Find out the important details they have in mind by asking clear "
        "questions, one detail per question. When you know enough, restate the full request with [answer]."
    )

    def build_tasks(self, rng):
        out = []
        for sc in SCENARIOS:
            for _ in range(TASKS_PER_SCENARIO):
                slots = rng.sample(range(len(sc.slots)), DETAILS_PER_TASK)
                importances = [3, 2, 1]
                rng.shuffle(importances)
                details = [
                    {"slot": sc.slots[i].name, "importance": imp, "value": rng.randrange(len(sc.slots[i].values))}
                    for i, imp in zip(slots, importances)
                ]
                details.sort(key=lambda d: -d["importance"])
                out.append((sc.request, {"scenario": sc.name, "details": details}))
        return out

    # ---- helpers ----------------------------------------------------------------------------------------------------
    @staticmethod
    def _details(task: Task):
        sc = _scenario(task.hidden["scenario"])
        slots = {s.name: s for s in sc.slots}
        return [(d, slots[d["slot"]], slots[d["slot"]].values[d["value"]]) for d in task.hidden["details"]]

    def asked_details(self, task: Task, question: str) -> list[str]:
        """The hidden details (slot names) a question asks about."""
        return [d["slot"] for d, slot, _ in self._details(task) if mentions_any(question, slot.ask)]

    def revealed_details(self, task: Task, reply: str) -> list[str]:
        return [d["slot"] for d, _, (_, key) in self._details(task) if mentions(reply, key)]

    # ---- user side --------------------------------------------------------------------------------------------------
    def user_goal(self, task):
        lines = [f"- {slot.name}: {phrase}" for _, slot, (phrase, _) in self._details(task)]
        return (
            f'You asked an assistant: "{task.opening}" You did not say it, but you have these details in mind:\n'
            + "\n".join(lines)
            + "\nReveal a detail only when the assistant asks about it. Answer briefly and naturally."
        )

    def scripted_user(self, task, context, mode):
        question = context[-1]["content"]
        asked = self.asked_details(task, question)
        found = {d["slot"]: (slot, phrase, key) for d, slot, (phrase, key) in self._details(task)}
        if mode == ORACLE:
            if not asked:
                return "I'm not sure what you mean. Could you ask me about something specific?"
            return " ".join(found[s][0].statement.format(v=found[s][1]) for s in asked)
        if len(asked) != 1:  # terse: answers a precise question with the bare fact, nothing else
            return "Not sure."
        return found[asked[0]][2].capitalize() + "."

    # ---- rewards ----------------------------------------------------------------------------------------------------
    def new_state(self, task):
        return {"uncovered": []}

    def score_reply(self, task, state, question, reply):
        asked = self.asked_details(task, question)
        penalty = MULTI_PENALTY * max(0, len(asked) - 1)
        imp = {d["slot"]: d["importance"] for d in task.hidden["details"]}
        new = [s for s in self.revealed_details(task, reply) if s not in state["uncovered"]]
        state["uncovered"] += new
        reward = sum(CREDIT[imp[s]] for s in new) - penalty
        return reward, False, {"asked": asked, "uncovered": new, "penalty": penalty}

    def score_answer(self, task, state, answer_text):
        return 0.0, {"uncovered_total": len(state["uncovered"])}

    def max_return(self, task):
        return sum(CREDIT[d["importance"]] for d in task.hidden["details"])

    # ---- reference agents -------------------------------------------------------------------------------------------
    def oracle_turn(self, task, turn):
        details = self._details(task)  # sorted by importance, most important first
        if turn < len(details):
            return action(details[turn][1].question)
        summary = "; ".join(f"{slot.name}: {phrase}" for _, slot, (phrase, _) in details)
        return answer(f"{task.opening} Details: {summary}.")

    def random_turn(self, task, rng, turn):
        if rng.random() < 0.25:
            return answer("Here is a plan based on your request.")
        return action(rng.choice(_GENERIC_QUESTIONS))

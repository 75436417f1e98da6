"""persuade: the user holds a stance on a claim (1 = strongly disagree ... 7 = strongly agree) and reports it after
each turn; the agent argues for the claim (the target stance is 7).

Reward, by code: each user reply is asked to end with the tag `[stance: N]`; the last such tag in the reply is parsed
(fallback: "stance ... N" without brackets; if neither is there, the stance is unchanged). A turn's reward is the
movement toward the target on that turn divided by 6: (|previous - 7| - |new - 7|) / 6, so moving away is negative and
the episode's return is the total movement / 6. The episode ends when the stance reaches the target.

The scripted users are deterministic: the user has three hidden concerns; the first time an agent turn addresses one
(by its keywords) the stance moves 2 levels toward the target (capped at 7); nothing else moves it. The opening
states the initial stance with the same tag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent_rl.gyms.base import ORACLE, Gym
from agent_rl.protocol import action, answer, mentions_any

TARGET = 7
SCALE = 6.0
STEP = 2  # levels a newly addressed concern moves the scripted user
STANCE_TAG = re.compile(r"\[\s*stance\s*[:=]?\s*([1-7])\s*\]", re.IGNORECASE)
STANCE_LOOSE = re.compile(r"stance\D{0,12}([1-7])\b", re.IGNORECASE)


@dataclass(frozen=True)
class Concern:
    label: str
    keywords: tuple[str, ...]
    argument: str  # how the oracle agent addresses it (contains a keyword)


@dataclass(frozen=True)
class Claim:
    text: str
    concerns: tuple[Concern, Concern, Concern]


CLAIMS = (
    Claim("Cities should ban private cars from their downtown areas.", (
        Concern("air quality", ("air", "pollution", "emissions", "smog"),
                "Downtown air pollution would drop sharply, which matters for everyone's lungs."),
        Concern("safety", ("safety", "safer", "accidents", "pedestrians"),
                "Streets without cars are far safer: fewer accidents and injured pedestrians."),
        Concern("local shops", ("shops", "business", "businesses", "customers"),
                "Local shops usually gain customers when streets become pedestrian zones."))),
    Claim("Schools should start no earlier than 9 am.", (
        Concern("sleep", ("sleep", "tired", "rest"), "Teenagers need more sleep, and early starts cut it short."),
        Concern("grades", ("grades", "learning", "attention", "performance"),
                "Schools that start later report better attention and grades."),
        Concern("health", ("health", "mood", "mental"), "Later starts are linked to better mental health and mood."))),
    Claim("Everyone should learn to cook.", (
        Concern("money", ("money", "save", "cheaper", "budget"), "Cooking at home saves a lot of money."),
        Concern("health", ("health", "healthier", "nutrition"), "Home cooking is healthier: you control nutrition."),
        Concern("independence", ("independence", "independent", "self-reliant"),
                "Being able to cook makes you independent and self-reliant."))),
    Claim("Public libraries deserve more funding.", (
        Concern("education", ("education", "learning", "literacy"), "Libraries support education and literacy."),
        Concern("community", ("community", "meeting", "neighbors"),
                "A library is a free community space where neighbors meet."),
        Concern("access", ("internet", "computers", "access"),
                "Many people rely on library computers and internet access."))),
    Claim("Remote work is better than office work.", (
        Concern("commute", ("commute", "commuting", "traffic"), "Remote work removes the daily commute and traffic."),
        Concern("flexibility", ("flexibility", "flexible", "schedule"), "It gives people a flexible schedule."),
        Concern("productivity", ("productivity", "productive", "focus"),
                "Many studies find people are as productive or more at home, with fewer interruptions to focus."))),
    Claim("People should eat less meat.", (
        Concern("climate", ("climate", "emissions", "environment"),
                "Meat production drives a large share of climate emissions."),
        Concern("health", ("health", "heart", "healthier"), "Eating less red meat is better for heart health."),
        Concern("animal welfare", ("animals", "animal welfare", "suffering"),
                "It reduces the suffering of animals in factory farms."))),
    Claim("Voting should be mandatory.", (
        Concern("representation", ("representation", "represented", "everyone's voice"),
                "Mandatory voting means everyone is represented, not just the loudest groups."),
        Concern("legitimacy", ("legitimacy", "legitimate", "mandate"),
                "Governments elected by nearly everyone have more legitimacy."),
        Concern("extremism", ("extremism", "extreme", "polarization"),
                "High turnout dilutes extreme positions and polarization."))),
    Claim("Video games can be good for children.", (
        Concern("problem solving", ("problem solving", "puzzles", "thinking"),
                "Many games train problem solving and strategic thinking."),
        Concern("friendship", ("friends", "social", "friendship"),
                "Playing together is a social activity and builds friendships."),
        Concern("coordination", ("coordination", "reflexes", "motor skills"),
                "Games improve hand-eye coordination and reflexes."))),
    Claim("Cities should build more bike lanes.", (
        Concern("safety", ("safety", "safer", "accidents"), "Protected bike lanes make cycling much safer."),
        Concern("traffic", ("traffic", "congestion", "jams"), "More cycling means less traffic congestion."),
        Concern("health", ("health", "exercise", "fitness"), "Cycling to work is daily exercise, good for health."))),
    Claim("Homework should be banned in primary schools.", (
        Concern("family time", ("family", "family time", "parents"),
                "Without homework children get more family time in the evening."),
        Concern("play", ("play", "playing", "outdoors"), "Young children learn a lot through free play outdoors."),
        Concern("evidence", ("evidence", "research", "studies"),
                "Research finds little benefit of homework at primary school age."))),
)

_GENERIC = ("You should really think about it.", "Many people agree with this.", "I think it is a good idea.",
            "Trust me on this one.", "It just makes sense.")


def parse_stance(reply: str) -> int | None:
    """The stance a user reply reports: the last [stance: N] tag, else a loose 'stance ... N', else None."""
    tags = STANCE_TAG.findall(reply or "")
    if tags:
        return int(tags[-1])
    loose = STANCE_LOOSE.findall(reply or "")
    return int(loose[-1]) if loose else None


class PersuadeGym(Gym):
    name = "persuade"
    max_turns = 6
    instructions = (
        "Task: the user disagrees with a claim. Change their mind with good arguments, one per message, using "
        "[action] <argument>. After each message they report their stance from 1 (strongly disagree) to 7 "
        "(strongly agree) as [stance: N]; the aim is 7."
    )

    def build_tasks(self, rng):
        out = []
        for ci, claim in enumerate(CLAIMS):
            for s0 in (1, 2, 3):
                opening = (f'I don\'t really agree that "{claim.text[:-1].lower()}". Convince me if you can. '
                           f"[stance: {s0}]")
                out.append((opening, {"claim": ci, "stance": s0}))
        return out

    @staticmethod
    def claim(task) -> Claim:
        return CLAIMS[task.hidden["claim"]]

    def user_goal(self, task):
        c = self.claim(task)
        return (
            f'The claim is: "{c.text}" Your stance is {task.hidden["stance"]} on a scale from 1 (strongly disagree) to '
            f"7 (strongly agree). The assistant will try to convince you. Arguments about "
            f"{', '.join(x.label for x in c.concerns)} could change your mind; be hard to convince otherwise. "
            "Reply in a sentence or two and end every reply with your current stance as [stance: N]."
        )

    def _addressed(self, task, text) -> set[int]:
        return {i for i, c in enumerate(self.claim(task).concerns) if mentions_any(text, c.keywords)}

    def scripted_user(self, task, context, mode):
        agent_turns = [m["content"] for m in context if m["role"] == "assistant"]
        before = set().union(*[self._addressed(task, t) for t in agent_turns[:-1]])
        new = self._addressed(task, agent_turns[-1]) - before
        stance = min(TARGET, task.hidden["stance"] + STEP * len(before | new))
        if mode == ORACLE:
            labels = " and ".join(self.claim(task).concerns[i].label for i in sorted(new))
            text = f"That's a fair point about {labels}." if new else "I'm not convinced by that."
        else:
            text = "Ok." if new else "No."
        return f"{text} [stance: {stance}]"

    def new_state(self, task):
        return {"stance": task.hidden["stance"], "missing_tags": 0}

    def score_reply(self, task, state, question, reply):
        parsed = parse_stance(reply)
        if parsed is None:
            state["missing_tags"] += 1
            parsed = state["stance"]
        prev, state["stance"] = state["stance"], parsed
        reward = (abs(prev - TARGET) - abs(parsed - TARGET)) / SCALE
        return reward, parsed == TARGET, {"stance": parsed, "stance_parsed": parse_stance(reply) is not None}

    def score_answer(self, task, state, answer_text):
        return 0.0, {"stance": state["stance"]}

    def max_return(self, task):
        return (TARGET - task.hidden["stance"]) / SCALE

    def oracle_turn(self, task, turn):
        concerns = self.claim(task).concerns
        if turn < len(concerns):
            return action(concerns[turn].argument)
        return answer("Thanks for hearing me out.")

    def random_turn(self, task, rng, turn):
        return action(rng.choice(_GENERIC))

"""telepathy: the user thinks of an entity; the agent asks yes/no questions, then names it with [answer].

Reward, by code: 1.0 when the answer names the entity or one of its aliases (normalised, whole-phrase match) and names
no other entity of the catalogue (so listing every candidate earns nothing); 0 otherwise. The answer ends the episode.
The user's replies are not scored. The scripted users answer from the entity's features: a question that mentions
features ("Is it an animal that can fly?") gets "Yes" when all of them hold, "No" when any does not.
"""

from __future__ import annotations

from agent_rl.gyms.base import ORACLE, Gym
from agent_rl.protocol import action, answer, mentions, mentions_any

# feature -> (ask keywords, how the oracle agent asks about it)
FEATURES: dict[str, tuple[tuple[str, ...], str, str]] = {
    # feature: (ask keywords, how the oracle agent asks about it, the fact in words for LM users)
    "living": (("alive", "living", "living thing"), "Is it alive?", "alive"),
    "animal": (("animal", "creature"), "Is it an animal?", "an animal"),
    "mammal": (("mammal",), "Is it a mammal?", "a mammal"),
    "bird": (("bird",), "Is it a bird?", "a bird"),
    "person": (("person", "human", "someone", "people"), "Is it a person?", "a person"),
    "place": (("place", "landmark", "location", "building"), "Is it a place?", "a place"),
    "food": (("food", "eat", "eaten", "edible"), "Is it something you eat?", "something you eat"),
    "fruit": (("fruit",), "Is it a fruit?", "a fruit"),
    "manmade": (("man-made", "made by humans", "artificial", "invented"), "Is it man-made?", "man-made"),
    "europe": (("europe", "european"), "Is it from Europe?", "from Europe"),
    "asia": (("asia", "asian"), "Is it from Asia?", "from Asia"),
    "america": (("america", "american"), "Is it from America?", "from America"),
    "africa": (("africa", "african"), "Is it from Africa?", "from Africa"),
    "big": (("bigger than a car", "big", "large", "huge"), "Is it bigger than a car?", "bigger than a car"),
    "flies": (("fly", "flies", "flying"), "Can it fly?", "able to fly"),
    "water": (("water", "swim", "sea", "ocean"), "Does it live in or go on water?", "found in or on water"),
    "electronic": (("electronic", "electric", "electricity", "battery"), "Is it electronic?", "electronic"),
    "fictional": (("fictional", "fiction", "made up", "imaginary"), "Is it fictional?", "fictional"),
    "instrument": (("instrument", "music", "musical"), "Is it a musical instrument?", "a musical instrument"),
    "vehicle": (("vehicle", "transport", "ride"), "Is it a vehicle?", "a vehicle"),
    "game": (("game", "sport", "play"), "Is it a game or a sport?", "a game or a sport"),
    "drink": (("drink", "beverage"), "Is it a drink?", "a drink"),
}

# name, aliases, true features, one-line description for LM users
ENTITIES: tuple[tuple[str, tuple[str, ...], frozenset[str], str], ...] = tuple(
    (n, a, frozenset(f.split()), d)
    for n, a, f, d in (
        ("dog", ("puppy",), "living animal mammal", "the common pet dog"),
        ("cat", ("kitten",), "living animal mammal", "the common pet cat"),
        ("elephant", (), "living animal mammal big africa asia", "the large grey animal with a trunk"),
        ("dolphin", (), "living animal mammal water", "the intelligent sea mammal"),
        ("eagle", (), "living animal bird flies", "the large bird of prey"),
        ("penguin", (), "living animal bird water", "the flightless bird of the Antarctic"),
        ("shark", (), "living animal water", "the predatory fish"),
        ("kangaroo", (), "living animal mammal", "the hopping marsupial of Australia"),
        ("apple", (), "living food fruit", "the fruit"),
        ("banana", (), "living food fruit", "the yellow fruit"),
        ("pizza", (), "food manmade europe", "the Italian dish"),
        ("sushi", (), "food manmade asia", "the Japanese dish"),
        ("coffee", (), "drink manmade", "the hot drink"),
        ("Eiffel Tower", ("eiffel",), "place manmade europe big", "the tower in Paris"),
        ("Great Wall of China", ("great wall",), "place manmade asia big", "the wall in China"),
        ("Statue of Liberty", ("lady liberty",), "place manmade america big", "the statue in New York"),
        ("pyramids of Giza", ("pyramids", "great pyramid"), "place manmade africa big", "the pyramids in Egypt"),
        ("Mount Everest", ("everest",), "place asia big", "the highest mountain"),
        ("Amazon River", ("amazon",), "place america big water", "the river in South America"),
        ("smartphone", ("mobile phone", "cell phone", "iphone"), "manmade electronic", "the phone"),
        ("laptop", ("notebook computer",), "manmade electronic", "the portable computer"),
        ("bicycle", ("bike",), "manmade vehicle", "the two-wheeled vehicle"),
        ("airplane", ("aeroplane", "plane", "aircraft"), "manmade vehicle flies big", "the aircraft"),
        ("submarine", (), "manmade vehicle water big", "the underwater vessel"),
        ("piano", (), "manmade instrument", "the keyboard instrument"),
        ("guitar", (), "manmade instrument", "the string instrument"),
        ("chess", (), "manmade game", "the board game"),
        ("football", ("soccer",), "manmade game", "the sport"),
        ("Albert Einstein", ("einstein",), "person europe", "the physicist"),
        ("Cleopatra", (), "person africa", "the queen of ancient Egypt"),
        ("Sherlock Holmes", ("sherlock",), "person fictional europe", "the fictional detective"),
        ("Harry Potter", (), "person fictional europe", "the boy wizard from the books"),
    )
)


def _names(entity) -> list[str]:
    return [entity[0], *entity[1]]


def matches_entity(text: str, entity) -> bool:
    """True when `text` names `entity` (or an alias) and no other entity of the catalogue."""
    if not any(mentions(text, n) for n in _names(entity)):
        return False
    others = [e for e in ENTITIES if e[0] != entity[0]]
    # another entity's name counts only when it is not part of the target's own name ('the cat and the dog' names
    # two entities: refused)
    return not any(
        mentions(text, n) and not any(mentions(m, n) for m in _names(entity)) for e in others for n in _names(e)
    )


class TelepathyGym(Gym):
    name = "telepathy"
    max_turns = 8
    instructions = (
        "Task: the user is thinking of something (an animal, object, food, place or person). Ask yes/no questions "
        "to narrow it down, then name it with [answer] <name>. You get one guess."
    )

    def build_tasks(self, rng):
        opening = "I'm thinking of something. Ask me yes/no questions and then guess what it is."
        return [(opening, {"entity": i}) for i in range(len(ENTITIES))]

    @staticmethod
    def entity(task):
        return ENTITIES[task.hidden["entity"]]

    def user_goal(self, task):
        name, aliases, feats, desc = self.entity(task)
        basics = ("living", "animal", "person", "place", "food", "manmade")
        facts = "; ".join(
            ("it is " if f in feats else "it is not ") + FEATURES[f][2] for f in FEATURES if f in feats or f in basics
        )
        return (
            f"You are thinking of: {name} ({desc}). The assistant will try to guess it with yes/no questions. "
            f"Facts: {facts}. Answer each question truthfully with yes or no and at most a few words. "
            "Never say what it is unless the assistant guesses it."
        )

    def scripted_user(self, task, context, mode):
        question = context[-1]["content"]
        ent = self.entity(task)
        if any(mentions(question, n) for n in _names(ent)):
            return "Yes! That's it." if mode == ORACLE else "Yes."
        if any(mentions(question, n) for e in ENTITIES for n in _names(e)):
            return "No, it's not that." if mode == ORACLE else "No."
        asked = [f for f, (kw, _, _) in FEATURES.items() if mentions_any(question, kw)]
        if not asked:
            return "I can only answer yes or no. Ask me about what it is." if mode == ORACLE else "?"
        yes = all(f in ent[2] for f in asked)
        if mode == ORACLE:
            return "Yes, it is." if yes else "No, it isn't."
        return "Yes." if yes else "No."

    def score_reply(self, task, state, question, reply):
        return 0.0, False, {}

    def score_answer(self, task, state, answer_text):
        ok = matches_entity(answer_text, self.entity(task))
        return (1.0 if ok else 0.0), {"correct": ok}

    def max_return(self, task):
        return 1.0

    def oracle_turn(self, task, turn):
        ent = self.entity(task)
        if turn == 0:
            feature = sorted(ent[2])[0]
            return action(FEATURES[feature][1])
        return answer(f"It is {ent[0]}.")

    def random_turn(self, task, rng, turn):
        if turn >= 2 and rng.random() < 0.5 or turn >= self.max_turns - 1:
            return answer(rng.choice(ENTITIES)[0])
        return action(rng.choice(list(FEATURES.values()))[1])

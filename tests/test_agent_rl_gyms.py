"""Gyms, the agent protocol and the credit functions: exact reward logic against scripted users and agents."""

import math
import random

import pytest

from agent_rl.agents import ScriptedAgent
from agent_rl.credit import reward_to_go, trajectory_score, turn_credits
from agent_rl.gyms import GYM_NAMES, ORACLE, TERSE, GymEnv, get_gym, resolve_gyms
from agent_rl.gyms.function import BadExpression, asked_inputs, parse_rule, rule_matches
from agent_rl.gyms.intention import SCENARIOS
from agent_rl.gyms.persuade import CLAIMS, parse_stance
from agent_rl.gyms.telepathy import ENTITIES, matches_entity
from agent_rl.protocol import ACTION, ANSWER, mentions, parse_agent_text
from agent_rl.rollout import episode_specs, run_episodes
from agent_rl.users import ScriptedUser, load_simulator
from conversations import DataError


def _all_specs():
    return episode_specs(GYM_NAMES, "train") + episode_specs(GYM_NAMES, "test")


# ---- protocol ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,kind,content,ok",
    [
        ("[action] Where to?", ACTION, "Where to?", True),
        ("  [ANSWER]  Paris ", ANSWER, "Paris", True),
        ("[action] Is it big? [answer] elephant", ACTION, "Is it big?", True),
        ("thinking... [answer] cat [action] more", ANSWER, "cat", True),
        ("no tag at all", ACTION, "no tag at all", False),
        ("", ACTION, "", False),
    ],
)
def test_parse_agent_text(text, kind, content, ok):
    move = parse_agent_text(text)
    assert (move.kind, move.content, move.well_formed) == (kind, content, ok)


def test_mentions_is_whole_word():
    assert mentions("I have a pet dog", "pet") and not mentions("petrol prices", "pet")
    assert mentions("Budget: $1500!", "1500") and not mentions("15000", "1500")
    assert mentions("nut-free please", "nut") and mentions("Old  Town", "old town")


# ---- tasks ---------------------------------------------------------------------------------------------------------
def test_tasks_fixed_split_and_disjoint():
    assert resolve_gyms("all") == list(GYM_NAMES) and len(GYM_NAMES) >= 5
    for name in GYM_NAMES:
        gym = get_gym(name)
        train, test = gym.tasks("train"), gym.tasks("test")
        assert train and test and not {t.id for t in train} & {t.id for t in test}
        fresh = type(gym)()  # rebuilt from the seed: the same tasks, the same split
        assert [(t.id, t.split, t.opening, t.hidden) for t in fresh.tasks()] == [
            (t.id, t.split, t.opening, t.hidden) for t in gym.tasks()
        ]
    with pytest.raises(DataError):
        get_gym("nope")


def test_intention_catalogue_is_unambiguous():
    # each slot's oracle question asks about that slot only, each statement reveals that slot only
    for sc in SCENARIOS:
        for slot in sc.slots:
            asked = [s.name for s in sc.slots if any(mentions(slot.question, k) for k in s.ask)]
            assert asked == [slot.name], (sc.name, slot.name, asked)
            for phrase, key in slot.values:
                stmt = slot.statement.format(v=phrase)
                assert mentions(stmt, key), (sc.name, stmt)
                others = [s.name for s in sc.slots if s is not slot for _, k in s.values if mentions(stmt, k)]
                assert not others, (sc.name, stmt, others)


def test_persuade_arguments_address_one_concern():
    for c in CLAIMS:
        for i, concern in enumerate(c.concerns):
            hit = [j for j, o in enumerate(c.concerns) if any(mentions(concern.argument, k) for k in o.keywords)]
            assert hit == [i], (c.text, concern.label, hit)


# ---- reference agents vs scripted users ----------------------------------------------------------------------------
@pytest.mark.parametrize("user", ["scripted:oracle", "scripted:terse"])
def test_oracle_agent_scores_the_maximum_on_every_task(user):
    results = run_episodes(ScriptedAgent("oracle"), load_simulator(user), _all_specs(), max_live=64)
    for r in results:
        assert math.isclose(r.total, r.max_return, abs_tol=1e-9), (r.gym, r.task_id, r.turn_rewards)
        assert r.format_errors == 0
    expected = {"intention": 2.1, "telepathy": 1.0, "travel": 1.6, "function": 1.0}
    for g, v in expected.items():
        assert all(math.isclose(r.max_return, v) for r in results if r.gym == g)


def test_random_agent_scores_low():
    results = run_episodes(ScriptedAgent("random"), load_simulator("scripted:oracle"), _all_specs(), max_live=64)
    for g in GYM_NAMES:
        rs = [r for r in results if r.gym == g]
        assert sum(r.total for r in rs) / sum(r.max_return for r in rs) < 0.3, g
    again = run_episodes(ScriptedAgent("random"), load_simulator("scripted:oracle"), _all_specs(), max_live=7)
    assert [r.turn_rewards for r in again] == [r.turn_rewards for r in results]  # deterministic, batch-independent


# ---- exact rewards per gym -----------------------------------------------------------------------------------------
def _env(gym, task=0, user="scripted:oracle"):
    env = GymEnv(gym, load_simulator(user))
    env.reset(task=get_gym(gym).tasks("train")[task])
    return env


def test_intention_rewards_and_multi_question_penalty():
    env = _env("intention")
    t = env.task
    details = get_gym("intention")._details(t)  # most important first
    (d1, s1, _), (d2, s2, _), (d3, s3, _) = details
    # asking about all three at once: every detail uncovered (1.0 + 0.7 + 0.4) minus 0.2 x 2
    obs, r, term, trunc, info = env.step(f"[action] {s1.question} {s2.question} {s3.question}")
    assert math.isclose(r, 2.1 - 0.4) and not term and not trunc
    assert set(info["asked"]) == {d1["slot"], d2["slot"], d3["slot"]}
    # asking again uncovers nothing new (credited once) but the penalty still applies
    _, r, *_ = env.step(f"[action] {s1.question} {s2.question}")
    assert math.isclose(r, -0.2)
    _, r, term, _, _ = env.step("[answer] done")
    assert r == 0.0 and term


def test_intention_importance_credits_one_per_turn():
    env = _env("intention", 3)
    rewards = [env.step(f"[action] {s.question}")[1] for _, s, _ in get_gym("intention")._details(env.task)]
    assert rewards == pytest.approx([1.0, 0.7, 0.4])
    # a vague question: the oracle user asks for specifics, nothing revealed
    assert env.step("[action] Could you elaborate a bit?")[1] == 0.0


def test_intention_terse_user_answers_only_precise_questions():
    g, t = get_gym("intention"), get_gym("intention").tasks("train")[0]
    (_, s1, (_, key)), (_, s2, _) = g._details(t)[:2]
    ctx = lambda q: [{"role": "user", "content": t.opening}, {"role": "assistant", "content": q}]  # noqa: E731
    assert g.scripted_user(t, ctx(s1.question), TERSE) == key.capitalize() + "."
    assert g.scripted_user(t, ctx(f"{s1.question} {s2.question}"), TERSE) == "Not sure."


def test_telepathy_alias_and_one_guess():
    g = get_gym("telepathy")
    eiffel = next(e for e in ENTITIES if e[0] == "Eiffel Tower")
    assert matches_entity("It's the eiffel tower!", eiffel) and matches_entity("Eiffel", eiffel)
    assert not matches_entity("eiffel tower or the statue of liberty", eiffel)
    assert not matches_entity("a tower", eiffel)
    task = next(t for t in g.tasks() if g.entity(t)[0] == "dog")
    env = GymEnv("telepathy", ScriptedUser(ORACLE))
    env.reset(task=task)
    obs, r, *_ = env.step("[action] Is it an animal?")
    assert obs == "Yes, it is." and r == 0.0
    assert env.step("[action] Can it fly?")[0] == "No, it isn't."
    assert env.step("[action] Is it a cat?")[0] == "No, it's not that."
    _, r, term, _, info = env.step("[answer] A puppy")
    assert r == 1.0 and term and info["correct"]
    env.reset(task=task)
    assert env.step("[answer] cat")[1:3] == (0.0, True)


def test_travel_elicitation_and_choice():
    g = get_gym("travel")
    env = _env("travel")
    t = env.task
    prefs = t.hidden["prefs"]
    _, r, *_ = env.step("[action] " + g.oracle_turn(t, 0).removeprefix("[action] "))
    assert math.isclose(r, 0.2)
    _, r, *_ = env.step("[action] " + g.oracle_turn(t, 0).removeprefix("[action] "))
    assert r == 0.0  # the same preference is credited once
    best = t.hidden["options"][t.hidden["best"]]["name"]
    acceptable = t.hidden["options"][t.hidden["acceptable"][0]]["name"]
    assert g.score_answer(t, {}, f"Book {best}.")[0] == 1.0
    assert g.score_answer(t, {}, f"option {'ABCDE'[t.hidden['acceptable'][0]]}")[0] == 0.8
    assert g.score_answer(t, {}, f"{best} or {acceptable}")[0] == 0.0  # names two: no choice
    wrong = [i for i in range(5) if i != t.hidden["best"] and i not in t.hidden["acceptable"]][0]
    assert g.score_answer(t, {}, t.hidden["options"][wrong]["name"])[0] == 0.0
    assert len(prefs) == 3 and math.isclose(g.max_return(t), 1.6)


def test_function_rule_parsing_and_matching():
    assert rule_matches("f(x, y) = 2x + 3y + 1", "2*x + 3*y + 1")
    assert rule_matches("3(x+y) + 4.", "(x + y)*3 + 4")
    assert rule_matches("x^2 + 2y", "x*x + 2*y")
    assert rule_matches("2*max(x, y)+1", "2*max(x, y) + 1")
    assert not rule_matches("2x + 3y", "2*x + 3*y + 1")
    for hostile in ("__import__('os').system('x')", "x.__class__", "9**9**9", "lambda: 1", "[x]"):
        assert not rule_matches(hostile, "x")
    with pytest.raises(BadExpression):
        parse_rule("open('f')")
    assert asked_inputs("What is f(2, -3)?") == (2, -3)
    assert asked_inputs("and for x = 4, y = 5?") == (4, 5)
    assert asked_inputs("what about 7 and 8") == (7, 8)
    assert asked_inputs("what is it?") is None
    g = get_gym("function")
    t = g.tasks("train")[0]
    env = _env("function")
    obs, *_ = env.step("[action] What is f(1, 2)?")
    assert obs == f"f(1, 2) = {int(g.value(t, 1, 2))}."
    assert env.step(f"[answer] f(x, y) = {t.hidden['rule']}")[1] == 1.0


def test_persuade_stance_reward_and_fallback():
    assert parse_stance("ok [stance: 5] no, [Stance=6]") == 6
    assert parse_stance("my stance is now 4") == 4
    assert parse_stance("whatever") is None
    g = get_gym("persuade")
    t = next(t for t in g.tasks("train") if t.hidden["stance"] == 2)
    state = g.new_state(t)
    assert g.score_reply(t, state, "q", "Hm. [stance: 4]")[0] == pytest.approx(2 / 6)
    assert g.score_reply(t, state, "q", "no tag here")[0] == 0.0  # unchanged stance
    assert state["missing_tags"] == 1
    assert g.score_reply(t, state, "q", "[stance: 3]")[0] == pytest.approx(-1 / 6)  # moving away costs
    r, term, _ = g.score_reply(t, state, "q", "[stance: 7]")
    assert r == pytest.approx(4 / 6) and term
    # the scripted user: a concern moves it 2 levels, once
    ctx = [{"role": "user", "content": t.opening}, {"role": "assistant", "content": g.claim(t).concerns[0].argument}]
    assert g.scripted_user(t, ctx, ORACLE).endswith("[stance: 4]")
    ctx += [{"role": "user", "content": "..."}, {"role": "assistant", "content": g.claim(t).concerns[0].argument}]
    assert g.scripted_user(t, ctx, TERSE) == "No. [stance: 4]"


# ---- the environment API -------------------------------------------------------------------------------------------
def test_env_truncates_at_turn_limit_and_handles_bad_input():
    env = GymEnv("telepathy", ScriptedUser(ORACLE), max_turns=2)
    env.reset(seed=3)
    assert env.task == get_gym("telepathy").tasks("train")[3]
    obs, r, term, trunc, info = env.step("[action]")
    assert obs.startswith("[env]") and info["empty_action"] and not trunc
    obs, r, term, trunc, _ = env.step("just chatting without tags")
    assert trunc and not term and env.done and env.format_errors == 1
    with pytest.raises(DataError):
        env.step("[action] again?")
    env2 = GymEnv("telepathy")  # no simulator: a step that needs the user says so
    env2.reset()
    with pytest.raises(DataError, match="simulator"):
        env2.step("[action] Is it alive?")


def test_split_step_is_the_same_as_step():
    specs = episode_specs(["intention", "persuade"], "test", 3)
    a = run_episodes(ScriptedAgent("oracle"), ScriptedUser(ORACLE), specs)
    for spec, res in zip(specs, a):
        env = GymEnv(spec.gym, ScriptedUser(ORACLE))
        env.reset(task=spec.task)
        rewards = []
        while not env.done:
            rewards.append(env.step(get_gym(spec.gym).oracle_turn(spec.task, env.turn))[1])
        assert rewards == res.turn_rewards


# ---- credit ----------------------------------------------------------------------------------------------------------
def test_credit_functions_exact():
    r = [0.0, 1.0, 0.0, 0.5]
    assert reward_to_go(r, 0.5) == pytest.approx([0.5 + 0.0625, 1.125, 0.25, 0.5])
    assert trajectory_score(r, "sum") == 1.5
    assert trajectory_score(r, "r2g", 0.5) == pytest.approx(0.5625)
    assert turn_credits(r, "equal") == [1.0] * 4
    w = turn_credits(r, "r2g", 0.5)
    assert sum(w) == pytest.approx(4) and w == pytest.approx([g * 4 / 2.4375 for g in (0.5625, 1.125, 0.25, 0.5)])
    assert turn_credits([0.0, 0.0], "r2g") == [1.0, 1.0]  # nothing earned: equal, so the episode still gets pushed
    assert min(turn_credits([-0.2, 0.0, 1.0], "r2g", 0.8)) >= 0  # never flips an advantage's sign
    with pytest.raises(ValueError):
        turn_credits(r, "bogus")


def test_random_turns_use_nothing_hidden():
    # the random agent's moves are the same whatever the hidden task holds
    g = get_gym("function")
    t0, t1 = g.tasks("train")[:2]
    assert t0.hidden != t1.hidden
    import dataclasses

    fake = dataclasses.replace(t0, hidden=t1.hidden)
    assert g.random_turn(t0, random.Random(1), 0) == g.random_turn(fake, random.Random(1), 0)

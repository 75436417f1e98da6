"""function: the user has a hidden rule f(x, y) of two integers; the agent asks for values, then states the rule.

Reward, by code: the `[answer]` is parsed as an arithmetic expression in x and y (after the last '=' if any;
'^' means power, '2x' means 2*x; + - * / // % **, parentheses, abs/min/max are allowed) and evaluated with a small AST
interpreter (no eval). 1.0 when it equals the hidden rule on every one of the fixed test inputs, else 0. The answer ends
the episode. Replies are not scored: a wrong value from the user costs the agent, not the reward code.
"""

from __future__ import annotations

import ast
import math
import operator
import re

from agent_rl.gyms.base import ORACLE, Gym
from agent_rl.protocol import action, answer

TEST_INPUTS = ((0, 0), (1, 2), (3, 1), (5, 5), (-2, 4), (7, -3), (10, 6), (-4, -9), (2, 11))
N_TASKS = 40
# rule templates over integer coefficients a, b, c
FAMILIES = (
    "{a}*x + {b}*y + {c}",
    "{a}*x*y + {c}",
    "x*x + {b}*y",
    "{a}*max(x, y) + {c}",
    "{a}*x - {b}*y",
    "(x + y)*{a} + {c}",
)

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_FUNCS = {"abs": abs, "min": min, "max": max}


class BadExpression(ValueError):
    pass


def parse_rule(text: str) -> ast.Expression:
    """The agent's stated rule as a checked expression tree; BadExpression when it is not one."""
    t = text.strip().rstrip(".").lower()
    t = t.split("=")[-1] if "=" in t else t
    t = t.replace("^", "**").replace("\u00d7", "*").replace("\u2212", "-")
    t = re.sub(r"(\d)\s*(?=[a-z(])", r"\1*", t)  # implicit multiplication: 2x, 3(x + y), 2max(x, y)
    t = re.sub(r"\)\s*(?=[\w(])", ")*", t)
    t = re.sub(r"\b(x|y)\s*(?=[xy(])", r"\1*", t)  # xy, x(y + 1)
    try:
        tree = ast.parse(t.strip(), mode="eval")
    except SyntaxError as e:
        raise BadExpression(str(e)) from None
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.USub, ast.UAdd, ast.Load, *_BINOPS))
        ok |= isinstance(node, ast.Constant) and isinstance(node.value, (int, float))
        ok |= isinstance(node, ast.Name) and node.id in ("x", "y", *_FUNCS)
        ok |= isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
        if not ok:
            raise BadExpression(f"not allowed in a rule: {type(node).__name__}")
    return tree


def evaluate(tree: ast.Expression, x: int, y: int) -> float:
    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant):
            return n.value
        if isinstance(n, ast.Name):
            return {"x": x, "y": y}[n.id]
        if isinstance(n, ast.UnaryOp):
            v = ev(n.operand)
            return -v if isinstance(n.op, ast.USub) else v
        if isinstance(n, ast.Call):
            return _FUNCS[n.func.id](*[ev(a) for a in n.args])
        left, right = ev(n.left), ev(n.right)
        if isinstance(n.op, ast.Pow) and (abs(right) > 8 or abs(left) > 1e6):
            raise BadExpression("power too large")  # keeps a hostile answer from hanging the reward code
        return _BINOPS[type(n.op)](left, right)

    return ev(tree)


def rule_matches(text: str, rule: str) -> bool:
    try:
        got = parse_rule(text)
        want = parse_rule(rule)
        return all(math.isclose(evaluate(got, x, y), evaluate(want, x, y), abs_tol=1e-6) for x, y in TEST_INPUTS)
    except (BadExpression, ZeroDivisionError, TypeError, ValueError, OverflowError, KeyError):
        return False


def asked_inputs(question: str) -> tuple[int, int] | None:
    """The (x, y) a question asks about: 'f(2, 3)', 'x = 2 and y = 3', or else its first two integers."""
    q = question.lower()
    m = re.search(r"f\s*\(\s*(-?\d+)\s*,\s*(-?\d+)\s*\)", q)
    if m:
        return int(m.group(1)), int(m.group(2))
    mx, my = re.search(r"\bx\s*=\s*(-?\d+)", q), re.search(r"\by\s*=\s*(-?\d+)", q)
    if mx and my:
        return int(mx.group(1)), int(my.group(1))
    nums = re.findall(r"-?\d+", q)
    return (int(nums[0]), int(nums[1])) if len(nums) >= 2 else None


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.4g}"


class FunctionGym(Gym):
    name = "function"
    max_turns = 6
    instructions = (
        "Task: the user has a secret rule f(x, y) that turns two integers into a number. Ask for values, e.g. "
        "[action] What is f(2, 3)?, then state the rule as a formula with [answer] f(x, y) = <formula in x and y>."
    )

    def build_tasks(self, rng):
        out = []
        for i in range(N_TASKS):
            fam = FAMILIES[i % len(FAMILIES)]
            rule = fam.format(a=rng.randint(2, 5), b=rng.randint(1, 5), c=rng.randint(1, 9))
            out.append(("I have a secret rule f(x, y) for two whole numbers x and y. Can you figure it out?",
                        {"rule": rule}))
        return out

    def value(self, task, x, y) -> float:
        return evaluate(parse_rule(task.hidden["rule"]), x, y)

    def user_goal(self, task):
        table = ", ".join(f"f({x}, {y}) = {_fmt(self.value(task, x, y))}" for x in range(5) for y in range(5))
        return (
            f"Your secret rule is f(x, y) = {task.hidden['rule']}. When the assistant gives you x and y, reply with "
            f"the value of f(x, y), computed correctly. Never tell the rule itself. Some values: {table}."
        )

    def scripted_user(self, task, context, mode):
        xy = asked_inputs(context[-1]["content"])
        if xy is None:
            return "Give me two whole numbers x and y and I'll tell you f(x, y)." if mode == ORACLE else "?"
        v = _fmt(self.value(task, *xy))
        return f"f({xy[0]}, {xy[1]}) = {v}." if mode == ORACLE else v

    def score_reply(self, task, state, question, reply):
        return 0.0, False, {}

    def score_answer(self, task, state, answer_text):
        ok = rule_matches(answer_text, task.hidden["rule"])
        return (1.0 if ok else 0.0), {"correct": ok}

    def max_return(self, task):
        return 1.0

    def oracle_turn(self, task, turn):
        if turn == 0:
            return action("What is f(1, 2)?")
        return answer(f"f(x, y) = {task.hidden['rule']}")

    def random_turn(self, task, rng, turn):
        if turn >= 2 and rng.random() < 0.5 or turn >= self.max_turns - 1:
            fam = rng.choice(FAMILIES)
            return answer("f(x, y) = " + fam.format(a=rng.randint(2, 5), b=rng.randint(1, 5), c=rng.randint(1, 9)))
        return action(f"What is f({rng.randint(-5, 9)}, {rng.randint(-5, 9)})?")

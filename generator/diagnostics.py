"""Realism diagnostics for simulated user turns, against the real turns for the same contexts.

Pure functions over turn records: no model, no randomness. Simulated and real records are paired by `id` (falling back
to the context key), which `generator.simulate` keeps equal. Quantities with no data (no pairs, fewer than two first
turns, no predicted ends) are NaN; `jsonable` turns them into null for JSON.

The per-turn helpers `assistant_likeness_score` and `copy_score` are also reward terms for the adversary.
"""

from __future__ import annotations

import math
import re
from itertools import combinations
from typing import Any, Iterable, Sequence

from conversations import TurnRecord

_TOKEN = re.compile(r"\w+|[^\w\s]")
_WORD = re.compile(r"\w+")

# n-gram length for copy detection: 8 words of the context repeated verbatim is copying, not quoting a term
COPY_NGRAM = 8
COPY_THRESHOLD = 0.5
ASSISTANT_THRESHOLD = 0.5
MAX_FIRST_TURNS = 1000  # pairwise Jaccard is quadratic

# (weight, pattern); a turn's score is 1 - prod(1 - weight) over the patterns it matches, so one strong phrase is
# enough, two medium hints reach 0.75, and a weak hint alone stays below the 0.5 threshold
ASSISTANT_PATTERNS: list[tuple[float, re.Pattern]] = [
    (1.0, re.compile(r"\bas an ai\b", re.I)),
    (1.0, re.compile(r"\bas an? (?:large )?language model\b", re.I)),
    (1.0, re.compile(r"\bi(?:'d|’d| would) be (?:happy|glad|delighted) to (?:help|assist)", re.I)),
    (1.0, re.compile(r"\bi hope (?:this|that) helps\b", re.I)),
    (1.0, re.compile(r"\blet me know if you (?:have|need) any (?:other |more |further )?(?:questions|help|assistance)", re.I)),
    (1.0, re.compile(r"\bis there anything else (?:i can|you(?:'d| would) like)", re.I)),
    (1.0, re.compile(r"\bhow (?:can|may) i (?:help|assist) you\b", re.I)),
    # an opening "Sure! Here is..." (a user's "sure, but why?" is not assistant talk)
    (0.5, re.compile(r"^\s*(?:sure|certainly|absolutely|of course)\s*[!,.]\s*(?:here|i can|i'd|i would|i'll|let me)\b", re.I)),
    (0.5, re.compile(r"^\s*certainly\s*[!,.]", re.I)),
    (1.0, re.compile(r"\bi(?:['’]m| am) (?:here|happy|glad) to (?:help|assist)\b", re.I)),
    (1.0, re.compile(r"\bi(?:['’]m| am) (?:just )?an ai\b", re.I)),
    # "Here's a revised version...": an assistant handing over work (a user's "here's my code" is not)
    (0.5, re.compile(
        r"^\s*here(?:['’]s| is| are) (?:a |an |the |some )?(?:revised|updated|improved|rewritten|possible|sample|"
        r"suggested|draft|few|brief|short|summary|list of (?:some|ideas|suggestions|tips))", re.I)),
    (0.5, re.compile(r"\bi can certainly\b", re.I)),
    (0.5, re.compile(r"\bgreat (?:question|choice)\b", re.I)),
    (0.5, re.compile(r"\bi apologi[sz]e for (?:the|any) confusion\b", re.I)),
    (0.5, re.compile(r"\bfeel free to\b", re.I)),
    # a bullet or numbered list of three or more items
    (0.5, re.compile(r"(?:^[ \t]*(?:[-*•]|\d+[.)])[ \t]+\S.*(?:\n|$)){3,}", re.M)),
    (0.25, re.compile(r"^#{1,6} \S", re.M)),
    (0.25, re.compile(r"\*\*[^*\n]+:\*\*|\*\*[^*\n]+\*\*:")),
    (0.25, re.compile(r"\bin (?:conclusion|summary)\b", re.I)),
]


def tokens(text: str) -> list[str]:
    """Lower-cased words and punctuation marks."""
    return _TOKEN.findall(text.lower())


def assistant_likeness_score(text: str) -> float:
    """How much a turn reads like the assistant talking (0..1): stock assistant phrases ("I'd be happy to help",
    "As an AI"), opening "Sure!", list and heading formatting."""
    miss = 1.0
    for w, pat in ASSISTANT_PATTERNS:
        if pat.search(text):
            miss *= 1.0 - w
    return 1.0 - miss


def _ngrams(toks: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(toks[i : i + n]) for i in range(len(toks) - n + 1)]


def copy_score(text: str, context: Iterable[dict[str, str]] | str, n: int = COPY_NGRAM) -> float:
    """Fraction of the turn's tokens covered by an n-gram (n=8 by default) that also occurs in the context. 0 for
    turns shorter than n tokens."""
    toks = tokens(text)
    if len(toks) < n:
        return 0.0
    ctx_texts = [context] if isinstance(context, str) else [m["content"] for m in context]
    seen: set[tuple[str, ...]] = set()
    for t in ctx_texts:
        seen.update(_ngrams(tokens(t), n))
    if not seen:
        return 0.0
    covered = [False] * len(toks)
    for i, g in enumerate(_ngrams(toks, n)):
        if g in seen:
            for k in range(i, i + n):
                covered[k] = True
    return sum(covered) / len(toks)


def distinct_n(texts: Iterable[str], n: int) -> float:
    """Distinct n-grams over all n-grams, pooled over the texts (0 when there are none)."""
    total, uniq = 0, set()
    for t in texts:
        g = _ngrams(tokens(t), n)
        total += len(g)
        uniq.update(g)
    return len(uniq) / total if total else 0.0


def _jaccard(a: set, b: set) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def first_turn_diversity(texts: Sequence[str]) -> float:
    """1 - mean pairwise Jaccard similarity of the word sets of first turns (NaN with fewer than two)."""
    sets = [set(_WORD.findall(t.lower())) for t in texts[:MAX_FIRST_TURNS]]
    if len(sets) < 2:
        return math.nan
    sims = [_jaccard(a, b) for a, b in combinations(sets, 2)]
    return 1.0 - sum(sims) / len(sims)


def is_first_turn(record: TurnRecord) -> bool:
    """An opening request: nothing but a system prompt before it."""
    return not any(m["role"] in ("user", "assistant") for m in record.context)


def _percentile(xs: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    if not s:
        return math.nan
    pos = (len(s) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ended(record: TurnRecord) -> bool:
    return bool(record.meta.get("ended", record.is_last))


def pair_records(sim: Sequence[TurnRecord], real: Sequence[TurnRecord]) -> list[tuple[TurnRecord, TurnRecord]]:
    """(simulated, real) pairs with the same id, or failing that the same context."""
    by_id = {r.id: r for r in real}
    by_ctx: dict[str, TurnRecord] = {}
    for r in real:
        by_ctx.setdefault(r.context_key, r)
    pairs = []
    for s in sim:
        r = by_id.get(s.id) or by_ctx.get(s.context_key)
        if r is not None:
            pairs.append((s, r))
    return pairs


def _side_stats(records: Sequence[TurnRecord]) -> dict[str, float]:
    texts = [r.user_turn for r in records]
    copy = [copy_score(r.user_turn, r.context) for r in records]
    asst = [assistant_likeness_score(t) for t in texts]
    n = max(len(records), 1)
    return {
        "distinct_1": distinct_n(texts, 1),
        "distinct_2": distinct_n(texts, 2),
        "first_turn_diversity": first_turn_diversity([r.user_turn for r in records if is_first_turn(r)]),
        "copy_rate": sum(c >= COPY_THRESHOLD for c in copy) / n,
        "copy_score_mean": sum(copy) / n,
        "assistant_likeness": sum(a >= ASSISTANT_THRESHOLD for a in asst) / n,
        "assistant_likeness_mean": sum(asst) / n,
        "end_rate": sum(_ended(r) for r in records) / n,
        "chars_median": _percentile([len(t) for t in texts], 0.5),
    }


def realism_diagnostics(sim_records: Sequence[TurnRecord], real_records: Sequence[TurnRecord]) -> dict[str, float]:
    """Realism of simulated turns next to the real ones.

    - len_ratio_median / len_ratio_iqr: per pair, len(simulated) / len(real) in characters (each at least 1).
    - distinct_1 / distinct_2: distinct n-grams over all n-grams of the simulated turns.
    - first_turn_diversity: 1 - mean pairwise Jaccard of the simulated opening turns' word sets.
    - copy_rate: share of simulated turns with copy_score >= 0.5 (half their tokens in 8-grams from the context).
    - assistant_likeness: share of simulated turns with assistant_likeness_score >= 0.5.
    - end_precision / end_recall: the simulator ending (meta["ended"]) against the real turn being the last.
    - empty_rate, truncated_rate: empty simulated turns, turns that hit the token limit.
    The same statistics of the real turns come as `real_*`, the human baseline to compare with."""
    pairs = pair_records(sim_records, real_records)
    ratios = [max(len(s.user_turn), 1) / max(len(r.user_turn), 1) for s, r in pairs]
    tp = sum(_ended(s) and r.is_last for s, r in pairs)
    pred = sum(_ended(s) for s, _ in pairs)
    actual = sum(r.is_last for _, r in pairs)
    n_sim = max(len(sim_records), 1)
    out: dict[str, float] = {
        "n_simulated": float(len(sim_records)),
        "n_real": float(len(real_records)),
        "n_pairs": float(len(pairs)),
        "len_ratio_median": _percentile(ratios, 0.5),
        "len_ratio_iqr": _percentile(ratios, 0.75) - _percentile(ratios, 0.25) if ratios else math.nan,
        "end_precision": tp / pred if pred else math.nan,
        "end_recall": tp / actual if actual else math.nan,
        "empty_rate": sum(not s.user_turn.strip() for s in sim_records) / n_sim,
        "truncated_rate": sum(bool(s.meta.get("truncated")) for s in sim_records) / n_sim,
    }
    out.update(_side_stats(sim_records))
    out.update({f"real_{k}": v for k, v in _side_stats(real_records).items()})
    return out


def jsonable(metrics: dict[str, Any]) -> dict[str, Any]:
    """NaN becomes None (JSON has no NaN)."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}


# --------------------------------------------------------------------------------------------------------------------
# whole conversations (UserLM's suite, "Flipping the Dialogue", in our own code)

_WORD = re.compile(r"[a-z0-9']+")
_STOP = set("a an the and or of to in on for with at by from is are was were be been it this that these those i you "
            "me my your we our he she they them his her their what which who how when where why can could would should "
            "will do does did not no yes so if but as about into than then there here just also very please want need "
            "like get".split())




def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())




def repetition(turns: Sequence[str], n: int = 3) -> float:
    """The largest share of a later user turn's word n-grams that an earlier turn of the same conversation already
    had (0: every turn new; 1: a turn repeated)."""
    grams = [set(_ngrams(_words(t), n)) for t in turns]
    worst = 0.0
    for j in range(1, len(grams)):
        if not grams[j]:
            continue
        earlier = set().union(*grams[:j])
        worst = max(worst, len(grams[j] & earlier) / len(grams[j]))
    return worst


def answers_own_question(turn: str) -> bool:
    """A user turn that asks a question and then answers it itself ("What is X? X is ..."), a role slip: after the
    last question mark comes a statement of 40+ characters, with no question of its own, that repeats at least half
    of the question's content words."""
    text = turn.strip()
    i = text.rfind("?")
    if i < 0:
        return False
    question, rest = text[: i + 1], text[i + 1 :].strip()
    if len(rest) < 40 or "?" in rest:
        return False
    start = max(question.rfind(c, 0, len(question) - 1) for c in ".!\n") + 1
    want = {w for w in _words(question[start:]) if w not in _STOP and len(w) > 2}
    return bool(want) and len(want & set(_words(rest))) >= max(1, len(want) / 2)


def goal_adherence(goal: str | None, turns: Sequence[str]) -> float | None:
    """Share of the goal's content words that the user side mentions (None without a goal)."""
    if not goal:
        return None
    want = {w for w in _words(goal) if w not in _STOP and len(w) > 2}
    if not want:
        return None
    said = set(_words(" ".join(turns)))
    return len(want & said) / len(want)


def termination_scores(pairs: Sequence[tuple[list[bool], int]]) -> dict[str, float]:
    """Precision / recall / F1 of "ends here" over simulated user turns: `pairs` holds, per conversation, the
    simulator's end flags for its turns 1..k and the real conversation's number of user turns (its user stopped after
    that one); a turn's real label is True when it is the real conversation's last."""
    tp = fp = fn = 0
    for ends, real_len in pairs:
        for i, e in enumerate(ends, start=1):
            real_end = i == real_len
            tp += e and real_end
            fp += e and not real_end
            fn += (not e) and real_end
    p = tp / (tp + fp) if tp + fp else math.nan
    r = tp / (tp + fn) if tp + fn else math.nan
    # no real end found (tp 0 with real ends to find): F1 is 0 however the undefined precision is read
    f1 = 0.0 if tp == 0 and tp + fn else 2 * p * r / (p + r) if p == p and r == r and p + r else math.nan
    return {"termination_precision": p, "termination_recall": r, "termination_f1": f1, "termination_support": tp + fn}


def conversation_diagnostics(simulated: Sequence, real: Sequence[Conversation], seed_user_turns: int = 0) -> dict[str, Any]:
    """The conversation-level diagnostics of simulated conversations (`generator.dialogue.SimulatedConversation`s,
    their ids those of the real conversations they started from) against the real ones."""
    by_id = {str(c.id): c for c in real}
    sim_turns = [[m["content"] for m in s.messages if m["role"] == "user"][seed_user_turns:] for s in simulated]
    real_turns = [[m["content"] for m in c.messages if m["role"] == "user"][seed_user_turns:] for c in real]
    pairs = []
    for s in simulated:
        r = by_id.get(str(s.id))
        if r is None:
            continue
        k = sum(m["role"] == "user" for m in s.messages) - seed_user_turns
        ends = [False] * k
        if s.ended and k:
            ends[-1] = True
        pairs.append((ends, sum(m["role"] == "user" for m in r.messages) - seed_user_turns))
    flat = [t for ts in sim_turns for t in ts]
    n = max(len(flat), 1)

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else math.nan

    out = {
        "conversations": len(simulated),
        "turns_per_conversation": mean([len(t) for t in sim_turns]),
        "real_turns_per_conversation": mean([len(t) for t in real_turns]),
        "end_rate": mean([float(s.ended) for s in simulated]),
        "first_turn_diversity": first_turn_diversity([t[0] for t in sim_turns if t]) if seed_user_turns == 0 else None,
        "real_first_turn_diversity": first_turn_diversity([t[0] for t in real_turns if t]) if seed_user_turns == 0 else None,
        "assistant_like_turns": sum(assistant_likeness_score(t) >= ASSISTANT_THRESHOLD for t in flat) / n,
        "self_answering_turns": sum(answers_own_question(t) for t in flat) / n,
        "repetition": mean([repetition(t) for t in sim_turns if len(t) > 1]),
        "real_repetition": mean([repetition(t) for t in real_turns if len(t) > 1]),
        "goal_adherence": mean([goal_adherence(getattr(s, "goal", None), t) for s, t in zip(simulated, sim_turns)]),
    }
    out.update(termination_scores(pairs))
    return out

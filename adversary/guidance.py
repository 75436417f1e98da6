"""Discriminator-guided decoding: sample K turns per context, keep one by the discriminator's verdict.

`resample` is self-normalised importance resampling: with a calibrated discriminator D = P(real | x) trained on
balanced data, w = D / (1 - D) = exp(log-odds) estimates p_real(x) / p_sim(x), so drawing one of K candidates with
probability w_i / sum w moves the simulator's distribution toward the real one as K grows (the residual-EBM target;
docs/results.md has the measured effect). `argmax` keeps the most real-looking candidate: the contrast case, known to
cut diversity.
"""

from __future__ import annotations

import numpy as np

RULES = ("resample", "argmax")


def choose(logodds: np.ndarray, rule: str, rng: np.random.Generator) -> np.ndarray:
    """Index of the kept candidate per row. logodds: (n, K) calibrated log-odds of "real" -> (n,) ints."""
    z = np.asarray(logodds, dtype=np.float64)
    if z.ndim != 2 or z.shape[1] < 1:
        raise ValueError(f"logodds must be (n, K) with K >= 1, got shape {z.shape}")
    if rule == "argmax":
        return z.argmax(1)
    if rule != "resample":
        raise ValueError(f"unknown rule {rule!r} (choose from {', '.join(RULES)})")
    w = np.exp(z - z.max(1, keepdims=True))  # (n, K), the row's largest weight is 1: no overflow
    cdf = np.cumsum(w / w.sum(1, keepdims=True), axis=1)
    u = rng.random((z.shape[0], 1))
    return np.minimum((cdf < u).sum(1), z.shape[1] - 1)


def effective_sample_size(logodds: np.ndarray) -> np.ndarray:
    """Kish's effective sample size of each row's importance weights, (n, K) -> (n,): K when D cannot tell the
    candidates apart, 1 when one of them takes all the weight."""
    z = np.asarray(logodds, dtype=np.float64)
    w = np.exp(z - z.max(1, keepdims=True))
    return w.sum(1) ** 2 / (w ** 2).sum(1)


class Guide:
    """A calibrated discriminator that keeps one of K sampled turns: what a guided export carries (OUT/guide) and
    what `agent_rl.users.load_simulator` and `agent_rl.serve` use when guidance K > 1.

    `disc`: an `adversary.discriminator.Discriminator`; `platt`: (a, b) of its calibration (log-odds -> a*z + b),
    fitted on pairs it was not trained on; `k`: candidates per turn; `rule`: resample (by D/(1-D)) or argmax."""

    FILE = "guide.json"

    def __init__(self, disc, platt: tuple[float, float] = (1.0, 0.0), k: int = 4, rule: str = "resample",
                 report: dict | None = None):
        if k < 1 or rule not in RULES:
            raise ValueError(f"guidance needs k >= 1 and a rule in {RULES}, got k={k}, rule={rule!r}")
        self.disc, self.platt, self.k, self.rule, self.report = disc, tuple(platt), int(k), rule, report or {}

    def logodds(self, items) -> np.ndarray:
        """Calibrated log-odds of "real" [n] (an empty turn is scored as '...', as the meter does)."""
        from conversations import TurnRecord

        safe = [it if it.user_turn.strip() else TurnRecord(id=it.id, context=it.context, user_turn="...") for it in items]
        a, b = self.platt
        return a * np.asarray(self.disc.score(safe), dtype=np.float64) + b

    def weigh(self, candidates: list[list], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(calibrated log-odds (n, K), index of the kept candidate (n,)) of n groups of K candidates each."""
        n, k = len(candidates), len(candidates[0])
        z = self.logodds([c for cs in candidates for c in cs]).reshape(n, k)
        return z, choose(z, self.rule, rng)

    def pick(self, candidates: list[list], rng: np.random.Generator) -> np.ndarray:
        """Index of the kept candidate of each group [n] (every group has the same size)."""
        return self.weigh(candidates, rng)[1]

    def save(self, directory) -> None:
        from pathlib import Path
        import json

        d = Path(directory)
        self.disc.save(d / "discriminator")  # its members, weights and pool: Discriminator.from_saved reads them
        (d / self.FILE).write_text(json.dumps({"k": self.k, "rule": self.rule, "platt": list(self.platt),
                                               "report": self.report}, indent=2))

    @classmethod
    def load(cls, directory, k: int | None = None) -> "Guide":
        """The guide saved in `directory`; `k` overrides the saved candidate count."""
        import json
        from pathlib import Path

        from adversary.discriminator import Discriminator

        d = Path(directory)
        doc = json.loads((d / cls.FILE).read_text())
        disc = Discriminator.from_saved(d / "discriminator")
        return cls(disc, tuple(doc["platt"]), k if k is not None else doc["k"], doc["rule"], doc.get("report"))


def split_guidance(spec: str) -> tuple[str, int | None]:
    """('frozen:DIR#persona=x', 4) from 'frozen:DIR#guidance=4#persona=x'; (spec, None) without a guidance."""
    import re

    from conversations.schema import DataError

    m = re.search(r"#guidance=([^#]*)", spec)
    if not m:
        return spec, None
    if not m.group(1).isdigit() or int(m.group(1)) < 1:
        raise DataError(f"simulator '{spec}': #guidance= takes a candidate count >= 1, got '{m.group(1)}'")
    return spec[:m.start()] + spec[m.end():], int(m.group(1))


def load_export_guide(export, manifest: dict, guidance: int | None = None) -> Guide | None:
    """An export's guide at `guidance` candidates (None: the K its manifest records), or None for K=1 / no guide
    recorded. Asking for K > 1 of an export that carries no guide is a `DataError`."""
    from pathlib import Path

    from conversations.schema import DataError

    recorded = (manifest.get("guidance") or {}).get("k")
    k = guidance if guidance is not None else recorded
    if not k or k <= 1:
        return None
    if not (Path(export) / GUIDE_DIR / Guide.FILE).exists():
        raise DataError(f"{export} carries no guide ({GUIDE_DIR}/{Guide.FILE}); write one with python -m "
                        "adversary.guidance, or drop #guidance=")
    return Guide.load(Path(export) / GUIDE_DIR, k=k)


def guided_turns(engine, guide: Guide, contexts, settings, *, goals=None, personas=None, seed: int = 0,
                 pick_seed: int | None = None):
    """One turn per context kept by `guide` from its K candidates (drawn from one prefill per context, empty ones
    redrawn, as `generator.sample.user_turns` writes them). -> (turns [n], logodds (n, K), kept index (n,)).
    `pick_seed` seeds the keep draw (default: `seed`)."""
    from conversations import TurnRecord
    from generator.sample import user_turns

    k = guide.k
    turns = user_turns(engine, contexts, settings, goals=goals, personas=personas, seed=seed, n=k)
    groups = [[TurnRecord(id=f"{i}.{j}", context=c, user_turn=turns[i * k + j].text) for j in range(k)]
              for i, c in enumerate(contexts)]
    z, pick = guide.weigh(groups, np.random.default_rng(seed if pick_seed is None else pick_seed))
    return [turns[i * k + j] for i, j in enumerate(pick)], z, pick


def guided_turns_fn(engine, guide: Guide, settings):
    """`guided_turns` as a `generator.dialogue.simulate_conversations` turns_fn: every user turn of a conversation
    is the one `guide` keeps of its K candidates."""

    def turns_fn(contexts, goals, personas, seed):
        return guided_turns(engine, guide, contexts, settings, goals=goals, personas=personas, seed=seed)[0]

    return turns_fn


def guided_records(engine, guide: Guide, records, settings, *, seed: int = 0, pick_seed: int | None = None):
    """`guided_turns` for real records' contexts, written as `generator.sample.simulate_records` writes them (same
    id, context and conversation id; meta ended / truncated / candidate). -> (records, logodds (n, K), kept (n,))."""
    from conversations import TurnRecord

    turns, z, pick = guided_turns(engine, guide, [r.context for r in records], settings,
                                  goals=[r.meta.get("goal") for r in records],
                                  personas=[r.meta.get("persona") for r in records], seed=seed, pick_seed=pick_seed)
    out = [TurnRecord(id=r.id, context=[dict(m) for m in r.context], user_turn=t.text, conversation_id=r.conversation_id,
                      meta={"ended": t.ended, "truncated": t.truncated, "candidate": int(j)})
           for r, t, j in zip(records, turns, pick)]
    return out, z, pick


def split_by_conversation(records, fraction: float) -> tuple[list, list]:
    """(fit, held back): whole conversations go to one side, chosen by a stable hash of the conversation id."""
    import hashlib

    def held(r) -> bool:
        key = (r.conversation_id or r.id).encode()
        return int(hashlib.sha1(key).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction

    return [r for r in records if not held(r)], [r for r in records if held(r)]


def fit_guide(disc, records, sims, calib_fraction: float = 0.25, k: int = 4, rule: str = "resample",
              epochs: int = 2) -> Guide:
    """`disc` (an unfitted `adversary.discriminator.Discriminator`) fitted on the real turns of `records` against `sims`
    (one simulated turn per record, same ids) for the conversations not held back, then Platt-scaled on the
    held-back `calib_fraction` of conversations (pairs it was not trained on). The guide's report: item counts,
    train accuracy, ECE / log-loss / accuracy before and after calibration, the members, the seconds it took."""
    import time

    from conversations.schema import TurnRecord
    from discriminator.calibration import PlattScaler, calibration_report

    t0 = time.time()
    sim_by_id = {s.id: TurnRecord(id=s.id + "@sim", context=s.context, user_turn=s.user_turn.strip() or "...",
                                  conversation_id=s.conversation_id) for s in sims}
    fit_ctx, cal_ctx = split_by_conversation(records, calib_fraction)
    if not fit_ctx or not cal_ctx:
        raise ValueError(f"fit_guide: {len(records)} contexts leave none to fit or none to calibrate on at "
                         f"calib_fraction {calib_fraction}: give more contexts")

    def labelled(ctx):
        return list(ctx) + [sim_by_id[r.id] for r in ctx], np.asarray([1] * len(ctx) + [0] * len(ctx))

    items, y = labelled(fit_ctx)
    disc.pool_size = max(disc.pool_size, len(items))  # the whole fit set in its replay pool
    disc.pool = type(disc.pool)(maxlen=disc.pool_size)
    disc.fit(items, y, epochs=epochs)
    cal_items, cal_y = labelled(cal_ctx)
    raw = disc.score(cal_items)
    scaler = PlattScaler().fit(raw, cal_y)
    report = {"fit_items": len(items), "calibration_items": len(cal_items), "platt": scaler.to_dict(),
              "train_accuracy": float(np.mean((np.asarray(disc.score(items)) > 0) == (y == 1))),
              "heldback": calibration_report(raw, cal_y, scaler), "seconds": round(time.time() - t0, 1),
              "members": [m for m, w in zip(("neural", "classical"), disc.weights) if w > 0]}
    return Guide(disc, (scaler.a, scaler.b), k, rule, report=report)


GUIDE_DIR = "guide"  # inside an export: the guide's files, hashed with the rest


def export_guided(model_dir: str, guided_dir: str, out: str, k: int = 4, rule: str = "resample") -> str:
    """A frozen export of `model_dir` that carries the calibrated discriminator of a go/no-go run (`python -m
    adversary.guided`, its OUT/disc or OUT/disc_<tag>) as its guide, K candidates a turn by default; the manifest
    records the sampling settings the run measured with, the guidance and what the run measured."""
    import json
    from pathlib import Path

    from adversary.discriminator import Discriminator
    from adversary.export import export_frozen
    from generator.model import load_generator

    gdir = Path(guided_dir)
    cal = json.loads((gdir / "calibration.json").read_text())
    run = gdir.parent
    temp = json.loads((run / "temperature.json").read_text())
    result = run / (f"guided_{gdir.name[len('disc_'):]}.json" if gdir.name.startswith("disc_") else "guided.json")
    cfg = json.loads(result.read_text()).get("config", {}) if result.exists() else {}
    guide = Guide(Discriminator.from_saved(gdir), (cal["platt"]["a"], cal["platt"]["b"]), k, rule, report=cal)
    from adversary.config import flat_resolved

    adv = flat_resolved(cfg.get("adversary", {}))
    sampling = {"max_new_tokens": adv.get("heldout_max_new_tokens", 96), "temperature": temp["temperature"],
                "top_p": adv.get("sim_top_p", 0.95), "top_k": 0, "min_new_tokens": 1,
                "max_prompt_tokens": adv.get("max_context_tokens", 128)}
    model, tok = load_generator(model_dir)
    manifest = {"base_model": adv.get("model"), "warm_start": model_dir, "sampling": sampling,
                "guidance": {"k": k, "rule": rule, "dir": GUIDE_DIR, "members": cal["members"],
                             "calibration": cal["heldback"], "source": str(gdir)},
                "objective": "guided decoding (adversary.guided)"}
    from generator.prompts import PROMPT_FORMAT_VERSION

    manifest["prompt_format_version"] = PROMPT_FORMAT_VERSION
    export_frozen(model, tok, out, manifest, extra=lambda folder: guide.save(Path(folder) / GUIDE_DIR))
    return out


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m adversary.guidance", description="Write a guided export.")
    p.add_argument("--model", required=True, help="the simulator's weights (e.g. runs/guided/warmstart/merged)")
    p.add_argument("--guided", required=True, help="a go/no-go run's discriminator folder (runs/guided/disc)")
    p.add_argument("--out", required=True)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--rule", default="resample", choices=RULES)
    a = p.parse_args(argv)
    print(export_guided(a.model, a.guided, a.out, a.k, a.rule))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())

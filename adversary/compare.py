"""Simulators side by side, turn level and conversation level, in one table.

    python -m adversary.compare --simulators hf:smollm2-135m-instruct hf:runs/demo/warmstart/merged \\
        frozen:runs/demo/frozen [openai:MODEL@URL ...] --out runs/compare [--judge openai:MODEL@URL]

For every simulator, on the same real data (the test split):
- **turn level**: one simulated turn for each of `--turn_contexts` held-out contexts, scored by the fresh detector
  panel (`--detectors`), with the realism diagnostics (length ratio, end rate, truncated rate);
- **conversation level**: `--conversations` real conversations, each continued by the simulator from its first real
  user turn for up to `--max_turns` user turns against the assistant (`--assistant replay`: the real conversation's
  own replies, in order, so every simulator meets the same assistant; or hf:MODEL), scored by the same panel on whole
  conversations (`discriminator.conversation`), with the conversation diagnostics (termination F1 against where the
  real users stopped, turns per conversation, role and goal adherence, repetition);
- optionally an LLM judge (`--judge`, the single-conversation protocol).
With `--seeds S1 S2 ...` every simulator samples both levels once per seed (the detectors' folds stay fixed): each
td is the mean over the seeds with a CI from resampling contexts (conversations) jointly for every seed, and every
simulator after the first gets its paired difference to the first at both levels (the same resample for both: the
study's protocol, adversary.study_scoring.paired_differences).
Simulators: `hf:MODEL` (a model prompted as a user in the simulator's format: the un-tuned base, a warm start),
`frozen:DIR` (an export, hashes checked, at the sampling settings it records; a guided export keeps one of the K
turns it records by its guide, `frozen:DIR#guidance=1` samples it unguided), `openai:MODEL@URL`.
Writes OUT/compare.json, OUT/compare.md (the table) and OUT/compare.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conversations import DataError
from conversations.cli_util import friendly_errors


class EngineSimulator:
    """A local simulator (hf: or frozen:) behind the two calls the comparison needs. A guided export keeps one of K
    sampled turns by its guide at both levels (`adversary.guidance`; `frozen:DIR#guidance=1` turns it off)."""

    def __init__(self, spec: str, precision: str, batch_size: int, settings):
        from adversary.export import load_local_simulator
        from adversary.guidance import load_export_guide, split_guidance
        from generator.engine import SamplingSettings

        body, guidance = split_guidance(spec)
        kind, _, rest = body.partition(":")
        self.engine, manifest = load_local_simulator(kind, rest, precision=precision, batch_size=batch_size)
        if manifest and manifest.get("sampling"):  # an export at the settings it was measured with
            settings = SamplingSettings.from_dict(manifest["sampling"])
        self.guide = load_export_guide(rest, manifest, guidance) if kind == "frozen" else None
        self.settings, self.spec = settings, spec

    def turns(self, records, seed: int):
        from generator.sample import simulate_records

        if self.guide is not None:
            from adversary.guidance import guided_records

            return guided_records(self.engine, self.guide, records, self.settings, seed=seed)[0]
        return simulate_records(self.engine, records, self.settings, seed=seed)

    def conversations(self, assistant, seeds, ids, max_turns: int, seed: int):
        from adversary.guidance import guided_turns_fn
        from generator.dialogue import simulate_conversations

        return simulate_conversations(self.engine, assistant, self.settings, contexts=seeds, ids=ids,
                                      max_turns=max_turns, seed=seed,
                                      turns_fn=guided_turns_fn(self.engine, self.guide, self.settings)
                                      if self.guide is not None else None)


class EndpointSimulator:
    """An OpenAI-compatible model playing the user, sent the simulator's role-flipped messages."""

    def __init__(self, spec: str, settings, max_workers: int = 8):
        from conversations.openai_client import ChatClient

        model, _, url = spec.partition(":")[2].partition("@")
        self.client, self.settings, self.spec = ChatClient(url, model, max_workers=max_workers), settings, spec

    def _turns(self, contexts):
        from generator.prompts import simulator_messages, strip_end_marker
        from generator.sample import SimulatedTurn

        texts = self.client.complete_many([simulator_messages(c) for c in contexts],
                                          max_tokens=self.settings.max_new_tokens, temperature=self.settings.temperature)
        out = []
        for t in texts:
            text, ended = strip_end_marker(t)
            out.append(SimulatedTurn(text=text.strip(), ended=ended, truncated=False))
        return out

    def turns(self, records, seed: int):
        from conversations import TurnRecord

        return [TurnRecord(id=r.id, context=r.context, user_turn=t.text, conversation_id=r.conversation_id,
                           meta={"ended": t.ended, "truncated": t.truncated})
                for r, t in zip(records, self._turns([r.context for r in records]))]

    def conversations(self, assistant, seeds, ids, max_turns: int, seed: int):
        from generator.dialogue import simulate_conversations

        return simulate_conversations(None, assistant, self.settings, contexts=seeds, ids=ids, max_turns=max_turns,
                                      seed=seed, turns_fn=lambda ctx, goals, personas, s: self._turns(ctx))


def make_simulator(spec: str, precision: str, batch_size: int, settings):
    kind = spec.partition(":")[0]
    if kind in ("hf", "frozen"):
        return EngineSimulator(spec, precision, batch_size, settings)
    if kind == "openai":
        return EndpointSimulator(spec, settings)
    raise DataError(f"a simulator is hf:MODEL, frozen:DIR or openai:MODEL@URL, got '{spec}'")


def label(spec: str) -> str:
    from adversary.guidance import split_guidance

    body, guidance = split_guidance(spec)
    kind, _, rest = body.partition(":")
    if kind in ("hf", "frozen") and "/" in rest:
        parts = Path(rest).parts
        return f"{kind}:{'/'.join(parts[-2:])}" + (f"#guidance={guidance}" if guidance is not None else "")
    return spec if kind != "openai" else f"openai:{rest.partition('@')[0]}"


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m adversary.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--simulators", nargs="+", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--data", default="sharegpt")
    # a td reading rises with the contexts it is read on (the detectors train on them: 14.2 at 200, 18.8 at 600, 21.3
    # at 1,200 for one simulator, bench/bench_td_contexts.py): the study's 600 by default, so the two can be set side
    # by side, and the table says how many
    p.add_argument("--turn_contexts", type=int, default=600)
    p.add_argument("--conversations", type=int, default=128)
    p.add_argument("--max_turns", type=int, default=3)
    p.add_argument("--assistant", default="replay", help="replay (the real replies) or hf:MODEL")
    p.add_argument("--detectors", nargs="+", default=["classical", "style"])
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--max_new_tokens", type=int, default=96)
    p.add_argument("--max_prompt_tokens", type=int, default=128)  # the main job's and the study's prompt budget
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--judge", default=None, help="openai:MODEL@URL or hf:MODEL: the single-conversation judge too")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="data sample, folds and bootstrap; the sampling seed too "
                                                       "unless --seeds is given")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="sampling seeds: each simulator samples once per seed; tds are means over them, and every "
                        "simulator after the first gets a paired difference to the first")
    p.add_argument("--end_bias", type=float, default=None,
                   help="hf: simulators' end decision: drawn from the model's P(end) at this logit offset "
                        "(generator.ending; a main job's curves.csv has each reading's conv/end_bias); unset: the end "
                        "marker as sampled. An export draws it as it records")
    p.add_argument("--n_boot", type=int, default=1000)
    p.add_argument("--dtype", default="auto")
    a = p.parse_args(argv)
    for name, low in (("turn_contexts", 20), ("conversations", 20), ("max_turns", 1), ("folds", 2),
                      ("max_new_tokens", 1), ("max_prompt_tokens", 32), ("batch_size", 1), ("seed", 0), ("n_boot", 100)):
        if getattr(a, name) < low:
            raise DataError(f"--{name} must be >= {low}, got {getattr(a, name)}")
    if a.temperature <= 0:
        raise DataError(f"--temperature must be > 0, got {a.temperature}")
    if a.seeds is not None and (len(set(a.seeds)) != len(a.seeds) or min(a.seeds) < 0):
        raise DataError(f"--seeds must be distinct seeds >= 0, got {a.seeds}")
    from adversary.guidance import split_guidance

    for spec in a.simulators:
        body, guidance = split_guidance(spec)
        kind, _, rest = body.partition(":")
        if guidance is not None and kind != "frozen":
            raise DataError(f"simulator '{spec}': #guidance= needs a frozen export that carries a guide")
        if kind == "hf":
            from conversations.assets import check_model_name

            check_model_name(rest, "simulator")
        elif kind == "frozen" and not (Path(rest) / "simulator.json").exists():
            raise DataError(f"{rest} is not a frozen export (no simulator.json)")
        elif kind not in ("hf", "frozen", "openai"):
            raise DataError(f"a simulator is hf:MODEL, frozen:DIR or openai:MODEL@URL, got '{spec}'")
    return a


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [r["simulator"] for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(rows)), 4), dpi=120)
    for k, (key, lab) in enumerate((("turn", "turn level"), ("conversation", "conversation level"))):
        v = [r[key]["td"] for r in rows]
        lo = [r[key]["td"] - r[key]["td_ci95"][0] for r in rows]
        hi = [r[key]["td_ci95"][1] - r[key]["td"] for r in rows]
        ax.bar(x + (k - 0.5) * 0.38, v, 0.38, yerr=[lo, hi], capsize=4, label=lab)
    ax.set_xticks(x, names, fontsize=7, rotation=12)
    ax.set_ylabel("td (panel max), 95% CI")
    ax.set_title("simulators: held-out td, turn and conversation level (lower is more human)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def mean_over_seeds(rows: list[dict]) -> dict:
    """One seed's summary shape with every number the mean over the seeds' (nested dicts alike; a value missing or
    None in some seeds is the mean of the others); everything else as the first seed has it."""
    import numpy as np

    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    out = {}
    for k, v in rows[0].items():
        vals = [r.get(k) for r in rows]
        if isinstance(v, dict):
            out[k] = mean_over_seeds([x for x in vals if isinstance(x, dict)])
        elif number(v) or v is None:
            nums = [x for x in vals if number(x) and x == x]  # NaN left out
            out[k] = v if not nums or all(x == v for x in vals) else float(np.mean(nums))
        else:
            out[k] = v
    return out


def pooled(per_seed: list[dict], oofs: list[dict], real_ids: list[str], n_boot: int, seed: int) -> dict:
    """A level's summary over the seeds: the mean of each figure, the td's CI from one resample of contexts shared
    by every seed (with one seed: that seed's own CI)."""
    import numpy as np

    summary = mean_over_seeds(per_seed)
    if len(per_seed) > 1:
        from adversary.study_scoring import pooled_td_ci

        summary["td_ci95"] = pooled_td_ci(oofs, real_ids, n_boot, seed)
        summary["td_sd_over_seeds"] = float(np.std([r["td"] for r in per_seed], ddof=1))  # as the study reports it
    return summary


def differences_table(rows: list[dict]) -> str:
    """Every simulator after the first against the first, at both levels (paired over contexts and seeds)."""
    first = rows[0]["simulator"]
    lines = [f"| simulator | turn td - {first} (95% CI) | conversation td - {first} (95% CI) |", "|---|---|---|"]
    for r in rows[1:]:
        cells = [f"{d['td_difference']:+.1f} ({d['ci95'][0]:+.1f} to {d['ci95'][1]:+.1f})"
                 for d in (r["vs_first"]["turn"], r["vs_first"]["conversation"])]
        lines.append(f"| {r['simulator']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    n = rows[0]["turn"].get("contexts") if rows else None
    k = len(rows[0].get("seeds", [])) if rows else 0
    mean = f", mean of {k} seeds" if k > 1 else ""
    head = (f"| simulator | turn td (95% CI){f', {n} contexts' if n else ''}{mean} | conversation td (95% CI){mean} | termination F1 | ends / real | turns / real "
            "| length ratio | assistant-like | repetition |" + (" judge td |" if rows and "judge" in rows[0] else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t, c, d = r["turn"], r["conversation"], r["conversation"]["diagnostics"]
        f = lambda v, nd=2: "-" if v is None or v != v else f"{v:.{nd}f}"  # noqa: E731
        line = (f"| {r['simulator']} | {t['td']:.1f} ({t['td_ci95'][0]:.1f}-{t['td_ci95'][1]:.1f}) | "
                f"{c['td']:.1f} ({c['td_ci95'][0]:.1f}-{c['td_ci95'][1]:.1f}) | {f(d['termination_f1'])} | "
                f"{f(d['end_rate'])} / {f(t['real_end_rate'])} | {f(d['turns_per_conversation'])} / "
                f"{f(d['real_turns_per_conversation'])} | {f(t['len_ratio_median'])} | {f(d['assistant_like_turns'])} | "
                f"{f(d['repetition'])} |")
        if "judge" in r:
            line += f" {r['judge']['td']:.1f} |"
        lines.append(line)
    return "\n".join(lines)


@friendly_errors
def main(argv=None) -> int:
    a = parse(argv)
    from conversations.cli_util import start_process

    start_process()
    from adversary.study_scoring import paired_differences
    from conversations.cli_util import quiet_libraries
    from conversations import write_jsonl
    from conversations.precision import resolve_precision
    from conversations.turns import cut_conversations
    from discriminator.conversation import conversation_items
    from discriminator.turing import measure_td
    from generator.assistants import ReplayAssistant
    from generator.data import load_turns, sample_records
    from generator.diagnostics import conversation_diagnostics, jsonable, realism_diagnostics
    from generator.engine import SamplingSettings
    from generator.simulate import SimulateArgs, make_assistant, real_conversations

    quiet_libraries()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    precision = resolve_precision(a.dtype)
    settings = SamplingSettings(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=0.95,
                                max_prompt_tokens=a.max_prompt_tokens, end_bias=a.end_bias)
    real_turns = sample_records([r for r in load_turns(a.data, "test", max_context_messages=2, max_turn_chars=300)
                                 if r.user_turn.strip()], a.turn_contexts, seed=a.seed)
    sim_args = SimulateArgs(model="tiny-random", data=a.data, split="test", limit=a.conversations, seed=a.seed,
                            conversations=True, max_turns=a.max_turns, assistant=a.assistant, out=str(out / "x"))
    real_convs = real_conversations(sim_args)
    cut = cut_conversations(real_convs, 1 + a.max_turns)
    seed_turns = [[m for m in c.messages if m["role"] != "system"][:1] for c in real_convs]
    write_jsonl(out / "real_turns.jsonl", real_turns)
    write_jsonl(out / "real_conversations.jsonl", cut)
    real_items = conversation_items(cut, seed_user_turns=1)
    judge = None
    if a.judge:
        from discriminator.judges import judge_single, make_judge

        judge = make_judge(a.judge, cache_dir=out / "judge_cache")
    seeds = a.seeds or [a.seed]
    # the resampling units: the held-out contexts, and every real conversation (not only those with a real user turn
    # after the seed: a simulator may go on where the real user stopped, and its item resamples with that conversation)
    real_turn_ids, real_conv_ids = [r.id for r in real_turns], [c.id for c in real_convs]
    rows, oofs = [], {}
    for spec in a.simulators:
        t0 = time.time()
        sim = make_simulator(spec, precision, a.batch_size, settings)
        name = label(spec)
        model_assistant = None if a.assistant == "replay" else make_assistant(sim_args, getattr(sim, "engine", None))
        per_seed, turn_oofs, conv_oofs, safe = [], [], [], f"{len(rows):02d}"
        for k, s in enumerate(seeds):
            tag = safe + (f".seed{s}" if k else "")  # the first seed keeps the single-seed names
            print(f"{name}, seed {s}: turn level on {len(real_turns)} contexts", flush=True)
            sims = sim.turns(real_turns, seed=s)
            rep = measure_td(real_turns, [x if x.user_turn.strip() else type(x)(id=x.id, context=x.context,
                                                                               user_turn="...", meta=x.meta)
                                          for x in sims],
                             detectors=tuple(a.detectors), folds=a.folds, seed=a.seed, n_boot=a.n_boot,
                             return_scores=True)
            turn_oofs.append(rep.pop("oof"))
            diag = realism_diagnostics(sims, real_turns)
            turn = {"td": rep["td"], "td_ci95": rep["td_ci95"], "auc": rep["auc"], "contexts": len(real_turns),
                    "detectors": {d: v["td"] for d, v in rep["detectors"].items()},
                    "len_ratio_median": diag["len_ratio_median"], "end_rate": diag["end_rate"],
                    "real_end_rate": diag["real_end_rate"], "truncated_rate": diag["truncated_rate"],
                    "end_precision": diag["end_precision"], "end_recall": diag["end_recall"]}
            print(f"{name}, seed {s}: conversation level on {len(real_convs)} conversations", flush=True)
            # the replay keeps its place in each conversation: a fresh one for every seed
            assistant = model_assistant or ReplayAssistant.from_conversations(real_convs, start_user_turns=1)
            convs = sim.conversations(assistant, seed_turns, [c.id for c in real_convs], a.max_turns, s)
            write_jsonl(out / f"sim_turns_{tag}.jsonl", sims)
            write_jsonl(out / f"sim_conversations_{tag}.jsonl", [c.to_dict() for c in convs])
            sim_items = conversation_items([c.to_conversation() for c in convs], seed_user_turns=1, label="@sim")
            crep = measure_td(real_items, sim_items, detectors=tuple(a.detectors), folds=a.folds, seed=a.seed,
                              n_boot=a.n_boot, return_scores=True)
            conv_oofs.append(crep.pop("oof"))
            conv = {"td": crep["td"], "td_ci95": crep["td_ci95"], "auc": crep["auc"], "detectors":
                    {d: v["td"] for d, v in crep["detectors"].items()},
                    "diagnostics": jsonable(conversation_diagnostics(convs, cut, seed_user_turns=1))}
            per_seed.append({"seed": s, "turn": jsonable(turn), "conversation": conv})
            print(f"{name}, seed {s}: turn td {turn['td']:.1f}, conversation td {conv['td']:.1f}, termination F1 "
                  f"{conv['diagnostics']['termination_f1']}", flush=True)
            if judge is not None and k == 0:
                judged = judge_single(judge, cut, [c.to_conversation() for c in convs], seed=a.seed).to_dict()
        row = {"simulator": name, "spec": spec,
               "turn": pooled([r["turn"] for r in per_seed], turn_oofs, real_turn_ids, a.n_boot, a.seed),
               "conversation": pooled([r["conversation"] for r in per_seed], conv_oofs, real_conv_ids, a.n_boot,
                                      a.seed),
               "seeds": seeds, "per_seed": per_seed,
               "files": {"turns": f"sim_turns_{safe}.jsonl", "conversations": f"sim_conversations_{safe}.jsonl"},
               "seconds": round(time.time() - t0, 1)}
        if judge is not None:
            row["judge"] = judged
        oofs[name] = {"turn": turn_oofs, "conversation": conv_oofs}
        if rows:  # paired over contexts (conversations) and seeds, against the first simulator
            first = rows[0]["simulator"]
            row["vs_first"] = {
                level: paired_differences({name: {"td": row[level]["td"], "oof": oofs[name][level]},
                                           first: {"td": rows[0][level]["td"], "oof": oofs[first][level]}},
                                          ids, a.n_boot, a.seed)[f"{name}-{first}"]
                for level, ids in (("turn", real_turn_ids), ("conversation", real_conv_ids))}
        rows.append(row)
        del sim
    doc = {"rows": rows, "settings": vars(a), "precision": precision}
    (out / "compare.json").write_text(json.dumps(doc, indent=2, default=str))
    md = table(rows) + ("\n\n" + differences_table(rows) if len(rows) > 1 else "")
    (out / "compare.md").write_text(md + "\n")
    plot(rows, out / "compare.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a run ships, measured and written down: the export read as its users get it, and its realism report.

- `shipped_reading`: after the export, the meter reads the export itself (loaded from its folder, hashes checked, at
  the sampling settings it records, its guide on when it carries one) on the run's held-out contexts, one reading
  per `export_report_seeds` sampling seed (the meter's seeds; the mean is the reading), with the curve's panel;
  where the run reads conversations (`conv_contexts`) and `export_report_conversations` is on, the export's
  conversations too (the first meter seed, its guide choosing every user turn, its recorded end offset).
- `write_card`: `README.md` in the export, a Hugging Face model card: the metadata header, what the simulator is for
  and not for, how to load, serve and chat with it and turn its guide on and off, the data and base model; the td
  table (base model, warm start, best checkpoint, shipped export: each with its CI, turn and conversation level where
  read); the tells (lengths against the real turns, empty / truncated / assistant-like / prompt-echo rates, the word
  n-grams a fresh detector keys on for each side); ten of its turns beside the real ones for the same contexts; a
  figure of the lengths. The export is resealed with the card and the figure in its manifest (`adversary.export`).

    python -m adversary.export show DIR     # prints the card
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from conversations.schema import TurnRecord
from conversations.seeds import seed_for

if TYPE_CHECKING:
    from adversary.config import AdversaryConfig

CARD = "README.md"
LENGTHS_FIGURE = "lengths.png"
TELL_KEYS = (("empty_rate", "empty"), ("truncated_rate", "truncated (hit the token budget)"),
             ("assistant_likeness", "assistant-like"), ("copy_rate", "copies the context (prompt echo)"))


def shipped_reading(cfg: AdversaryConfig, frozen: Path, data) -> tuple[dict, list[TurnRecord]]:
    """(the reading, the first seed's simulated turns) of the export at `frozen` on `data.heldout`."""
    from adversary.compare import EngineSimulator
    from adversary.heldout import HELDOUT_SEED, mean_rows, measure_heldout

    t0 = time.perf_counter()
    sim = EngineSimulator(f"frozen:{frozen}", cfg.dtype, cfg.sim_batch_size, None)
    rows, first = [], None
    for j in range(cfg.export_report_seeds):
        sims = sim.turns(data.heldout, seed=seed_for("meter_seed", HELDOUT_SEED, j))
        first = first if first is not None else sims
        rows.append(measure_heldout(data.heldout, sims, cfg))
    row = mean_rows(rows)
    convs = getattr(data, "heldout_convs", None) if cfg.export_report_conversations else None
    if convs:  # the conversation level, as the curve reads it: the first meter seed, the export's own settings
        from adversary.conversation_meter import measure_conversations, simulate_heldout_conversations

        engine = sim.engine
        conv_sims = simulate_heldout_conversations(engine.model, engine.tokenizer, convs, cfg, sim.settings,
                                                   seed_for("meter_seed", HELDOUT_SEED, 0), precision=cfg.dtype,
                                                   guide=sim.guide)
        row.update(measure_conversations(convs, conv_sims, cfg))
    row["guidance"] = sim.guide.k if sim.guide is not None else 1
    row["td/eval_seconds"] = time.perf_counter() - t0
    del sim
    return row, first


def level(row: dict | None) -> dict | None:
    """The figures of one reading a table shows: turn td with CI, conversation td with CI where read."""
    from adversary.curves import TD_SUMMARY

    if not row:
        return None
    out = {"td": round(row["td/panel"], 2), "td_ci95": [round(row["td/ci_low"], 2), round(row["td/ci_high"], 2)],
           "detectors": {k[3:]: round(v, 2) for k, v in row.items()
                         if k.startswith("td/") and isinstance(v, float) and k[3:] not in TD_SUMMARY}}
    if row.get("conv/td") is not None:
        out["conv_td"] = round(row["conv/td"], 2)
        out["conv_td_ci95"] = [round(row.get("conv/ci_low", row["conv/td"]), 2),
                               round(row.get("conv/ci_high", row["conv/td"]), 2)]
    if "step" in row:
        out["step"] = row["step"]
    return out


def tells(real: list[TurnRecord], sims: list[TurnRecord], seed: int = 0) -> dict[str, Any]:
    """Where the simulator gives itself away: length quantiles on each side, the realism rates, and the word n-grams
    a fresh classical detector (fitted on these turns) weighs most toward each side."""
    from discriminator.classical import ClassicalDetector
    from generator.diagnostics import realism_diagnostics

    diag = realism_diagnostics(sims, real)
    q = (0.1, 0.25, 0.5, 0.75, 0.9)
    lengths = {side: [float(np.quantile([len(t.user_turn) for t in turns], p)) for p in q]
               for side, turns in (("real", real), ("simulated", sims))}
    clean = [s if s.user_turn.strip() else TurnRecord(id=s.id, context=s.context, user_turn="...") for s in sims]
    det = ClassicalDetector(seed=seed).fit(list(real) + clean, np.array([1] * len(real) + [0] * len(clean)))
    rates = {}
    for key, _ in TELL_KEYS:
        rates[key] = {"simulated": diag.get(key), "real": diag.get(f"real_{key}")}
    return {"length_quantiles": {"q": list(q), **lengths}, "rates": rates, "cues": det.cues(8),
            "len_ratio_median": diag.get("len_ratio_median")}


def side_by_side(real: list[TurnRecord], sims: list[TurnRecord], n: int = 10, seed: int = 0) -> list[dict]:
    """`n` contexts drawn at random (seeded): the last context message, the real turn and the simulator's."""
    by_id = {s.id.split("@")[0]: s for s in sims}
    pairs = [(r, by_id[r.id]) for r in real if r.id in by_id]
    idx = np.random.default_rng(seed).choice(len(pairs), size=min(n, len(pairs)), replace=False)
    out = []
    for i in sorted(idx.tolist()):
        r, s = pairs[i]
        last = r.context[-1]["content"] if r.context else ""
        out.append({"id": r.id, "context_last": last, "real": r.user_turn, "simulated": s.user_turn})
    return out


def plot_lengths(real: list[TurnRecord], sims: list[TurnRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.4), dpi=110)
    bins = np.logspace(0, np.log10(3000), 40)
    for turns, label, color in ((real, "real users", "C0"), (sims, "this simulator", "C3")):
        ax.hist([max(1, len(t.user_turn)) for t in turns], bins=bins, alpha=0.5, label=label, color=color)
    ax.set_xscale("log")
    ax.set_xlabel("turn length (characters, log scale)")
    ax.set_ylabel("turns")
    ax.set_title("Lengths of the user turns for the same held-out contexts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _cell(x: dict | None, key: str = "td") -> str:
    if not x or x.get(key) is None:
        return "not read"
    lo, hi = x[f"{key}_ci95"]
    return f"{x[key]:.1f} [{lo:.1f}, {hi:.1f}]"


def _quote(text: str, limit: int = 240) -> str:
    t = " ".join(str(text).split())
    t = t if len(t) <= limit else t[:limit] + " …"
    return t.replace("|", "\\|") or "(empty)"


def card_text(manifest: dict, report: dict) -> str:
    """The model card's Markdown (pure: tests read it without a model)."""
    cfg = manifest.get("config", {}).get("adversary", {})
    flat = {k: v for part in cfg.values() for k, v in part.items()} if cfg and all(isinstance(v, dict) for v in cfg.values()) else cfg
    base = flat.get("model", "?")
    data = flat.get("data", "?")
    guide = manifest.get("guidance") or {}
    k = guide.get("k", 1)
    rows = report["levels"]
    t = report["tells"]
    head = ["---", "library_name: transformers", "pipeline_tag: text-generation", f"base_model: {base}",
            "tags:", "- user-simulator", "- mimesis-adversarial", "datasets:", f"- {data}", "---", ""]
    lines = head + [
        f"# User simulator exported by mimesis-adversarial ({manifest.get('objective', '?')})",
        "",
        "A causal LM that writes the **next user turn** of a conversation with an AI assistant, trained to read like "
        "the real users of its data (terse, vague, changing their mind), not like an assistant playing a user.",
        "",
        "**For**: a sparring partner for interactive agents (agent RL, evaluation against several simulators), "
        "stress-testing a dialogue system with human-like turns. **Not for**: impersonating people, producing "
        "text presented as written by a person, or as a measure of an agent's quality on its own (evaluate against "
        "more than one simulator). It writes what its data's users wrote, their errors and rudeness included.",
        "",
        "## Use it",
        "",
        "```bash",
        "python -m agent_rl.chat DIR                                   # you play the assistant, it plays the user",
        "python -m agent_rl.serve DIR --port 8000                      # an OpenAI-compatible user-simulator endpoint",
        "python -m generator.simulate --model DIR --limit 200 --out sim.jsonl   # its recorded sampling, unguided",
        "python -m adversary.export verify DIR                         # every file's sha256 against simulator.json",
        "```",
        "",
        "Where it is loaded as `frozen:DIR` (agent training and evaluation, the server, `adversary.compare`) "
        + (f"its guide is on: {k} turns are sampled and one is kept by a calibrated discriminator "
           f"(`frozen:DIR#guidance=1` turns it off; `#guidance=K` sets K)." if k > 1 else
           "it samples one turn (this export carries no guide).")
        + " `AutoModelForCausalLM.from_pretrained(DIR)` loads the weights; the prompt format is "
        f"`generator.prompts` version {manifest.get('prompt_format_version', '?')} (the roles flipped: the model "
        "speaks as the user).",
        "",
        f"Base model: `{base}`. Data: `{data}` (fingerprint `{str(manifest.get('data_fingerprint', '?'))[:12]}`). "
        f"Sampling: {json.dumps(manifest.get('sampling', {}))}.",
        "",
        "## How human it reads",
        "",
        f"Turing distance td = |accuracy - 50| of fresh detectors cross-fitted on {report['n_contexts']} held-out "
        f"contexts (0: indistinguishable from the real users, 50: every turn caught); the panel's maximum over "
        f"{', '.join(report['panel'])}; 95% CIs by group bootstrap; the curve's readings (base model, warm start, best) "
        f"the mean of {report['seeds']['curve']} sampling seed(s), the shipped export's of "
        f"{report['seeds']['shipped']}. Measured {report['date']} on {report['machine']}.",
        "",
        "| simulator | turn td [95% CI] | conversation td [95% CI] | by detector (turn) |",
        "|---|---|---|---|",
    ]
    names = {"base_model": "base model (no training)", "warm_start": "warm start (SFT, step 0)",
             "best": "best checkpoint", "shipped": f"**shipped export** ({'guide K=' + str(k) if k > 1 else 'unguided'})"}
    for key in ("base_model", "warm_start", "best", "shipped"):
        r = rows.get(key)
        label = names[key] + (f" (step {r['step']})" if key == "best" and r and "step" in r else "")
        by = ", ".join(f"{d} {v:.1f}" for d, v in (r or {}).get("detectors", {}).items()) or "-"
        lines.append(f"| {label} | {_cell(r)} | {_cell(r, 'conv_td')} | {by} |")
    lines += ["", "## Its tells", "", "| | this simulator | real users |", "|---|---|---|"]
    lq = t["length_quantiles"]
    lines.append("| length, characters (10/25/50/75/90%) | " + " / ".join(f"{x:.0f}" for x in lq["simulated"]) + " | "
                 + " / ".join(f"{x:.0f}" for x in lq["real"]) + " |")
    for key, label in TELL_KEYS:
        v = t["rates"].get(key, {})
        fmt = lambda x: "-" if x is None or x != x else f"{100 * x:.1f}%"  # noqa: E731
        lines.append(f"| {label} | {fmt(v.get('simulated'))} | {fmt(v.get('real'))} |")
    cues = t["cues"]
    lines += ["", "What a fresh n-gram detector keys on (word n-grams, weight):",
              "- toward **real**: " + ", ".join(f"`{w}` ({c:+.2f})" for w, c in cues["real"]),
              "- toward **simulated**: " + ", ".join(f"`{w}` ({c:+.2f})" for w, c in cues["simulated"]),
              "", f"![lengths]({LENGTHS_FIGURE})", "",
              "## Ten of its turns beside the real ones (same contexts, drawn at random)", "",
              "| the assistant said (end) | the real user | this simulator |", "|---|---|---|"]
    for ex in report["examples"]:
        lines.append(f"| {_quote(ex['context_last'], 120)} | {_quote(ex['real'])} | {_quote(ex['simulated'])} |")
    best = manifest.get("best") or {}
    best_td = f"{best['td']:.1f}" if isinstance(best.get("td"), (int, float)) else "?"
    lines += ["", f"Gate: {manifest.get('gate', {}).get('reason', '?')}; best td {best_td} at step "
              f"{best.get('step', '?')}. The full config, the curve and every file's hash are in `simulator.json`.", ""]
    return "\n".join(lines)


def machine() -> str:
    import os

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} CPU cores ({cpu})"


def write_card(frozen: Path, manifest: dict, levels: dict, real: list[TurnRecord], sims: list[TurnRecord],
               panel: list[str], seeds: dict[str, int]) -> dict:
    """The card and its figure into the export (resealed); returns the report the card was written from. `seeds`:
    sampling seeds a reading is the mean of, {"curve": n, "shipped": n}."""
    from adversary.export import add_files

    report = {"levels": levels, "tells": tells(real, sims), "examples": side_by_side(real, sims),
              "n_contexts": len(real), "panel": list(panel), "seeds": seeds,
              "date": time.strftime("%Y-%m-%d"), "machine": machine()}

    def write(folder: Path) -> None:
        plot_lengths(real, sims, folder / LENGTHS_FIGURE)
        (folder / CARD).write_text(card_text(manifest, report))
        (folder / "realism.json").write_text(json.dumps(report, indent=2, default=float))

    add_files(frozen, write)
    return report


def report_export(cfg: AdversaryConfig, frozen: Path, data, state, base: dict | None, out: Path) -> dict | None:
    """The export read as its users get it (`adversary.card.shipped_reading`), drawn on the curve, and its realism
    report written into it; returns the four readings side by side ({"base_model", "warm_start", "best",
    "shipped"}: `adversary.card.level`), None where `export_report` is off (main process only)."""
    from accelerate import PartialState

    if not cfg.export_report or not PartialState().is_main_process:
        return None
    from adversary.curves import plot_curves
    from adversary.export import read_manifest

    row, sims = shipped_reading(cfg, frozen, data)
    best = state.gate.best
    best_row = next((r for r in state.rows if best is not None and r["step"] == best.step), None)
    levels = {"base_model": level(base), "warm_start": level(state.rows[0]) if state.rows else None,
              "best": level(best_row), "shipped": {**level(row), "guidance": row["guidance"]}}
    write_card(frozen, read_manifest(frozen), levels, list(data.heldout), sims, cfg.heldout_detectors,
               {"curve": cfg.meter_seeds, "shipped": cfg.export_report_seeds})
    plot_curves(state.rows, out / "turing_curve.png", freeze_step=state.rows[-1]["step"] if state.gate.stopped else None,
                best_step=best.step if best else None, shipped=row)
    print(f"[td] shipped export ({'guide K=' + str(row['guidance']) if row['guidance'] > 1 else 'unguided'}): td "
          f"{row['td/panel']:.1f} (95% CI {row['td/ci_low']:.1f}-{row['td/ci_high']:.1f}) on the held-out contexts; "
          f"realism report: {frozen / 'README.md'}", flush=True)
    return levels

"""The Turing-distance curve: `curves.csv` (one row per held-out evaluation) and `turing_curve.png`.

The rows live in the run's state (checkpointed with the gate), and the CSV is rewritten whole from them after every
evaluation, atomically: a resumed run therefore has neither duplicate nor missing rows.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

# the first columns, in order; any other keys (each detector's td, diagnostics) follow sorted
FIRST = ["step", "td/panel", "td/ci_low", "td/ci_high", "td/signed", "td/auc", "td/paired_accuracy", "disc/acc",
         "disc/heldout_acc", "gen/reward", "gen/kl", "diag/truncated_rate", "diag/end_rate"]
# td/* keys that are not a detector's own td
TD_SUMMARY = {"panel", "ci_low", "ci_high", "signed", "auc", "paired_accuracy", "headline", "meter_seconds",
              "eval_seconds", "seeds", "seed_sd", "log_loss"}


def write_curves(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    keys = set().union(*(r.keys() for r in rows)) if rows else set(FIRST)
    columns = [c for c in FIRST if c in keys or c in FIRST] + sorted(keys - set(FIRST))
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in sorted(rows, key=lambda r: r["step"]):
            w.writerow({k: _fmt(r.get(k)) for k in columns})
    os.replace(tmp, path)
    return path


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4f}"
    return "" if v is None else v


def read_curves(path: str | Path) -> list[dict[str, Any]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    out = []
    for r in rows:
        d = {}
        for k, v in r.items():
            if v == "":
                d[k] = None
                continue
            try:
                d[k] = int(v) if k == "step" else float(v)
            except ValueError:
                d[k] = v
        out.append(d)
    return out


def plot_curves(rows: list[dict[str, Any]], path: str | Path, *, freeze_step: int | None = None,
                best_step: int | None = None, title: str = "Held-out Turing distance",
                shipped: dict[str, Any] | None = None) -> Path:
    """The curve; `shipped` (the export read as its users get it: `adversary.card.shipped_reading`) is drawn as its
    own point at the best step, with its CI."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r["step"])
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    if rows:
        td = [r["td/panel"] for r in rows]
        lo = [r.get("td/ci_low") if r.get("td/ci_low") is not None else r["td/panel"] for r in rows]
        hi = [r.get("td/ci_high") if r.get("td/ci_high") is not None else r["td/panel"] for r in rows]
        ax.fill_between(steps, lo, hi, alpha=0.2, color="C0", label="panel td 95% CI")
        seeds = rows[-1].get("td/seeds") or 1
        ax.plot(steps, td, "-o", color="C0", lw=2, label="panel td (max over detectors)" +
                (f", mean of {seeds} sampling seeds" if seeds > 1 else ", one sampling seed"))
        detectors = sorted({k[len("td/"):] for r in rows for k in r if k.startswith("td/") and k[3:] not in TD_SUMMARY})
        for i, name in enumerate(detectors, start=1):
            ax.plot(steps, [r.get(f"td/{name}") for r in rows], "--", lw=1, color=f"C{i}", label=f"{name}")
        if any(r.get("conv/td") is not None for r in rows):  # the conversation level, beside the turns
            n_conv = next((r["conv/conversations"] for r in rows if r.get("conv/conversations") is not None), None)
            ax.plot(steps, [r.get("conv/td") for r in rows], "s", color="black", lw=1.5,
                    label="conversation td" + (f" ({n_conv:.0f} conversations)" if n_conv is not None else ""))
        for key, style, label in (("disc/acc", ":", "training discriminator |acc-50|"),
                                  ("disc/heldout_acc", "-.", "training discriminator |acc-50|, fresh pairs")):
            if any(r.get(key) is not None for r in rows):
                ax.plot(steps, [abs(r[key] * 100 - 50) if r.get(key) is not None else None for r in rows], style,
                        color="gray", lw=1, label=label)
    if shipped is not None:
        x = best_step if best_step is not None else (steps[-1] if steps else 0)
        td = shipped["td/panel"]
        err = [[td - shipped["td/ci_low"]], [shipped["td/ci_high"] - td]]
        k = shipped.get("guidance") or 1
        ax.errorbar([x], [td], yerr=err, fmt="*", ms=14, color="crimson", capsize=4,
                    label=f"shipped export ({'guide K=' + str(k) if k > 1 else 'unguided'}): td {td:.1f}")
    if best_step is not None:
        ax.axvline(best_step, color="green", lw=1, alpha=0.7, label=f"best (exported) step {best_step}")
    if freeze_step is not None:
        ax.axvline(freeze_step, color="red", lw=1.5, label=f"gate freeze step {freeze_step}")
    ax.set_xlabel("generator step")
    ax.set_ylabel("td = |accuracy - 50|  (0 = indistinguishable)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_study(study: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(study["arms"])
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=120)
    plateau = study.get("plateau") or []
    if plateau:
        steps = [r["step"] for r in plateau]
        ax0.plot(steps, [r["td"] for r in plateau], "-o", color="C0", label="held-out td (validation contexts)")
        ax0.fill_between(steps, [r["td_ci95"][0] for r in plateau], [r["td_ci95"][1] for r in plateau], alpha=0.2)
        ax0.set_xlabel("SFT step")
        ax0.set_ylabel("td")
        ax0b = ax0.twinx()
        ax0b.plot(steps, [r["val_ppl"] for r in plateau], "--s", color="C1", label="validation perplexity")
        ax0b.set_ylabel("perplexity")
        ax0.set_title("warm start: SFT to its plateau")
        ax0.legend(loc="upper right", fontsize=8)
        ax0b.legend(loc="center right", fontsize=8)
    tds = [study["arms"][a]["td"] for a in arms]
    lo = [study["arms"][a]["td"] - study["arms"][a]["td_ci95"][0] for a in arms]
    hi = [study["arms"][a]["td_ci95"][1] - study["arms"][a]["td"] for a in arms]
    ax1.bar(arms, tds, yerr=[lo, hi], capsize=6, color=[f"C{i}" for i in range(len(arms))])
    for i, a in enumerate(arms):
        ax1.text(i, 0.5, f"T={study['arms'][a]['temperature']}\n{study['arms'][a]['steps']} steps", ha="center",
                 fontsize=7, color="white")
    ax1.set_ylabel("held-out td (panel max), 95% CI")
    ax1.set_title(f"{study['n_contexts']} test contexts per arm, {study['arm_seconds']:.0f}s of training each")
    ax1.tick_params(axis="x", labelsize=7, rotation=15)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

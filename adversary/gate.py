"""The gate: decides when the generator is frozen, and which checkpoint is exported.

Pure logic (no torch), so the rules have exact tests. A reading is the held-out Turing distance of one evaluation.
- target: the reading is at or below `target_td`;
- plateau: the smoothed curve (mean of the last `smooth` readings, which damps single noisy readings) has not fallen
  below its best by more than `min_delta` for `patience` evaluations in a row;
- max_steps: the step budget ran out.
The exported checkpoint is the best reading (lowest TD; the earlier one on ties), never simply the last.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Reading:
    step: int
    td: float
    ci_low: float | None = None
    ci_high: float | None = None


@dataclass
class Decision:
    stop: bool
    reason: str | None  # "target" | "plateau" | "max_steps" | None
    is_best: bool


@dataclass
class PlateauGate:
    patience: int = 3
    min_delta: float = 1.0
    target_td: float = 0.0
    max_steps: int | None = None
    smooth: int = 2
    readings: list[Reading] = field(default_factory=list)
    best_smoothed: float | None = None
    stale: int = 0
    best: Reading | None = None
    stopped: bool = False
    reason: str | None = None

    def __post_init__(self):
        if self.patience < 1:
            raise ValueError(f"gate patience must be >= 1, got {self.patience}")
        if self.min_delta < 0:
            raise ValueError(f"gate min_delta must be >= 0, got {self.min_delta}")
        if self.smooth < 1:
            raise ValueError(f"gate smooth must be >= 1, got {self.smooth}")

    def smoothed(self) -> float:
        window = self.readings[-self.smooth :]
        return sum(r.td for r in window) / len(window)

    def update(self, reading: Reading) -> Decision:
        if self.readings and reading.step <= self.readings[-1].step:
            raise ValueError(f"gate readings must come in step order: {reading.step} after {self.readings[-1].step}")
        self.readings.append(reading)
        is_best = self.best is None or reading.td < self.best.td
        if is_best:
            self.best = reading
        s = self.smoothed()
        if self.best_smoothed is None or s < self.best_smoothed - self.min_delta:
            self.best_smoothed = s
            self.stale = 0
        else:
            self.stale += 1
        reason = None
        if reading.td <= self.target_td:
            reason = "target"
        elif self.stale >= self.patience:
            reason = "plateau"
        elif self.max_steps is not None and reading.step >= self.max_steps:
            reason = "max_steps"
        if reason:
            self.stopped, self.reason = True, reason
        return Decision(stop=reason is not None, reason=reason, is_best=is_best)

    def finish(self, step: int, reason: str = "max_steps") -> None:
        """Training ended without the gate firing: its budget (`reason`: max_steps, max_rounds, phase_seconds) ran out."""
        if not self.stopped:
            self.stopped, self.reason = True, reason

    def describe(self) -> str:
        if self.reason == "target":
            return f"target: held-out td {self.readings[-1].td:.1f} <= target {self.target_td}"
        if self.reason == "plateau":
            return (f"plateau: smoothed td did not improve by {self.min_delta} for {self.patience} evaluations "
                    f"(best smoothed {self.best_smoothed:.1f})")
        if self.reason == "max_steps":
            return "max_steps: step budget spent"
        return "running"

    # checkpointing: the whole state is plain data
    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, d: dict) -> "PlateauGate":
        d = dict(d)
        readings = [Reading(**r) for r in d.pop("readings", [])]
        best = d.pop("best", None)
        g = cls(**d)
        g.readings = readings
        g.best = Reading(**best) if best else None
        return g

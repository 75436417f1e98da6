"""Detectors and the Turing-distance meter (docs/turing-distance.md).

- `discriminator.turing.measure_td(real_items, sim_items, detectors=..., folds=5, seed=0)`: the meter.
- `discriminator.neural.NeuralDetector`: pair classifier over (context tail, user turn), trainable online.
- `discriminator.classical.ClassicalDetector` / `StyleDetector`: scikit-learn detectors.

Names are imported lazily, so `import discriminator.turing` with the fast panel never loads torch.
"""

from __future__ import annotations

from conversations.lazy import lazy_exports

_EXPORTS = {
    "NeuralDetector": "discriminator.neural",
    "ClassicalDetector": "discriminator.classical",
    "StyleDetector": "discriminator.classical",
    "measure_td": "discriminator.turing",
    "make_detector": "discriminator.turing",
    "turing_distance": "discriminator.turing",
    "grouped_folds": "discriminator.turing",
    "bootstrap_ci": "discriminator.turing",
}

__all__ = list(_EXPORTS)

__getattr__ = lazy_exports("discriminator", _EXPORTS)

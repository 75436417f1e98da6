"""Linear layers of a frozen bf16 inference copy on a CPU, their weights packed once in oneDNN's blocked layout.

A bf16 `F.linear` on a CPU hands oneDNN a plain row-major weight, and oneDNN reorders it into its blocked layout at
every call: at the few rows of a decoding step that reorder costs as much as the product. Measured on a 2-core AMD
EPYC (AVX512-BF16, no AMX), SmolLM2-135M's 210 decoder matrices at 8 rows: 21-22 ms a pass plain, 12.5-13.9 ms packed
(1.6-1.7x); at 64 rows 1.25x; at 2,000 rows the same. The products are the same to the bit (the same kernel runs on
the same blocks). torch's own inductor packs weights this way when it freezes a model; `pack_linears` does it without
compiling. Whether packing helps is measured once per process on this CPU (`packing_helps`, ~0.1 s), never assumed;
`MIMESIS_CPU_PACK=0` or `1` overrides the measurement."""

from __future__ import annotations

import os
import time
from functools import lru_cache

PACK_ROWS = 8  # the row count oneDNN is told to expect: a decoding step's (products at other counts stay exact)
PACK_MIN_GAIN = 1.1  # packed must beat plain by this much in the probe


def _ops_available() -> bool:
    import torch

    mkldnn = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                    and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def packing_helps() -> bool:
    """Whether packed bf16 linear layers beat plain ones by `PACK_MIN_GAIN` at a decoding step's rows on this CPU
    (measured once per process), or what `MIMESIS_CPU_PACK` (0 or 1) says."""
    forced = os.environ.get("MIMESIS_CPU_PACK")
    if forced in ("0", "1"):
        return forced == "1" and _ops_available()
    return _ops_available() and _measured_gain() >= PACK_MIN_GAIN


@lru_cache(maxsize=1)
def _measured_gain() -> float:
    """plain / packed seconds: best of 5 rounds of 10 products of a (1536, 576) weight at 8 rows, interleaved."""
    import torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 576, generator=g).bfloat16()
    x = torch.randn(PACK_ROWS, 576, generator=g).bfloat16()
    p = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
    best = {"plain": float("inf"), "packed": float("inf")}
    with torch.inference_mode():
        for _ in range(5):
            for name, f in (("plain", lambda: torch.nn.functional.linear(x, w)),
                            ("packed", lambda: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))):
                t0 = time.perf_counter()
                for _ in range(10):
                    f()
                best[name] = min(best[name], time.perf_counter() - t0)
    return best["plain"] / best["packed"]


def _module_class():
    import torch

    class PackedLinear(torch.nn.Module):
        """An inference-only `nn.Linear` whose weight lives packed (no autograd, no state_dict entry for it)."""

        def __init__(self, linear: torch.nn.Linear, tied: bool):
            super().__init__()
            self.in_features, self.out_features = linear.in_features, linear.out_features
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS)  # opaque layout
            if tied:  # an output layer tied to the input embedding keeps the shared weight: it costs nothing
                self.weight = linear.weight
            self.bias = None if linear.bias is None else linear.bias.detach()

        def forward(self, x):
            if x.dtype != torch.bfloat16:  # as autocast would run it: the product in bf16
                x = x.to(torch.bfloat16)
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

        def extra_repr(self) -> str:
            return f"in_features={self.in_features}, out_features={self.out_features}, packed"

    return PackedLinear


def pack_linears(model) -> int:
    """Replace every plain `nn.Linear` of a frozen bf16 CPU model with a packed one, in place, where this CPU gains
    from it (`packing_helps`); returns how many were replaced (0: the model is left as it was). For inference copies
    only: the replaced layers have no dense weight (a tied output layer keeps the input embedding's), so a state_dict
    lacks them, and no autograd."""
    import torch

    linears = [(name, m) for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    if not linears or any(m.weight.dtype != torch.bfloat16 or m.weight.device.type != "cpu" or m.weight.requires_grad
                          for _, m in linears):
        return 0
    if not packing_helps():
        return 0
    cls = _module_class()
    elsewhere = {id(p) for m in model.modules() if type(m) is not torch.nn.Linear
                 for p in m.parameters(recurse=False)}  # weights another module shares (a tied embedding)
    for name, m in linears:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, cls(m, tied=id(m.weight) in elsewhere))
    return len(linears)

"""Numeric precision, chosen once per process from what the hardware does fast, and applied the same way by every stage.

`resolve_precision(dtype)` turns a config value (`auto`, `bf16`, `fp16`, `fp32`) into one of `"bf16"`, `"fp16"`,
`"fp32"`:
- on a GPU, `auto` is bf16 where supported, else fp16;
- on a CPU, `auto` is bf16 when a bf16 matmul beats an fp32 one on this CPU by `FAST_RATIO` or more (Intel AMX,
  some AVX512-BF16 parts), fp32 otherwise. The answer comes from a one-off micro-benchmark (~1 s), cached on disk by
  CPU model, flags, thread count and torch version; `MIMESIS_CPU_BF16=1` or `=0` forces it either way (tests force
  the fallback this way).

How it is applied, which matters on a CPU (measured, docs/benchmarks.md):
- training keeps fp32 master weights and runs forward/backward under autocast, through the libraries' own switches
  (`bf16=True` with `use_cpu` in TRL/transformers configs: accelerate's `mixed_precision`);
- generation and scoring with frozen weights use a bf16 copy of the weights (`inference_dtype`): autocast re-casts
  every weight at every call, which cost a third of a decoding step;
- our own loops that run trainable fp32 weights outside a trainer (the discriminator, agent rollouts) use `autocast`.

This lives in the data layer because the generator, the discriminator and the adversary all read it and data flows
one way.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from functools import lru_cache

from conversations.config import ConfigError

DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32")
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
# bf16 has to beat fp32 by this much to be worth its rounding on a CPU
FAST_RATIO = 1.5
ENV_FORCE = "MIMESIS_CPU_BF16"


def normalise_dtype(dtype: str) -> str:
    d = _ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if d not in DTYPE_CHOICES:
        raise ConfigError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPE_CHOICES)}); fix it in the YAML "
                          "config or with --dtype on the command line")
    return d


def _on_cuda(device) -> bool:
    import torch

    if device is None:
        return torch.cuda.is_available()
    return str(device).startswith("cuda")


def resolve_precision(dtype: str = "auto", device=None) -> str:
    """`"bf16"`, `"fp16"` or `"fp32"` for `dtype` on `device` (None: the GPU if there is one, else the CPU)."""
    import torch

    d = normalise_dtype(dtype)
    if _on_cuda(device):
        if d == "auto":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return d
    if d == "fp16":
        raise ConfigError("dtype fp16 needs a GPU (on a CPU use bf16 or fp32); fix it in the YAML config or with "
                          "--dtype on the command line")
    if d == "auto":
        return "bf16" if cpu_bf16_is_fast() else "fp32"
    return d


def torch_dtype(precision: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def inference_dtype(precision: str):
    """Weights for frozen generation or scoring: the precision's own dtype (a bf16 copy, not autocast)."""
    return torch_dtype(precision)


def autocast(precision: str, device="cpu"):
    """A context that runs fp32 weights in `precision` (a no-op for fp32)."""
    import torch

    if precision == "fp32":
        return contextlib.nullcontext()
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    return torch.autocast(kind, dtype=torch_dtype(precision))


def trainer_precision_kwargs(precision: str, device=None) -> dict:
    """The TrainingArguments fields (TRL's configs inherit them) that make a trainer run in `precision`."""
    return {"bf16": precision == "bf16", "fp16": precision == "fp16", "use_cpu": not _on_cuda(device)}


def run_precision(dtype: str, training_args=None, cli: set[str] | frozenset = frozenset(),
                  preset: set[str] | frozenset = frozenset()) -> str:
    """The one precision of a run, from `dtype` (auto | bf16 | fp16 | fp32) and the trainer flags `bf16` / `fp16`
    when a user set them: the command line over the YAML preset; on one level, a flag that contradicts `dtype` is
    refused. `cli` / `preset`: the keys set on each (`conversations.config.given_keys`)."""
    d = normalise_dtype(dtype)
    if training_args is None:
        return resolve_precision(d)
    flag = "bf16" if getattr(training_args, "bf16", False) else "fp16" if getattr(training_args, "fp16", False) else "fp32"
    for level in (cli, preset):
        has_flag, has_dtype = bool(level & {"bf16", "fp16"}), "dtype" in level
        if has_flag and has_dtype and d not in ("auto", flag):
            raise ConfigError(f"dtype {d} contradicts bf16={training_args.bf16}, fp16={training_args.fp16}; set one of "
                              "them (dtype: auto | bf16 | fp32 is enough) in the YAML config or on the command line")
        if has_flag:
            return resolve_precision(flag)
        if has_dtype:
            return resolve_precision(d)
    return resolve_precision(d)


def apply_precision(training_args, precision: str) -> None:
    """Make a parsed TrainingArguments (TRL's configs inherit it) run in `precision`, setting the fields its
    `__post_init__` derives from bf16/fp16 the same way (rebuilding the config would re-run TRL's checks on fields
    that it has already filled in)."""
    for k, v in trainer_precision_kwargs(precision).items():
        setattr(training_args, k, v)
    training_args.mixed_precision = {"bf16": "bf16", "fp16": "fp16"}.get(precision, "no")


# ------------------------------------------------------------------------------------------------ the CPU probe


def _cpu_fingerprint() -> dict:
    import torch

    model, flags = platform.processor() or "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and not model.strip():
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {
        "cpu": model,
        "flags": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2"}),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def measure_cpu_matmul(n: int = 1024, reps: int = 8) -> dict:
    """GFLOP/s of an n x n matmul in fp32 and under bf16 autocast, best of `reps`, on this process's threads."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    out = {}
    for name, ctx in (("fp32", contextlib.nullcontext), ("bf16", lambda: torch.autocast("cpu", dtype=torch.bfloat16))):
        with ctx():
            a @ b  # warm-up: the kernel choice and any packing
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - t0)
        out[name] = 2 * n**3 / best / 1e9
    return out


@lru_cache(maxsize=1)
def cpu_bf16_is_fast() -> bool:
    """Whether bf16 beats fp32 by `FAST_RATIO` on this CPU (cached on disk; `MIMESIS_CPU_BF16` overrides)."""
    forced = os.environ.get(ENV_FORCE)
    if forced in ("0", "1"):
        return forced == "1"
    fp = _cpu_fingerprint()
    if not ({"avx512_bf16", "amx_bf16"} & set(fp["flags"])):
        return False  # bf16 is emulated in software there: never faster
    from conversations.packages import cache_dir

    path = cache_dir() / "precision.json"
    try:
        cached = json.loads(path.read_text())
        if cached.get("fingerprint") == fp:
            return bool(cached["bf16_fast"])
    except (OSError, ValueError, KeyError):
        pass
    rates = measure_cpu_matmul()
    fast = rates["bf16"] >= FAST_RATIO * rates["fp32"]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"fingerprint": fp, "gflops": rates, "bf16_fast": fast}, indent=2))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the probe again next time
    return fast

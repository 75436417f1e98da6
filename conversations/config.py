"""Typed dataclass configs with YAML presets and command-line overrides (TRL's `TrlParser` underneath).

`parse_config((ArgsA, ArgsB), argv)` reads `--config FILE.yaml` (we own `--config`; `accelerate` owns `--config_file`),
checks every YAML key against the dataclass fields (an unknown key or a value of the wrong type is a `ConfigError`
naming the file and key), then lets `--key value` on the command line override it. Validation in each dataclass's
`__post_init__` raises `ConfigError` with a message that says how to fix the value.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from conversations.schema import DataError


class ConfigError(DataError):
    """A bad config value: names the file or flag and the key, says what would be valid."""


def in_range(value: Any, spec: str) -> bool:
    """`spec`: ">= 1", "> 0", "<= 50", "[0, 1)", "(0, 1]", "-1 or >= 1"."""
    if " or " in spec:
        return any(in_range(value, part) for part in spec.split(" or "))
    spec = spec.strip()
    if spec[0] in "[(":
        lo, hi = (float(x) for x in spec[1:-1].split(","))
        return (value >= lo if spec[0] == "[" else value > lo) and (value <= hi if spec[-1] == "]" else value < hi)
    for op in (">=", "<=", ">", "<"):
        if spec.startswith(op):
            b = float(spec[len(op):])
            return {">=": value >= b, "<=": value <= b, ">": value > b, "<": value < b}[op]
    try:
        return value == float(spec)
    except ValueError:
        raise ValueError(f"bad range spec {spec!r}") from None


def check_ranges(obj: Any, ranges: dict[str, str]) -> None:
    """Raise a `ConfigError` naming the first field of `obj` outside its range (None values are not checked)."""
    for key, spec in ranges.items():
        value = getattr(obj, key, None)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not in_range(value, spec):
            said = f"in {spec}" if spec[0] in "[(" else spec
            raise ConfigError(f"{key} must be {said}, got {value}; fix it in the YAML config or with --{key} on the "
                              "command line")


# the values we pass on to transformers / TRL that they reject late (a traceback from the optimiser) or never (a
# negative step count runs as if it meant something); checked for any config that has the field
TRAINER_RANGES = {
    "learning_rate": "> 0", "max_steps": "-1 or >= 1", "num_train_epochs": "> 0", "per_device_train_batch_size": ">= 1",
    "gradient_accumulation_steps": ">= 1", "logging_steps": "> 0", "save_steps": "> 0", "eval_steps": "> 0",
    "save_total_limit": ">= 1", "warmup_steps": ">= 0", "weight_decay": ">= 0", "max_grad_norm": ">= 0", "seed": ">= 0",
    "adam_beta1": "[0, 1)", "adam_beta2": "[0, 1)", "adam_epsilon": "> 0",
    # GRPO
    "num_generations": ">= 2", "max_completion_length": ">= 1", "temperature": "> 0", "top_p": "(0, 1]", "beta": ">= 0",
    "epsilon": "> 0", "num_iterations": ">= 1", "steps_per_generation": ">= 1", "generation_batch_size": ">= 1",
}


def _field_types(dataclass_types) -> dict[str, Any]:
    out = {}
    for t in dataclass_types:
        hints = typing.get_type_hints(t)
        for f in dataclasses.fields(t):
            if f.init:
                out[f.name] = hints.get(f.name, f.type)
    return out


def _type_ok(value: Any, tp: Any) -> bool:
    if tp is Any or value is None and _optional(tp):
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return isinstance(value, (list, tuple)) and (not args or all(_type_ok(v, args[0]) for v in value))
    if origin is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is bool:
        return isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if isinstance(tp, type):
        return isinstance(value, tp) or issubclass(tp, (dict, list)) is False and isinstance(value, (str, int, float))
    return True


def _optional(tp: Any) -> bool:
    return type(None) in typing.get_args(tp)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def load_yaml_config(path: str | Path, dataclass_types) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.exists():
        raise ConfigError("config file not found", str(p))
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise ConfigError(f"invalid YAML ({getattr(e, 'problem', e)})", where) from None
    if not isinstance(data, dict):
        raise ConfigError("a config file must be a YAML mapping of key: value", str(p))
    data.pop("env", None)
    known = _field_types(dataclass_types)
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown key '{key}'{hint}", str(p))
        if not _type_ok(value, known[key]):
            raise ConfigError(
                f"key '{key}' must be of type {_type_name(known[key])}, got {type(value).__name__} {value!r}", str(p)
            )
    return data


def given_keys(argv: list[str] | None = None) -> tuple[set[str], set[str]]:
    """The keys a user set, (on the command line, in the `--config` YAML file): to tell a value a user chose from a
    library's default (e.g. TRL's `bf16`), and the command line from the preset."""
    import yaml

    argv = list(sys.argv[1:] if argv is None else argv)
    cli = {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--") and a != "--config"}
    preset: set[str] = set()
    if "--config" in argv and argv.index("--config") + 1 < len(argv):
        try:
            data = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text(encoding="utf-8")) or {}
            preset = set(data) if isinstance(data, dict) else set()
        except (OSError, yaml.YAMLError):
            pass  # parse_config reports it
    return cli, preset


def parse_config(dataclass_types, argv: list[str] | None = None, prog: str | None = None,
                 defaults: dict[str, Any] | None = None):
    """Parse `--config FILE` and `--key value` overrides into instances of `dataclass_types` (a tuple). `defaults`
    replace the dataclasses' own defaults (a YAML preset and the command line still override them). On a machine
    without a GPU, trainer configs default to `use_cpu: true` (transformers refuses bf16 on a CPU without it)."""
    from trl import TrlParser

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = TrlParser(dataclass_types, prog=prog)
    for action in parser._actions:  # argparse formats help with %: a "15-20% more" in a field's help broke --help
        if action.help and "%" in action.help and "%(" not in action.help:
            action.help = action.help.replace("%", "%%")
    if defaults:
        parser.set_defaults(**defaults)
    if "use_cpu" in _field_types(dataclass_types):
        import torch

        if not torch.cuda.is_available():
            parser.set_defaults(use_cpu=True)
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ConfigError("--config needs a YAML file path")
        path = argv[i + 1]
        data = load_yaml_config(path, dataclass_types)
        del argv[i : i + 2]
        parser.set_defaults_with_config(**data)
    from transformers import TrainingArguments

    trainer_config = any(isinstance(t, type) and issubclass(t, TrainingArguments) for t in dataclass_types)
    if trainer_config:  # before the configs are built: their own checks would fire first, without naming the key
        import argparse

        ns, _ = argparse.ArgumentParser.parse_known_args(parser, args=argv)
        check_ranges(ns, TRAINER_RANGES)
    try:
        return parser.parse_args_into_dataclasses(args=argv)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from None


def to_jsonable(obj: Any) -> Any:
    """A resolved config (one dataclass or several) as plain JSON data, for checkpoints and manifests."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if hasattr(obj, "to_dict"):
            try:
                return to_jsonable(obj.to_dict())
            except Exception:  # noqa: BLE001 - fall back to the fields
                pass
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def dump_config(obj: Any, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_jsonable(obj), indent=2, sort_keys=True))

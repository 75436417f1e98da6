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


def given_keys(argv: list[str] | None = None) -> set[str]:
    """The keys a user set: those of the `--config` YAML file and every `--key` on the command line (to tell a value
    a user chose from a library's default, e.g. TRL's `bf16`)."""
    import yaml

    argv = list(sys.argv[1:] if argv is None else argv)
    keys = {a[2:].split("=", 1)[0].replace("-", "_") for a in argv if a.startswith("--") and a != "--config"}
    if "--config" in argv and argv.index("--config") + 1 < len(argv):
        try:
            data = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text(encoding="utf-8")) or {}
            keys |= set(data) if isinstance(data, dict) else set()
        except (OSError, yaml.YAMLError):
            pass  # parse_config reports it
    return keys


def parse_config(dataclass_types, argv: list[str] | None = None, prog: str | None = None):
    """Parse `--config FILE` and `--key value` overrides into instances of `dataclass_types` (a tuple). On a machine
    without a GPU, trainer configs default to `use_cpu: true` (transformers refuses bf16 on a CPU without it)."""
    from trl import TrlParser

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = TrlParser(dataclass_types, prog=prog)
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
    try:
        return parser.parse_args_into_dataclasses(args=argv)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


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

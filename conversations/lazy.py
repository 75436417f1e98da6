"""Lazy package exports: a package names what it offers without importing it (so `import generator.prompts` does not
load torch through the package's __init__)."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str]):
    """The package's module-level `__getattr__`: `exports` maps a name to the module that defines it."""

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module '{package}' has no attribute {name!r}")

    return __getattr__

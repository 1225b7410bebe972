"""Working with several vLLM versions: pass only the keywords a class or function accepts, and
record what the tree has (Features, written into each result). Standard library only."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Mapping


def accepts(fn_or_cls, name: str) -> bool:
    """Does this vLLM callable (or dataclass) take a keyword argument `name`?"""
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(fn_or_cls).parameters
    except (TypeError, ValueError):
        params = {}
    if name in params:
        return True
    if dataclasses.is_dataclass(fn_or_cls):
        return name in {f.name for f in dataclasses.fields(fn_or_cls)}
    return False


def kw(fn_or_cls, **kwargs):
    """Keep only the keyword arguments this version accepts."""
    return {k: v for k, v in kwargs.items() if accepts(fn_or_cls, k)}


class Features(dict):
    """What this vLLM tree has, detected by feature (recorded in the result)."""

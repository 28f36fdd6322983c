"""Checks of the arguments users pass to bbio's calls: pure functions, not collective.

A collective call first makes sure every rank passed the same arguments
(:func:`bbio.mpi.same_arguments`); these then raise the same
:class:`~bbio.errors.UsageError` on every rank for a bad one, instead of a
``TypeError`` from deep inside.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Any

import numpy as np

from bbio.errors import UsageError


def integer_argument(name: str, value: Any, minimum: int, path: Path | None = None) -> int:
    """``value`` as an ``int`` of at least ``minimum``, else a :class:`UsageError` naming the
    argument ``name`` (and ``path``).  Booleans and floats are refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise UsageError(
            f"{name} must be an integer, not {value!r} ({type(value).__name__})",
            path=path,
            hint=f"pass {name} as an int",
        )
    if value < minimum:
        raise UsageError(f"{name} must be at least {minimum}, not {value}", path=path)
    return int(value)


def seconds_argument(name: str, value: Any) -> float | None:
    """``value`` as seconds (None: no limit), else a :class:`UsageError` naming the argument
    ``name``: a number of at least 0, not a boolean nor NaN."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise UsageError(
            f"{name} must be a number of seconds or None, not {value!r} ({type(value).__name__})"
        )
    if not value >= 0:
        raise UsageError(f"{name} must be at least 0 seconds, not {value}")
    return float(value)


def path_argument(what: str, value: Any) -> str:
    """``value`` (a ``str`` or a path) as a string, else a :class:`UsageError` naming the
    argument ``what`` (such as ``"stage-in: the source"``)."""
    if not isinstance(value, (str, os.PathLike)) or not isinstance(os.fspath(value), str):
        raise UsageError(f"{what} must be a str or a path, not {type(value).__name__}")
    return os.fspath(value)

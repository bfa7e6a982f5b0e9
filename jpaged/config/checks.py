"""Checks of values that come from users: request fields, sampling parameters, config fields.

Every checker returns the value normalised to a plain Python type (numpy scalars become Python
ones) or raises: TypeError for a wrong type, ValueError for a value out of range. The message
names the field, shows the value and gives the allowed range, e.g.
``SamplingParams.seed: must be in [0, 4294967296), got -1``. Bools are never numbers here and
floats are never integers, even when integral (``2.0`` is refused where an int is expected).
Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable

import numpy as np

INT32_LIMIT = 2**31  # device arrays are int32: ids, counts and positions stay below this
UINT32_LIMIT = 2**32  # seeds are uint32 on the device
FLOAT32_MAX = float(np.finfo(np.float32).max)  # sampling settings are float32 on the device


def show(value: Any, limit: int = 60) -> str:
    """A short repr of `value` for error messages."""
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ must not hide the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _range_text(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    lo, hi = (None if x is None else _number(x) for x in (lo, hi))
    if lo is None and hi is None:
        return "any value"
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo}"
    if lo is None:
        return f"{'<' if hi_open else '<='} {hi}"
    return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def _out_of_range(value: float, lo, hi, lo_open: bool, hi_open: bool) -> bool:
    if lo is not None and (value <= lo if lo_open else value < lo):
        return True
    return hi is not None and (value >= hi if hi_open else value > hi)


def is_int(value: Any) -> bool:
    """True for Python and numpy integers, False for bools (and everything else)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(field: str, value: Any, lo: int | None = None, hi: int | None = None, *, hi_open: bool = False) -> int:
    """`value` as a Python int in [lo, hi] ([lo, hi) with `hi_open`)."""
    if not is_int(value):
        raise TypeError(f"{field}: must be an int {_range_text(lo, hi, hi_open=hi_open)}, "
                        f"got {type(value).__name__} {show(value)}")
    value = int(value)
    if _out_of_range(value, lo, hi, False, hi_open):
        raise ValueError(f"{field}: must be {_range_text(lo, hi, hi_open=hi_open)}, got {value}")
    return value


def check_float(field: str, value: Any, lo: float | None = None, hi: float | None = None, *,
                lo_open: bool = False, hi_open: bool = False) -> float:
    """`value` (a real number, not a bool) as a finite Python float in the given range."""
    text = _range_text(lo, hi, lo_open, hi_open)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{field}: must be a finite number {text}, got {type(value).__name__} {show(value)}")
    try:
        number = float(value)
    except (OverflowError, ValueError):  # an int too large for a float
        raise ValueError(f"{field}: must be a finite number {text}, got {show(value)}") from None
    if not math.isfinite(number) or _out_of_range(number, lo, hi, lo_open, hi_open):
        raise ValueError(f"{field}: must be a finite number {text}, got {show(value)}")
    return number


def check_bool(field: str, value: Any) -> bool:
    """`value` as a Python bool (ints such as 1 are refused: they are usually another field's value)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{field}: must be True or False, got {type(value).__name__} {show(value)}")
    return bool(value)


def check_choice(field: str, value: Any, choices: Iterable[Any]) -> Any:
    """`value` if it is one of `choices` (compared by type and value: 1 is not True)."""
    choices = tuple(choices)
    for choice in choices:
        if type(value) is type(choice) and value == choice:
            return choice
    raise ValueError(f"{field}: must be one of {list(choices)}, got {show(value)}")


def check_str(field: str, value: Any, *, optional: bool = False) -> str | None:
    """`value` as a plain str (None allowed with `optional`)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        allowed = "a str or None" if optional else "a str"
        raise TypeError(f"{field}: must be {allowed}, got {type(value).__name__} {show(value)}")
    return str(value)  # a str subclass becomes a plain str: hashing and encoding stay ordinary


def check_token_ids(field: str, value: Any, vocab_size: int | None = None, *, allow_empty: bool = False) -> list[int]:
    """Token ids as a list of Python ints in [0, vocab_size) ([0, 2**31) without a vocabulary).

    Accepts a list / tuple / range of ints (Python or numpy integers) or a 1-D integer numpy
    array; bools and floats are refused, even integral ones (no silent truncation).
    """
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise TypeError(f"{field}: must be 1-D, got an array of shape {value.shape}")
        if value.dtype.kind not in "iu":
            raise TypeError(f"{field}: must hold integers, got an array of dtype {value.dtype}")
        ids = value.tolist()
    elif isinstance(value, (list, tuple, range)):
        ids = list(value)
        if not all(type(t) is int for t in ids):  # the common case is checked at C speed
            for i, token in enumerate(ids):
                if not is_int(token):
                    raise TypeError(f"{field}[{i}]: must be an int token id, got {type(token).__name__} {show(token)}")
            ids = [int(t) for t in ids]
    else:
        raise TypeError(f"{field}: must be a list of int token ids or a 1-D integer numpy array, "
                        f"got {type(value).__name__} {show(value)}")
    if not ids:
        if allow_empty:
            return ids
        raise ValueError(f"{field}: is empty")
    limit = INT32_LIMIT if vocab_size is None else vocab_size
    if min(ids) < 0 or max(ids) >= limit:
        i = next(i for i, t in enumerate(ids) if not 0 <= t < limit)
        where = f"the vocabulary [0, {limit})" if vocab_size is not None else f"[0, {limit})"
        raise ValueError(f"{field}[{i}]: token id {ids[i]} is outside {where}")
    return ids

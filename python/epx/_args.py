"""Argument checks shared by the Python wrappers: errors raised here read like the C++ ones
("epx invalid_argument: <argument>: <what is wrong>") and are ``epx.InvalidArgumentError`` (a ``ValueError``)."""

from __future__ import annotations

from typing import Any, List

import numpy as np

from . import _epx
from ._tensors import is_torch


def invalid_argument(message: str) -> _epx.InvalidArgumentError:
    err = _epx.InvalidArgumentError(f"epx invalid_argument: {message}")
    err.code = "invalid_argument"
    return err


def enum_arg(cls, value: Any, arg: str):
    """``value`` if it is a ``cls`` member, else the member of that name."""
    if isinstance(value, cls):
        return value
    try:
        return cls[value]
    except (KeyError, TypeError):
        raise invalid_argument(f"{arg}: {value!r} is not one of {', '.join(m.name for m in cls)}") from None


def int_list(values: Any, arg: str) -> List[int]:
    """A 1-D sequence of integers (list, numpy array, torch tensor) as Python ints."""
    if is_torch(values):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise invalid_argument(f"{arg}: expected a 1-D sequence of integers, got {array.dtype} {array.shape}")
    return [int(v) for v in array]

"""epx.tbo: two-batch overlap (the contract: include/epx/tbo.h).

A batch is split into two micro-batches A and B whose operations interleave, so one's communication hides
under the other's compute:

1. where to split: ``compute_tbo_split`` (by forward mode), ``compute_tbo_split_extend``,
   ``compute_tbo_split_decode``;
2. the children's per-sequence fields: ``split_tbo_children``;
3. the stage executor: ``execute_two_batch_overlap`` runs two lists of Python callables cut into stages at
   ``YIELD`` points: A's first ``delta_stages`` stages, then A and B alternately, then B's tail.

Operations are ``Operation(name, fn)``, plain callables ``fn(batch_idx)`` (0 = A, 1 = B), ``(name, fn)``
pairs, or ``YIELD`` / None for a yield point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union


from . import _epx
from ._epx.dp import ForwardMode
from ._epx.tbo import (  # noqa: F401
    DEFAULT_THRESHOLD,
    TboChildren,
    TboSeqFields,
    TboSplit,
    split_tbo_children,
)
from ._args import enum_arg, int_list, invalid_argument

_native = _epx.tbo

__all__ = [
    "DEFAULT_THRESHOLD", "ForwardMode", "Operation", "TboChildren", "TboSeqFields", "TboSplit", "YIELD",
    "compute_tbo_split", "compute_tbo_split_decode", "compute_tbo_split_extend", "execute_two_batch_overlap",
    "split_stages", "split_tbo_children",
]


@dataclass(frozen=True)
class Operation:
    """One step of a micro-batch's forward pass; ``fn`` None makes it a yield point (ends a stage)."""

    name: str
    fn: Optional[Callable[[int], Any]]

    @property
    def is_yield(self) -> bool:
        return self.fn is None


#: A yield point: ends the current stage.
YIELD = Operation("yield", None)

OperationLike = Union[Operation, Callable[[int], Any], Tuple[str, Optional[Callable[[int], Any]]], None]


def _operation(op: OperationLike) -> Operation:
    if isinstance(op, Operation):
        return op
    if op is None:
        return YIELD
    if isinstance(op, tuple) and len(op) == 2 and isinstance(op[0], str):
        return Operation(op[0], op[1])
    if callable(op):
        return Operation(getattr(op, "__name__", "op"), op)
    raise invalid_argument(f"operation: expected Operation, a callable, (name, fn) or None, got {op!r}")


def _native_ops(ops: Sequence[OperationLike]) -> Tuple[List[Operation], List[Tuple[str, Any]]]:
    converted = [_operation(op) for op in ops]
    return converted, [(op.name, op.fn) for op in converted]


def compute_tbo_split_extend(extend_lens: Sequence[int], threshold: float = DEFAULT_THRESHOLD) -> TboSplit:
    """Extend (prefill) batch, ``extend_lens[i]`` new tokens of sequence i.

    The balanced sequence boundary (scanning while ``|left - right|`` does not grow; ties move right); if
    its left part is outside ``[threshold, 1 - threshold]`` of the tokens, one sequence is cut at
    ``total // 2`` (``two_chunk``), unless A would then hold more sequences than tokens. ``threshold`` in
    [0, 0.5], 0 never cuts.
    """
    return _native.compute_tbo_split_extend(int_list(extend_lens, "extend_lens"), threshold)


def compute_tbo_split_decode(num_tokens: int, tokens_per_seq: int = 1) -> TboSplit:
    """Decode / target-verify batch of ``num_tokens = num_seqs * tokens_per_seq``: split at ``num_seqs // 2``."""
    return _native.compute_tbo_split_decode(num_tokens, tokens_per_seq)


def compute_tbo_split(mode: Union[ForwardMode, str], num_tokens: int, extend_lens: Sequence[int] = (),
                      tokens_per_seq: int = 1, threshold: float = DEFAULT_THRESHOLD) -> Optional[TboSplit]:
    """By forward mode: EXTEND and MIXED -> the extend rule; DECODE / TARGET_VERIFY -> the decode rule; IDLE and
    PREBUILT -> (0, 0) (num_tokens must be 0); DRAFT_EXTEND -> None (TBO off)."""
    return _native.compute_tbo_split(enum_arg(ForwardMode, mode, "mode"), num_tokens, int_list(extend_lens, "extend_lens"), tokens_per_seq, threshold)


def split_stages(ops: Sequence[OperationLike]) -> List[List[Operation]]:
    """Cuts ``ops`` at its yield points into stages. A trailing yield adds no empty stage; consecutive yields
    give an empty one."""
    converted, native = _native_ops(ops)
    return [[converted[i] for i in stage] for stage in _native.split_tbo_stages(native)]


def execute_two_batch_overlap(ops_a: Sequence[OperationLike], ops_b: Sequence[OperationLike],
                              delta_stages: int = 0) -> None:
    """Runs the stages of A and B on the calling thread.

    Order: A's first ``delta_stages`` stages, then (A stage i + delta, B stage i) alternately, then B's last
    ``delta_stages`` stages. Each ``fn(batch_idx)`` gets 0 for A's list and 1 for B's, so one list can serve
    both. Both lists need the same number of stages and ``0 <= delta_stages <= stages``
    (``epx.InvalidArgumentError`` before anything runs). An exception from an operation propagates at once;
    later operations do not run. The GIL is released between operations.
    """
    _, a = _native_ops(ops_a)
    _, b = _native_ops(ops_b)
    _native.execute_two_batch_overlap(a, b, delta_stages)

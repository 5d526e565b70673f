"""Two-batch overlap: split rules and stage executor (epx/tbo.h)."""

from collections.abc import Sequence

import epx._epx.dp


DEFAULT_THRESHOLD: float = 0.48

class TboSplit:
    """Where a batch is cut into micro-batches A and B."""

    def __init__(self, split_seq_index: int = 0, split_token_index: int = 0, two_chunk: bool = False) -> None: ...

    @property
    def split_seq_index(self) -> int:
        """A holds sequences [0, split_seq_index) (and the cut one if two_chunk)."""

    @split_seq_index.setter
    def split_seq_index(self, arg: int, /) -> None: ...

    @property
    def split_token_index(self) -> int:
        """A holds tokens [0, split_token_index)."""

    @split_token_index.setter
    def split_token_index(self, arg: int, /) -> None: ...

    @property
    def two_chunk(self) -> bool:
        """Sequence split_seq_index is cut in two at split_token_index."""

    @two_chunk.setter
    def two_chunk(self, arg: bool, /) -> None: ...

    def __eq__(self, arg: TboSplit, /) -> bool: ...

    def __repr__(self) -> str: ...

def compute_tbo_split_extend(extend_lens: Sequence[int], threshold: float = 0.48) -> TboSplit:
    """
    Extend (prefill) batch: the balanced sequence boundary, or a cut sequence (two_chunk) when the balanced left part is outside [threshold, 1 - threshold] of the tokens. threshold in [0, 0.5] (0: never cut).
    """

def compute_tbo_split_decode(num_tokens: int, tokens_per_seq: int = 1) -> TboSplit:
    """
    Decode / target-verify batch of num_tokens = num_seqs * tokens_per_seq: splits at num_seqs // 2.
    """

def compute_tbo_split(mode: epx._epx.dp.ForwardMode, num_tokens: int, extend_lens: Sequence[int] = [], tokens_per_seq: int = 1, threshold: float = 0.48) -> TboSplit | None:
    """
    By forward mode: EXTEND and MIXED -> the extend rule; DECODE / TARGET_VERIFY -> the decode rule; IDLE and PREBUILT -> (0, 0); DRAFT_EXTEND -> None (TBO off).
    """

class TboSeqFields:
    """Per-sequence fields of a batch: seq_lens = prefix_lens + extend_lens."""

    def __init__(self, extend_lens: Sequence[int], prefix_lens: Sequence[int], seq_lens: Sequence[int]) -> None: ...

    @property
    def extend_lens(self) -> list[int]:
        """New tokens of each sequence in this batch."""

    @extend_lens.setter
    def extend_lens(self, arg: Sequence[int], /) -> None: ...

    @property
    def prefix_lens(self) -> list[int]:
        """Tokens already in the KV cache before this batch."""

    @prefix_lens.setter
    def prefix_lens(self, arg: Sequence[int], /) -> None: ...

    @property
    def seq_lens(self) -> list[int]:
        """Total length after this batch."""

    @seq_lens.setter
    def seq_lens(self, arg: Sequence[int], /) -> None: ...

    @property
    def num_seqs(self) -> int: ...

    def __repr__(self) -> str: ...

class TboChildren:
    """The two micro-batches of a split."""

    @property
    def a(self) -> TboSeqFields: ...

    @property
    def b(self) -> TboSeqFields: ...

    @property
    def num_tokens_a(self) -> int: ...

    @property
    def num_tokens_b(self) -> int: ...

    @property
    def seq_begin_b(self) -> int:
        """Parent index of B's first sequence (the cut sequence when two_chunk)."""

def split_tbo_children(parent: TboSeqFields, split: TboSplit) -> TboChildren:
    """
    The children's per-sequence fields. Raises InvalidArgumentError when the fields are inconsistent or the split does not fit the batch.
    """

def split_tbo_stages(ops: Sequence[tuple[str, object]]) -> list[list[int]]:
    """
    Cuts [(name, fn or None)] at its yield points (fn None): the indices of each stage's operations. A trailing yield adds no empty stage; consecutive yields give an empty one.
    """

def execute_two_batch_overlap(ops_a: Sequence[tuple[str, object]], ops_b: Sequence[tuple[str, object]], delta_stages: int) -> None:
    """
    Runs the stages of A and B on this thread: A's first delta_stages stages, then (A stage i + delta, B stage i) alternately, then B's last delta_stages stages. fn(batch_idx) gets 0 for A, 1 for B. Both lists need the same number of stages and 0 <= delta_stages <= stages (InvalidArgumentError before running). An exception from an operation propagates at once.
    """

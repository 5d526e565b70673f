"""DP attention: rank layout, gather/scatter, batch metadata (epx/dp.h)."""

from collections.abc import Sequence
import enum

import epx._epx


class ParallelSizes:
    """
    Parallel sizes of attention (dp x cp x tp) and MoE (dp x ep x tp) over the same world_size ranks; 0 = derived by ParallelLayout.
    """

    def __init__(self, world_size: int = 1, attn_dp_size: int = 1, attn_cp_size: int = 1, attn_tp_size: int = 0, moe_ep_size: int = 0, moe_dp_size: int = 1, moe_tp_size: int = 0) -> None: ...

    @property
    def world_size(self) -> int: ...

    @world_size.setter
    def world_size(self, arg: int, /) -> None: ...

    @property
    def attn_dp_size(self) -> int: ...

    @attn_dp_size.setter
    def attn_dp_size(self, arg: int, /) -> None: ...

    @property
    def attn_cp_size(self) -> int: ...

    @attn_cp_size.setter
    def attn_cp_size(self, arg: int, /) -> None: ...

    @property
    def attn_tp_size(self) -> int:
        """0: world_size / (attn_dp_size * attn_cp_size)."""

    @attn_tp_size.setter
    def attn_tp_size(self, arg: int, /) -> None: ...

    @property
    def moe_ep_size(self) -> int:
        """0: world_size / (moe_dp_size * moe_tp_size)."""

    @moe_ep_size.setter
    def moe_ep_size(self, arg: int, /) -> None: ...

    @property
    def moe_dp_size(self) -> int: ...

    @moe_dp_size.setter
    def moe_dp_size(self, arg: int, /) -> None: ...

    @property
    def moe_tp_size(self) -> int:
        """
        0: world_size / (moe_ep_size * moe_dp_size); 1 when moe_ep_size is 0 too.
        """

    @moe_tp_size.setter
    def moe_tp_size(self, arg: int, /) -> None: ...

    def __repr__(self) -> str: ...

class RankCoords:
    """A rank's coordinates in the attention and MoE layouts."""

    @property
    def attn_tp_rank(self) -> int: ...

    @property
    def attn_cp_rank(self) -> int: ...

    @property
    def attn_dp_rank(self) -> int: ...

    @property
    def moe_tp_rank(self) -> int: ...

    @property
    def moe_ep_rank(self) -> int: ...

    @property
    def moe_dp_rank(self) -> int: ...

    def __repr__(self) -> str: ...

class ParallelGroupKind(enum.Enum):
    """Which sub-groups ParallelLayout.groups() lists."""

    attn_tp = 0

    attn_cp = 1

    attn_dp = 2

    moe_tp = 3

    moe_ep = 4

    moe_dp = 5

class ParallelLayout:
    """
    Rank arithmetic of DP attention (include/epx/dp.h):
      attention rank = (attn_dp_rank * attn_cp + attn_cp_rank) * attn_tp + attn_tp_rank
      MoE rank       = (moe_dp_rank * moe_ep + moe_ep_rank) * moe_tp + moe_tp_rank
    """

    def __init__(self, world_size: int, attn_dp_size: int = 1, attn_cp_size: int = 1, attn_tp_size: int = 0, moe_ep_size: int = 0, moe_dp_size: int = 1, moe_tp_size: int = 0) -> None:
        """
        Derives the 0 sizes and checks every product equals world_size (1 to 1024); raises InvalidArgumentError naming the size and the product it broke.
        """

    @staticmethod
    def create(sizes: ParallelSizes) -> ParallelLayout: ...

    @staticmethod
    def pure_dp(world_size: int) -> ParallelLayout:
        """
        Every rank its own DP rank: attn_dp = world, attn_tp = attn_cp = 1, moe_ep = world.
        """

    @property
    def sizes(self) -> ParallelSizes:
        """The sizes with every 0 derived."""

    @property
    def world_size(self) -> int: ...

    @property
    def attn_dp_size(self) -> int: ...

    @property
    def attn_tp_size(self) -> int: ...

    @property
    def attn_cp_size(self) -> int: ...

    def coords(self, rank: int) -> RankCoords: ...

    def attn_rank(self, attn_dp_rank: int, attn_cp_rank: int, attn_tp_rank: int) -> int: ...

    def dp_leader(self, attn_dp_rank: int) -> int:
        """
        The rank that contributes DP rank attn_dp_rank's data (attn_tp_rank 0, attn_cp_rank 0).
        """

    def is_dp_leader(self, rank: int) -> bool: ...

    def groups(self, kind: ParallelGroupKind) -> list[list[int]]:
        """
        All groups of one kind, each an ascending list of ranks, ordered by their first rank.
        """

    def group_of(self, kind: ParallelGroupKind, rank: int) -> list[int]: ...

    def __repr__(self) -> str: ...

class DpPaddingMode(enum.Enum):
    """How DP ranks' tokens sit in the global buffer."""

    MAX_LEN = 0
    """Each DP rank padded to the max count; all-gather."""

    SUM_LEN = 1
    """Each DP rank at its prefix offset in a zeroed buffer; all-reduce."""

def choose_padding_mode(num_tokens_per_dp_rank: Sequence[int], is_extend_in_batch: bool = False, in_cuda_graph: bool = False, symmetric_a2a: bool = False) -> DpPaddingMode:
    """
    The mode of one step. First match wins: symmetric_a2a -> MAX_LEN; in_cuda_graph -> MAX_LEN; extend with more than one DP rank -> SUM_LEN; MAX_LEN iff 2 * sum >= max * num_dp_ranks; else SUM_LEN.
    """

class DpGatherPlan:
    """Where every DP rank's tokens sit in the global buffer [buffer_len, H]."""

    @property
    def mode(self) -> DpPaddingMode: ...

    @property
    def buffer_len(self) -> int:
        """Rows of the global buffer."""

    @property
    def slot_len(self) -> int:
        """MAX_LEN: rows per DP rank; SUM_LEN: 0."""

    @property
    def num_tokens(self) -> list[int]:
        """[num_dp_ranks] rows each DP rank contributes."""

    @property
    def offsets(self) -> list[int]:
        """[num_dp_ranks] first row of each DP rank's tokens."""

    def __repr__(self) -> str: ...

def plan_dp_gather(num_tokens_per_dp_rank: Sequence[int], mode: DpPaddingMode, attn_tp_size: int = 1) -> DpGatherPlan:
    """
    MAX_LEN: slot_len = max count rounded up to attn_tp_size, offsets[d] = d * slot_len. SUM_LEN: offsets are the exclusive prefix sums. Raises InvalidArgumentError for negative counts or sizes out of range.
    """

class DpGatherSource(enum.Enum):
    """What dp_gather takes from a DP rank's attention-TP ranks."""

    leader = 0
    """The leader's rows (every TP rank holds the same batch)."""

    partial_sums = 1
    """
    The sum of the TP ranks' rows (partial sums, e.g. before the o_proj all-reduce); either padding mode.
    """

def dp_gather(group: epx._epx.Group, layout: ParallelLayout, plan: DpGatherPlan, local: object, global_buffer: object, stream: object | None = None, source: DpGatherSource = DpGatherSource.leader, cp_shard_counts: Sequence[int] = []) -> None:
    """
    Collective: global_buffer [plan.buffer_len, H] on every rank receives each DP rank's first num_tokens[d] rows of its leader's local (source leader) or of the sum over its attention-TP ranks' locals (source partial_sums, either padding mode) at offsets[d]; other rows are zeroed. With attention CP and cp_shard_counts ([attn_cp_size], this DP rank's) each CP rank's first cp_shard_counts[c] rows land back to back in CP rank order. Contiguous. GIL released.
    """

class DpScatterKind(enum.Enum):
    """What dp_scatter's global buffer holds."""

    slice = 0
    """The same buffer on every rank: take this DP rank's rows."""

    reduce_scatter = 1
    """Partial buffers: sum over ranks (fp32, rank order)."""

def dp_scatter(group: epx._epx.Group, layout: ParallelLayout, plan: DpGatherPlan, global_buffer: object, local: object, kind: DpScatterKind = DpScatterKind.slice, stream: object | None = None, cp_shard_counts: Sequence[int] = []) -> None:
    """
    Collective: local [>= num_tokens[my DP rank], H] receives this DP rank's rows of global_buffer (slice) or of the sum of every rank's global_buffer (reduce_scatter); rows past the count are zeroed. slice with cp_shard_counts: only this CP rank's shard. GIL released.
    """

class ZigzagSplit:
    """
    SGLang's zigzag split of a prefill batch over the attention-CP ranks (plan_zigzag_split).
    """

    @property
    def cp_size(self) -> int: ...

    @property
    def seq_lens(self) -> list[int]:
        """[num_seqs] extend lengths as split (padding joins the last)."""

    @property
    def seq_offsets(self) -> list[int]:
        """[num_seqs] first batch row of each sequence."""

    @property
    def block_lens(self) -> list[int]:
        """[num_seqs * 2 * cp_size] block lengths, sequence-major."""

    @property
    def num_tokens(self) -> list[int]:
        """[cp_size] rows each CP rank holds."""

    @property
    def max_rank_len(self) -> int: ...

    @property
    def padded_rank_len(self) -> int:
        """max_rank_len rounded up to 2 * cp_size."""

    def __repr__(self) -> str: ...

def can_zigzag_split(extend_seq_lens: Sequence[int], cp_size: int, mode: ForwardMode, num_tokens: int) -> bool:
    """
    SGLang's ZigzagCPStrategy.can_apply: cp_size > 1, EXTEND or MIXED, num_tokens >= 2 * cp_size and every extend length >= 2 * cp_size.
    """

def plan_zigzag_split(extend_seq_lens: Sequence[int], cp_size: int, num_tokens: int = -1) -> ZigzagSplit:
    """
    Each sequence cut into 2 * cp_size blocks (the first L % (2 cp) one row longer); CP rank c holds blocks c and 2 cp - 1 - c. num_tokens (-1: the sum) adds its padding rows to the last sequence.
    """

def zigzag_local_rows(split: ZigzagSplit, cp_rank: int) -> list[int]:
    """
    [num_tokens[cp_rank]] the batch row of each of the CP rank's rows (early blocks of every sequence, then late blocks).
    """

def zigzag_gathered_rows(split: ZigzagSplit) -> list[int]:
    """
    [total rows] each batch row's row once the CP ranks' rows lie back to back in CP rank order (its row relative to the DP rank's offset after dp_gather with cp_shard_counts = split.num_tokens).
    """

class CpStrategy(enum.Enum):
    """
    SGLang's --cp-strategy: how the attention-CP ranks split a prefill batch.
    """

    zigzag = 0
    """2 * cp blocks per sequence; rank c holds blocks c and 2 cp - 1 - c."""

    interleave = 1
    """Round-robin: batch row i on rank i % cp."""

def parse_cp_strategy(cp_strategy: str) -> CpStrategy:
    """
    "zigzag" or "interleave" (SGLang's ContextParallelStrategyKind.from_string).
    """

def can_cp_split(strategy: CpStrategy, extend_seq_lens: Sequence[int], cp_size: int, mode: ForwardMode, num_tokens: int) -> bool:
    """The strategy's can_apply: can_zigzag_split or can_interleave_split."""

class InterleaveSplit:
    """
    SGLang's interleave (round-robin) split of a prefill batch over the attention-CP ranks (plan_interleave_split).
    """

    @property
    def cp_size(self) -> int: ...

    @property
    def seq_lens(self) -> list[int]:
        """[num_seqs] extend lengths (padding rows join none)."""

    @property
    def seq_offsets(self) -> list[int]:
        """[num_seqs] first batch row of each sequence."""

    @property
    def num_batch_tokens(self) -> int:
        """Rows dealt out, padding included."""

    @property
    def num_real_batch_tokens(self) -> int:
        """Sum of seq_lens; rows past are padding."""

    @property
    def num_tokens(self) -> list[int]:
        """[cp_size] rows each CP rank holds (the cp_shard_counts)."""

    @property
    def num_real_tokens(self) -> list[int]:
        """[cp_size] how many of them are real rows."""

    @property
    def max_rank_len(self) -> int: ...

    @property
    def padded_rank_len(self) -> int:
        """max_rank_len rounded up to cp_size."""

    def __repr__(self) -> str: ...

class InterleaveQueries:
    """
    Attention metadata of a CP rank's real rows (interleave_local_queries).
    """

    @property
    def seq_idx(self) -> list[int]:
        """[num_real_tokens[cp_rank]] the sequence of each real row."""

    @property
    def kv_lens(self) -> list[int]:
        """
        [num_real_tokens[cp_rank]] its causal KV length: prefix_lens[s] + (row - seq_offsets[s]) + 1.
        """

def can_interleave_split(cp_size: int, mode: ForwardMode, num_tokens: int) -> bool:
    """
    SGLang's InterleaveCPStrategy.can_apply: cp_size > 1, EXTEND or MIXED and num_tokens >= cp_size.
    """

def plan_interleave_split(extend_seq_lens: Sequence[int], cp_size: int, num_tokens: int = -1) -> InterleaveSplit:
    """
    Batch row i on CP rank i % cp_size as its local row i // cp_size. num_tokens (-1: the sum) adds padding rows at the end, dealt out like the others.
    """

def interleave_local_rows(split: InterleaveSplit, cp_rank: int) -> list[int]:
    """
    [num_tokens[cp_rank]] the batch rows of the CP rank: cp_rank, cp_rank + cp_size, ... (ascending).
    """

def interleave_gathered_rows(split: InterleaveSplit, real_rows_only: bool = False) -> list[int]:
    """
    [num_batch_tokens] each batch row's row once the CP ranks' rows lie back to back in CP rank order (SGLang's restore_indices; relative to the DP rank's offset after dp_gather with cp_shard_counts = split.num_tokens). real_rows_only: [num_real_batch_tokens] over the real rows (restore_real_indices).
    """

def interleave_local_queries(split: InterleaveSplit, cp_rank: int, prefix_lens: Sequence[int] = []) -> InterleaveQueries:
    """
    The sequence and causal KV length of each of the CP rank's real rows (SGLang's query_request_indices / query_cache_lengths); prefix_lens [num_seqs] (empty: 0).
    """

class ForwardMode(enum.Enum):
    """The kind of batch a DP rank runs in a step."""

    IDLE = 0

    EXTEND = 1

    DECODE = 2

    MIXED = 3

    TARGET_VERIFY = 4

    DRAFT_EXTEND = 5

    PREBUILT = 6

BATCH_METADATA_FIELDS: int = 11

class BatchMetadata:
    """
    One DP rank's record for a step (11 fields, exchanged as 11 int64 per rank). The constructor's defaults are an IDLE record with every vote 1; idle() is the record of a rank with no batch, which votes can_run_prefill_graph = 0 as SGLang's does.
    """

    def __init__(self, *, num_tokens: int = 0, num_tokens_for_logprob: int = 0, can_run_decode_graph: bool = True, is_extend_in_batch: bool = False, can_run_tbo: bool = True, forward_mode: ForwardMode = ForwardMode.IDLE, can_run_prefill_graph: bool = True, prefill_graph_max_prefix_len: int = 0, can_run_draft_graph: bool = True, is_health_check: bool = False, attention_pairs: int = 0) -> None: ...

    @staticmethod
    def idle() -> BatchMetadata:
        """
        IDLE, 0 tokens; decode-graph, draft-graph and TBO votes 1, prefill-graph vote 0 (one idle DP rank turns the prefill graph off for the step, as in SGLang).
        """

    @staticmethod
    def prebuilt() -> BatchMetadata:
        """PREBUILT (disaggregated decode), 0 tokens: see include/epx/dp.h."""

    @property
    def num_tokens(self) -> int: ...

    @num_tokens.setter
    def num_tokens(self, arg: int, /) -> None: ...

    @property
    def num_tokens_for_logprob(self) -> int: ...

    @num_tokens_for_logprob.setter
    def num_tokens_for_logprob(self, arg: int, /) -> None: ...

    @property
    def can_run_decode_graph(self) -> bool: ...

    @can_run_decode_graph.setter
    def can_run_decode_graph(self, arg: bool, /) -> None: ...

    @property
    def is_extend_in_batch(self) -> bool: ...

    @is_extend_in_batch.setter
    def is_extend_in_batch(self, arg: bool, /) -> None: ...

    @property
    def can_run_tbo(self) -> bool: ...

    @can_run_tbo.setter
    def can_run_tbo(self, arg: bool, /) -> None: ...

    @property
    def forward_mode(self) -> ForwardMode: ...

    @forward_mode.setter
    def forward_mode(self, arg: ForwardMode, /) -> None: ...

    @property
    def can_run_prefill_graph(self) -> bool: ...

    @can_run_prefill_graph.setter
    def can_run_prefill_graph(self, arg: bool, /) -> None: ...

    @property
    def prefill_graph_max_prefix_len(self) -> int: ...

    @prefill_graph_max_prefix_len.setter
    def prefill_graph_max_prefix_len(self, arg: int, /) -> None: ...

    @property
    def can_run_draft_graph(self) -> bool: ...

    @can_run_draft_graph.setter
    def can_run_draft_graph(self, arg: bool, /) -> None: ...

    @property
    def is_health_check(self) -> bool: ...

    @is_health_check.setter
    def is_health_check(self, arg: bool, /) -> None: ...

    @property
    def attention_pairs(self) -> int: ...

    @attention_pairs.setter
    def attention_pairs(self, arg: int, /) -> None: ...

    def __repr__(self) -> str: ...

class GlobalBatchInfo:
    """The agreed view of one step, identical on every rank."""

    @property
    def num_tokens(self) -> list[int]:
        """[num_dp_ranks]"""

    @property
    def num_tokens_for_logprob(self) -> list[int]:
        """[num_dp_ranks]"""

    @property
    def attention_pairs(self) -> list[int]:
        """[num_dp_ranks]"""

    @property
    def can_run_decode_graph(self) -> bool:
        """min over DP ranks"""

    @property
    def can_run_prefill_graph(self) -> bool:
        """min"""

    @property
    def can_run_draft_graph(self) -> bool:
        """min"""

    @property
    def is_extend_in_batch(self) -> bool:
        """max"""

    @property
    def is_health_check(self) -> bool:
        """max"""

    @property
    def prefill_graph_max_prefix_len(self) -> int:
        """max"""

    @property
    def forward_mode(self) -> ForwardMode | None:
        """
        The common mode of the non-idle DP ranks; IDLE when all are idle; None when they disagree.
        """

    @property
    def can_run_tbo(self) -> bool:
        """
        min of the votes, the non-idle ranks agree on a mode, and some rank is not idle.
        """

    @property
    def any_tokens(self) -> bool:
        """Some DP rank has tokens: every rank runs a batch."""

    def __repr__(self) -> str: ...

class BatchSyncResult:
    """The local result of one BatchMetadataSync.sync()."""

    @property
    def global_info(self) -> GlobalBatchInfo: ...

    @property
    def run_idle_batch(self) -> bool:
        """
        This rank has no batch but must run an idle one (global_info.any_tokens).
        """

    @property
    def runs_batch(self) -> bool:
        """This rank runs a batch (its own or an idle one)."""

    @property
    def step_wait_s(self) -> float:
        """Seconds this sync waited for the slowest rank."""

    @property
    def wait_s(self) -> float:
        """
        This sync's wait plus the carried waits of earlier syncs in which this rank ran no batch.
        """

class BatchMetadataSync:
    """
    Per-rank, stateful batch-metadata sync: one all-gather of the records per step (skipped when attn_dp_size == 1). Not thread-safe; one per rank.
    """

    def __init__(self, group: epx._epx.Group, layout: ParallelLayout) -> None:
        """
        Raises InvalidArgumentError unless layout.world_size == group.num_ranks. Keeps the group alive.
        """

    def sync(self, local: BatchMetadata | None, inactive_ranks: Sequence[int] | None = None) -> BatchSyncResult:
        """
        Collective. local: this rank's record, or None for a rank with no batch. inactive_ranks: None or the group ranks (ints) that are dead or absent this step, the same list on every calling rank: they are not waited for and each DP rank whose leader is listed counts as BatchMetadata.idle() (SGLang's fallback record; host backend only, UnsupportedError on cuda). Raises InvalidArgumentError for a bad record or list (before communicating; a list that differs between ranks on every rank that compares them), TimeoutError from the group. A wrong-typed argument raises TypeError naming it after this rank took part with an error flag (host backend: every peer's sync raises PeerFailureError at once). GIL released.
        """

    @property
    def carried_wait_s(self) -> float: ...

def reduce_batch_metadata(records: Sequence[BatchMetadata]) -> GlobalBatchInfo:
    """
    The reductions of sync() alone: one record per DP rank -> GlobalBatchInfo. Raises InvalidArgumentError for an empty list.
    """

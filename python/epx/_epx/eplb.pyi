"""Expert-parallel load balancing (include/epx/eplb/*.h)."""

from collections.abc import Sequence
import enum
from typing import Annotated

import numpy
from numpy.typing import NDArray

import epx._epx
import epx._epx.dp


class Policy(enum.Enum):
    """EPLB placement policy (include/epx/eplb/placement.h)."""

    deepseek = 0
    """DeepSeek's published EPLB, reproduced exactly."""

    default = 1
    """kDeepSeek improved by swaps and moves; never less balanced."""

def policy_from_string(name: str) -> Policy:
    """
    'deepseek' or 'default' -> Policy; raises InvalidArgumentError otherwise.
    """

class Placement:
    """
    Which logical expert each physical slot holds, per layer. Arrays are copies (numpy, int32).
    """

    @property
    def num_layers(self) -> int: ...

    @property
    def num_logical(self) -> int: ...

    @property
    def num_physical(self) -> int: ...

    @property
    def max_replicas(self) -> int:
        """The largest replica count over all layers and experts."""

    @property
    def hierarchical(self) -> bool:
        """Groups were packed onto nodes (num_groups % num_nodes == 0)."""

    @property
    def phy2log(self) -> NDArray[numpy.int32]:
        """
        int32 [num_layers, num_physical]: the logical expert of each physical slot.
        """

    @property
    def log2phy(self) -> NDArray[numpy.int32]:
        """
        int32 [num_layers, num_logical, max_replicas]: the slots of each logical expert, -1 padded.
        """

    @property
    def logcnt(self) -> NDArray[numpy.int32]:
        """
        int32 [num_layers, num_logical]: replica count of each logical expert (>= 1).
        """

    def __repr__(self) -> str: ...

def rebalance(weight: object, num_physical: int, num_gpus: int, num_groups: int = 1, num_nodes: int = 1, policy: Policy = Policy.default) -> Placement:
    """
    A fresh placement for weight [num_layers, num_logical] (loads >= 0). Hierarchical when num_groups % num_nodes == 0. Raises InvalidArgumentError naming the broken bound.
    """

class MigrationResult:
    """A migration-aware placement and what it moved."""

    @property
    def placement(self) -> Placement: ...

    @property
    def moved_experts(self) -> int:
        """Slots whose expert changes w.r.t. current, all layers."""

    @property
    def fresh_moved_experts(self) -> int:
        """The same count for the fresh 'default' placement."""

    @property
    def fresh_balancedness(self) -> float:
        """Balancedness of the fresh placement under weight."""

def rebalance_migration_aware(weight: object, current_phy2log: object, num_physical: int, num_gpus: int, num_groups: int = 1, num_nodes: int = 1, max_balance_loss: float = 0.01) -> MigrationResult:
    """
    Like rebalance(policy='default') but keeps experts of current_phy2log [num_layers, num_physical] in place unless moving buys more than max_balance_loss of balancedness per layer.
    """

def placement_from_phy2log(phy2log: object, num_logical: int) -> Placement:
    """
    Derives log2phy (slot order), logcnt and max_replicas from phy2log [num_layers, num_physical].
    """

def balancedness_per_layer(weight: object, phy2log: object, num_gpus: int) -> NDArray[numpy.float64]:
    """
    float64 [num_layers]: mean GPU load / max GPU load of each layer (1 for a layer without load).
    """

def balancedness(weight: object, phy2log: object, num_gpus: int) -> float:
    """The mean of balancedness_per_layer."""

def count_moved_experts(old_phy2log: object, new_phy2log: object) -> int:
    """
    Slots whose logical expert differs between two placements of equal shape, all layers.
    """

def trivial_phy2log(num_layers: int, num_logical: int, num_physical: int) -> NDArray[numpy.int32]:
    """
    int32 [num_layers, num_physical]: slot i holds logical expert i % num_logical.
    """

class ExpertLocation:
    """
    Where each layer's experts live at run time (include/epx/eplb/expert_location.h). Slot s lives on GPU
    s // slots_per_gpu, GPU g on node g // gpus_per_node. A value: copies are independent.
    """

    def __init__(self, num_gpus: int, num_nodes: int, phy2log: object, num_logical: int) -> None:
        """
        From phy2log [num_layers, num_physical]. Raises InvalidArgumentError when an expert has no replica, slots do not divide over GPUs or GPUs over nodes.
        """

    @staticmethod
    def trivial(num_layers: int, num_logical: int, num_physical: int, num_gpus: int, num_nodes: int = 1) -> ExpertLocation:
        """Slot i holds logical expert i % num_logical in every layer."""

    @staticmethod
    def from_placement(placement: Placement, num_gpus: int, num_nodes: int) -> ExpertLocation: ...

    @staticmethod
    def from_json(text: str) -> ExpertLocation:
        """
        Parses to_json()'s text; raises InvalidArgumentError naming the bad field.
        """

    def to_json(self) -> str:
        """
        JSON {num_layers, num_logical, num_physical, num_gpus, num_nodes, phy2log: [[...] per layer]}.
        """

    @property
    def num_layers(self) -> int: ...

    @property
    def num_logical(self) -> int: ...

    @property
    def num_physical(self) -> int: ...

    @property
    def num_gpus(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def slots_per_gpu(self) -> int: ...

    @property
    def gpus_per_node(self) -> int: ...

    @property
    def max_replicas(self) -> int:
        """The largest replica count over all layers and experts."""

    def gpu_of_slot(self, slot: int) -> int: ...

    @property
    def phy2log_table(self) -> Annotated[NDArray[numpy.int32], dict(writable=False)]:
        """
        int32 [num_layers, num_physical], read-only; unchanged by later set_layer() calls.
        """

    def phy2log(self, layer: int) -> NDArray[numpy.int32]:
        """int32 [num_physical]: the logical expert of each slot of `layer`."""

    def replicas(self, layer: int, expert: int) -> NDArray[numpy.int32]:
        """int32 [replica_count]: the slots holding `expert`, ascending."""

    def replica_count(self, layer: int, expert: int) -> int: ...

    def set_layer(self, layer: int, phy2log: object) -> None:
        """Replaces one layer's placement (int [num_physical]); validated."""

    def __eq__(self, arg: ExpertLocation, /) -> bool: ...

    def __copy__(self) -> ExpertLocation: ...

    def __deepcopy__(self, memo: object) -> ExpertLocation: ...

    def __repr__(self) -> str: ...

class ReplicaChoice(enum.Enum):
    """How a token picks one replica of each of its logical experts."""

    static = 0
    """A local replica if any, else one fixed per (source GPU, expert)."""

    dynamic = 1
    """Uniform among the replicas, hashed per (seed, layer, token, k)."""

def choose_replicas(location: ExpertLocation, layer: int, topk_logical: object, gpu: int, mode: ReplicaChoice = ReplicaChoice.static, seed: int = 0, rank_invariant: bool = False, first_token: int = 0) -> NDArray[numpy.int64]:
    """
    int64 [num_tokens, num_topk]: the physical slot of each logical id of topk_logical [num_tokens, num_topk] (-1 stays -1) for a token on `gpu`.
    """

class DeviceReplicaTable:
    """
    An ExpertLocation's replica lists on one CUDA device, for choose_replicas on device tensors. Immutable: upload a new one after a rebalance.
    """

    @staticmethod
    def upload(location: ExpertLocation, device: int, stream: object | None = None) -> DeviceReplicaTable: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def num_logical(self) -> int: ...

    @property
    def num_physical(self) -> int: ...

    @property
    def num_gpus(self) -> int: ...

    @property
    def device(self) -> int: ...

def choose_replicas_device(table: DeviceReplicaTable, layer: int, topk_logical: object, topk_physical: object, gpu: int, mode: ReplicaChoice = ReplicaChoice.static, seed: int = 0, rank_invariant: bool = False, first_token: int = 0, stream: object | None = None) -> None:
    """
    Writes topk_physical (the dtype and shape of topk_logical, int32 or int64, on the table's device; may be topk_logical itself) on `stream`, choosing as choose_replicas does; ids outside [-1, num_logical) give -1.
    """

class RecordMode(enum.Enum):
    """What the load recorder keeps besides per-step counts."""

    stat = 0
    """Per-step counts only."""

    stat_approx = 3
    """
    As stat, for normal-dispatch receive counts rounded up to expert_alignment (SGLang's stat_approx).
    """

    per_pass = 1
    """Also one record per forward pass: id, rank, counts (records())."""

    per_token = 2
    """
    Also one record per forward pass with every token's top-k slots per layer (records()).
    """

class LoadRecorder:
    """
    Per-step, per-layer, per-slot expert counts in a ring of buffer_steps steps. Not thread-safe: one per rank.
    """

    def __init__(self, num_layers: int, num_logical: int, num_physical: int, num_gpus: int, buffer_steps: int = 1000, mode: RecordMode = RecordMode.stat, rank: int = 0, max_record_bytes: int = 268435456) -> None: ...

    def record_pass(self, location: ExpertLocation, physical_counts: object, forward_pass_id: int = -1, forward_mode: epx._epx.dp.ForwardMode | None = None) -> None:
        """
        Adds one forward pass's counts [num_layers, num_physical] (mapped to experts by location); per_pass mode also keeps its record (forward_pass_id -1: the previous id + 1, from 1).
        """

    def record_token_pass(self, location: ExpertLocation, topk_ids: object, forward_pass_id: int = -1, forward_mode: epx._epx.dp.ForwardMode | None = None, input_ids: Sequence[int] | None = None, positions: Sequence[int] | None = None, extend_seq_lens: Sequence[int] | None = None) -> None:
        """
        per_token mode: one pass's top-k physical slots of every layer, topk_ids [num_layers, num_tokens, num_topk] (-1: none); the counts are derived from them. input_ids / positions [num_tokens] and extend_seq_lens are optional metadata kept in the record.
        """

    def end_step(self) -> None:
        """Closes the step; it enters the ring (evicting the oldest)."""

    @property
    def num_steps(self) -> int:
        """Steps closed so far."""

    @property
    def buffer_steps(self) -> int: ...

    @property
    def steps_in_buffer(self) -> int: ...

    @property
    def mode(self) -> RecordMode: ...

    def physical_loads(self, window: int) -> NDArray[numpy.int64]:
        """int64 [num_layers, num_physical] over the last `window` steps."""

    def logical_loads(self, window: int) -> NDArray[numpy.int64]:
        """int64 [num_layers, num_logical] over the last `window` steps."""

    def utilization_per_layer(self, window: int) -> NDArray[numpy.float64]:
        """float64 [num_layers]: (mean GPU load + 1e-5) / (max GPU load + 1e-5)."""

    def utilization(self, window: int) -> float:
        """utilization_per_layer averaged over layers."""

    def step_utilizations(self, window: int) -> NDArray[numpy.float64]:
        """
        float64 [min(window, available)]: each of the last closed steps' own utilization, oldest first (SGLang's per-pass balancedness; kept for the last max(1000, buffer_steps) steps).
        """

    def mean_step_utilization(self, window: int) -> float:
        """
        The mean of step_utilizations(window) (SGLang's last_<window>_average_balancedness); 1 before any step.
        """

    @property
    def last_step_count_sum(self) -> int:
        """
        The last closed step's counts summed (SGLang's gpu_physical_count_sum).
        """

    def records(self) -> list:
        """
        per_pass / per_token mode: the records since construction or clear(), oldest first, as dicts with SGLang's keys (forward_pass_id, rank, global_physical_count int32 [num_layers, num_physical]; per_token also topk_ids_of_layer int32 [num_layers, num_tokens, num_topk], input_ids, positions, extend_seq_lens) plus step and forward_mode (a ForwardMode or None).
        """

    @property
    def dropped_passes(self) -> int:
        """
        Passes whose record did not fit in max_record_bytes (their counts still count).
        """

    @property
    def record_bytes(self) -> int:
        """Memory the records take, as max_record_bytes counts."""

    def records_json(self, last_location: ExpertLocation) -> str:
        """
        The records as SGLang's per_pass / per_token dump, in JSON (include/epx/eplb/recorder.h).
        """

    def clear(self) -> None:
        """Drops everything recorded (num_steps keeps counting)."""

class GateStatistic(enum.Enum):
    """What a due rebalance compares with utilization_threshold."""

    mean_step = 0
    """
    SGLang's: the mean of per-step utilizations since the last due rebalance (at most 1000 steps).
    """

    buffer = 1
    """
    One ratio of the buffer's summed counts (epx's earlier gate; higher on noisy loads).
    """

def gate_statistic_from_string(name: str) -> GateStatistic:
    """
    'mean_step' or 'buffer' -> GateStatistic; raises InvalidArgumentError otherwise.
    """

class RebalanceReport:
    """
    What a due rebalance saw and decided (SGLang's [Expert Balancedness] numbers and its skip message). Balancedness of counts = (mean GPU load + 1e-5) / (max GPU load + 1e-5) per layer, averaged over layers.
    """

    @property
    def step(self) -> int:
        """Index of the step at which the rebalance was due."""

    @property
    def current_step_balancedness(self) -> float:
        """SGLang's current_pass_balancedness: this step's utilization."""

    @property
    def last_10_average_balancedness(self) -> float: ...

    @property
    def last_100_average_balancedness(self) -> float: ...

    @property
    def last_1000_average_balancedness(self) -> float:
        """
        Means of the last 10/100/1000 steps' utilizations (fewer when fewer were recorded).
        """

    @property
    def gpu_physical_count_sum(self) -> int:
        """This step's counts summed."""

    @property
    def gate_statistic(self) -> GateStatistic: ...

    @property
    def gate_window_steps(self) -> int:
        """Steps the gate statistic covered."""

    @property
    def gate_utilization(self) -> float:
        """The gate statistic."""

    @property
    def threshold(self) -> float:
        """utilization_threshold of the manager."""

    @property
    def skipped(self) -> bool:
        """gate_utilization > threshold: nothing was computed."""

    @property
    def placement_balancedness_before(self) -> float:
        """Balancedness of the placement in force on the buffer's logical loads."""

    @property
    def placement_balancedness_after(self) -> float:
        """The same for the new placement (= before when skipped)."""

    @property
    def moved_experts(self) -> int:
        """Slots the new placement changes (0 when skipped)."""

    @property
    def num_changed_layers(self) -> int:
        """Layers the new placement changes."""

    def to_json(self) -> str:
        """A JSON object with the fields by name (gate_statistic as its name)."""

    def to_log_line(self) -> str:
        """
        SGLang's wording in one line: '[Expert Balancedness] forward_pass_id=... [EPLBManager] ...' (the line the manager logs at info level).
        """

    def __repr__(self) -> str: ...

class LayerUpdate:
    """One layer switched to a new placement: relocate old -> new."""

    @property
    def layer(self) -> int: ...

    @property
    def old_phy2log(self) -> NDArray[numpy.int32]:
        """int32 [num_physical]"""

    @property
    def new_phy2log(self) -> NDArray[numpy.int32]:
        """int32 [num_physical]"""

class StepReport:
    """What one RebalanceManager.step() did."""

    @property
    def step(self) -> int:
        """Index of the step just recorded."""

    @property
    def utilization(self) -> float:
        """Over the whole buffer (one ratio of summed counts), at this step."""

    @property
    def step_utilization(self) -> float:
        """Utilization of this step's own counts."""

    @property
    def rebalance_computed(self) -> bool: ...

    @property
    def rebalance_due(self) -> bool:
        """
        A rebalance was considered in this step (computed or skipped): `rebalance` is filled.
        """

    @property
    def rebalance(self) -> RebalanceReport:
        """When rebalance_due: what the rebalance saw and decided."""

    @property
    def rebalance_skipped(self) -> bool:
        """
        A rebalance was due but the gate statistic (SGLang's: mean per-step utilization since the last due rebalance) was strictly above the threshold.
        """

    @property
    def updates(self) -> list[LayerUpdate]:
        """Layers switched to the new placement in this step."""

    @property
    def moved_experts(self) -> int:
        """Slots that changed in `updates`."""

class RebalanceManager:
    """
    Records load every forward pass, periodically computes a new placement and applies it layers_per_step layers per step. Not thread-safe.
    """

    def __init__(self, initial: ExpertLocation, buffer_steps: int = 1000, record_mode: RecordMode = RecordMode.stat, num_groups: int = 1, rebalance_every_steps: int = 1000, utilization_threshold: float = 1.0, layers_per_step: int = 0, policy: Policy = Policy.default, migration_aware: bool = True, max_balance_loss: float = 0.01, gate_statistic: GateStatistic = GateStatistic.mean_step) -> None:
        """
        A due rebalance is skipped only when the gate statistic is strictly above utilization_threshold (in [0, 1]; 1 = never skip, SGLang's default).
        """

    def step(self, physical_counts: object) -> StepReport:
        """
        Once per forward pass: records counts [num_layers, num_physical] under location, closes the step, and rebalances every rebalance_every_steps steps (unless the gate statistic is strictly above the threshold).
        """

    @property
    def location(self) -> ExpertLocation:
        """A copy of the placement in force (pending layers applied so far)."""

    @property
    def recorder(self) -> LoadRecorder:
        """The manager's own LoadRecorder (lives as long as the manager)."""

    @property
    def num_pending_layers(self) -> int: ...

    @property
    def num_rebalances(self) -> int: ...

    @property
    def total_moved_experts(self) -> int: ...

class DispatchCounts:
    """
    One rank's expert counts of a forward pass from what the dispatch reports, in global slot order [num_layers, num_physical] (include/epx/eplb/dispatch_counts.h). Per pass: add_normal_dispatch or add_low_latency_cumulative (what this rank received) or add_topk (what its tokens chose; never mixed with the other two in one pass), then take(), all_reduce_counts over the EP group, RebalanceManager.step. Not thread-safe; one per rank.
    """

    def __init__(self, num_layers: int, num_physical: int, num_gpus: int, rank: int, mode: RecordMode = RecordMode.stat) -> None:
        """
        Raises InvalidArgumentError for counts < 1, num_physical % num_gpus != 0, rank outside [0, num_gpus) or mode per_token.
        """

    def add_normal_dispatch(self, layer: int, num_recv_tokens_per_expert: object, expert_alignment: int = 1) -> None:
        """
        The normal dispatch's per-local-expert receive counts [num_physical // num_gpus] of `layer`. With expert_alignment > 1 (rounded-up counts) only mode stat_approx accepts them, as in SGLang.
        """

    def add_low_latency_cumulative(self, layer: int, cumulative_recv_counts: object) -> None:
        """
        A host copy of the low-latency dispatch's int32 cumulative receive counters [num_physical // num_gpus] of `layer`: adds the increase since the last call for the layer, modulo 2^32.
        """

    def reset_low_latency_baseline(self, layer: int) -> None:
        """
        After zeroing a layer's counters: the next call adds the values themselves.
        """

    def add_topk(self, layer: int, topk_physical: object) -> None:
        """
        The physical slots this rank's tokens chose in `layer` ([num_tokens, num_topk], -1 ignored).
        """

    def take(self) -> NDArray[numpy.int64]:
        """
        int64 [num_layers, num_physical]: this rank's counts of the pass; starts the next pass.
        """

    @property
    def rank(self) -> int: ...

    @property
    def mode(self) -> RecordMode: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def num_physical(self) -> int: ...

    @property
    def num_gpus(self) -> int: ...

def all_reduce_counts(group: epx._epx.Group, counts: object) -> NDArray[numpy.int64]:
    """
    Collective over `group` (host or cuda): int64 counts of the same shape, summed element-wise over the ranks in rank order, on every rank (the input is not modified). Every rank raises InvalidArgumentError for counts of different sizes on different ranks, a negative count or a sum above INT64_MAX; a wrong-typed `counts` raises on this rank after it joined with no counts (its peers then see the size mismatch). GIL released.
    """

class SglangLogicalCount:
    """
    SGLang's logical_count summed over its passes (include/epx/eplb/sglang_format.h).
    """

    @property
    def num_passes(self) -> int:
        """First dimension of a 3-D logical_count; 1 for 2-D."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_logical(self) -> int: ...

    @property
    def counts(self) -> NDArray[numpy.int64]:
        """int64 [num_layers, num_logical]: the sum over passes (a copy)."""

    @property
    def rank(self) -> int | None:
        """The dump's 'rank', or None."""

    @property
    def average_utilization_rate_over_window(self) -> float | None:
        """
        The dump's value, or None (SGLang writes None unless its metrics and a threshold below 1 are on).
        """

def parse_sglang_logical_count(json_text: str) -> SglangLogicalCount:
    """
    Parses SGLang's {"logical_count": 2-D or 3-D, ...}; raises InvalidArgumentError naming the field.
    """

def to_sglang_logical_count_json(logical_count: object) -> str:
    """
    {"logical_count": [[...] per layer]} of integer counts [num_layers, num_logical] (>= 0): a file SGLang's --init-expert-location accepts.
    """

class SglangExpertLocation:
    """SGLang's physical_to_logical_map."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_physical(self) -> int: ...

    @property
    def num_logical_seen(self) -> int:
        """The largest id + 1 (the file does not say num_logical)."""

    @property
    def phy2log(self) -> NDArray[numpy.int32]:
        """int32 [num_layers, num_physical] (a copy)."""

def parse_sglang_expert_location(json_text: str) -> SglangExpertLocation:
    """
    Parses SGLang's {"physical_to_logical_map": [[...]]}; raises InvalidArgumentError naming the field.
    """

def to_sglang_expert_location_json(phy2log: object) -> str:
    """
    {"physical_to_logical_map": [[...] per layer]} of phy2log [num_layers, num_physical], the only key (as SGLang's --init-expert-location needs).
    """

class SlotAction(enum.Enum):
    """How a destination slot gets its weights."""

    unchanged = 0

    local_copy = 1

    same_round_copy = 2

    peer_intra_node = 3

    peer_inter_node = 4

    lost = 5
    """Every old replica sat on a failed rank: the caller must reload it."""

    dead_rank = 6
    """The destination rank failed: nothing is done for it."""

class SlotPlan:
    """The plan of one destination slot."""

    @property
    def action(self) -> SlotAction: ...

    @property
    def expert(self) -> int:
        """Logical expert the slot must hold."""

    @property
    def src_rank(self) -> int: ...

    @property
    def src_slot(self) -> int:
        """Local slot index on src_rank (an old slot, or a new one)."""

    def __repr__(self) -> str: ...

class RelocationPlan:
    """How every destination slot of one layer gets its weights."""

    @property
    def num_ranks(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def old_slots_per_rank(self) -> int: ...

    @property
    def new_slots_per_rank(self) -> int: ...

    @property
    def slots(self) -> list[SlotPlan]:
        """[num_ranks * new_slots_per_rank] SlotPlan, by destination slot."""

    @property
    def lost_experts(self) -> NDArray[numpy.int32]:
        """
        int32, ascending: experts whose every old replica sat on a failed rank.
        """

    def count(self, action: SlotAction) -> int: ...

    @property
    def num_transfers(self) -> int:
        """Destination slots whose weights cross ranks."""

def plan_relocation(old_phy2log: object, new_phy2log: object, num_ranks: int, num_nodes: int = 1, failed_ranks: Sequence[bool] = []) -> RelocationPlan:
    """
    Plans one layer: old_phy2log [num_ranks * old_slots_per_rank] -> new_phy2log [num_ranks * new_slots_per_rank]. failed_ranks: empty or one bool per rank.
    """

class RelocationStats:
    """What relocate_weights() moved on this rank."""

    @property
    def num_rounds(self) -> int: ...

    @property
    def slots_received(self) -> int: ...

    @property
    def slots_sent(self) -> int: ...

    @property
    def local_copies(self) -> int: ...

    @property
    def bytes_received(self) -> int: ...

    @property
    def bytes_sent(self) -> int: ...

def relocate_weights(plan: RelocationPlan, group: epx._epx.Group, old_slots: Sequence[object], new_slots: Sequence[object], max_slots_per_round: int = 8, failed_ranks: Sequence[bool] = [], staging_bytes: int = 67108864, transport: str = 'auto') -> RelocationStats:
    """
    Executes `plan` for group.rank: host groups over the host transport (host arrays; collective over live ranks), cuda groups (CUDA arrays of the rank's GPU) over transport 'cuda' (copy engines through a staging region of staging_bytes per rank; GPUs with peer access), 'nccl' (send/recv on the group's communicator; one process per GPU, any hosts) or 'auto' (choose_transport). old_slots[i] [old_slots_per_rank, ...] and new_slots[i] [new_slots_per_rank, ...]: contiguous, disjoint or identical (in place). GIL released.
    """

def choose_transport(group: epx._epx.Group) -> str:
    """
    'host', 'cuda' or 'nccl': the transport relocate_weights(transport='auto') uses for `group` (collective for a cuda group of one process per GPU). GIL released.
    """

def zipf_loads(num_layers: int, num_logical: int, exponent: float, total_per_layer: float, seed: int) -> NDArray[numpy.float64]:
    """
    float64 [num_layers, num_logical]: Zipf(exponent) popularity over a random expert order per layer.
    """

class DriftingZipf:
    """
    A Zipf load whose popularity order drifts (adjacent swaps with probability `drift` per advance()). Deterministic for a seed.
    """

    def __init__(self, num_layers: int, num_logical: int, exponent: float, tokens_per_step: float, drift: float, seed: int) -> None: ...

    def expected(self) -> NDArray[numpy.float64]:
        """float64 [num_layers, num_logical]: expected load at the current step."""

    def sample(self) -> NDArray[numpy.int64]:
        """int64 [num_layers, num_logical]: one step's counts (expected + noise)."""

    def advance(self) -> None: ...

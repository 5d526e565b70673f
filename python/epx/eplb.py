"""epx.eplb: expert-parallel load balancing (the contract: include/epx/eplb/*.h).

Vocabulary (shapes as numpy arrays):

* ``weight``  [num_layers, num_logical]: load of each logical expert (tokens routed to it), >= 0;
* ``phy2log`` [num_layers, num_physical]: logical expert held by each physical slot; slot s lives on
  GPU ``s // (num_physical // num_gpus)``, GPU g on node ``g // (num_gpus // num_nodes)``;
* ``log2phy`` [num_layers, num_logical, max_replicas]: slots of each logical expert, -1 padded;
* ``logcnt``  [num_layers, num_logical]: replica count of each logical expert (>= 1).

Balancedness of a layer = mean GPU load / max GPU load, where a GPU's load is the sum over its slots of
``weight[expert] / logcnt[expert]``; ``balancedness`` averages it over layers.

Arrays in are numpy arrays, torch tensors (CUDA ones are copied to the host), lists, or anything with
``__dlpack__``; they are read once in C++ (no per-element Python work). Arrays out are numpy.
Policies, record modes and replica choices take their enum or its name (``"deepseek"``, ``"per_pass"``).

SGLang's EPLB files (include/epx/eplb/sglang_format.h): ``load_sglang_logical_count`` reads its recorded
distribution (``{"logical_count": ...}``, 2-D or its dump's 3-D with the passes summed, or the dict ``torch.load``
returns for its ``.pt`` dump), ``load_sglang_expert_location`` its ``physical_to_logical_map``; the ``save_sglang_*``
functions write the files its ``--init-expert-location`` accepts. Input files are regular files of at most
``MAX_INPUT_FILE_BYTES``.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

from . import _epx
from ._epx.eplb import (  # noqa: F401
    DeviceReplicaTable,
    DispatchCounts,
    DriftingZipf,
    ExpertLocation,
    GateStatistic,
    LayerUpdate,
    LoadRecorder,
    MigrationResult,
    Placement,
    Policy,
    RebalanceManager,
    RebalanceReport,
    RecordMode,
    RelocationPlan,
    RelocationStats,
    ReplicaChoice,
    SglangExpertLocation,
    SglangLogicalCount,
    SlotAction,
    SlotPlan,
    StepReport,
    parse_sglang_expert_location,
    parse_sglang_logical_count,
    to_sglang_expert_location_json,
    to_sglang_logical_count_json,
    zipf_loads,
)
from ._args import enum_arg, invalid_argument
from ._tensors import is_torch

_native = _epx.eplb

#: The standard utilization windows, in steps (include/epx/eplb/recorder.h).
UTILIZATION_WINDOWS = (10, 100, 1000)

#: The most bytes an input file may hold (the CLI's kMaxInputFileBytes, tools/command.h).
MAX_INPUT_FILE_BYTES = 1 << 30

__all__ = [
    "DeviceReplicaTable", "DispatchCounts", "DriftingZipf", "ExpertLocation", "GateStatistic", "LayerUpdate", "LoadRecorder",
    "MAX_INPUT_FILE_BYTES", "MigrationResult", "Placement", "Policy", "RebalanceManager", "RebalanceReport",
    "RecordMode", "RelocationPlan", "RelocationStats", "ReplicaChoice", "SglangExpertLocation", "SglangLogicalCount",
    "SimulationResult", "SlotAction", "SlotPlan", "StepReport", "UTILIZATION_WINDOWS", "all_reduce_counts",
    "balancedness", "balancedness_per_layer", "choose_replicas", "choose_transport", "count_moved_experts", "gpu_loads",
    "load_sglang_expert_location", "load_sglang_logical_count", "make_manager", "make_recorder",
    "parse_sglang_expert_location", "parse_sglang_logical_count", "placement_from_phy2log", "plan_relocation",
    "rebalance", "rebalance_migration_aware", "relocate_weights", "save_expert_distribution_records",
    "save_sglang_expert_location",
    "save_sglang_logical_count", "simulate", "to_sglang_expert_location_json", "to_sglang_logical_count_json",
    "trivial_phy2log", "zipf_loads",
]


def _host(a: Any) -> Any:
    """An array the native module reads in host memory: torch tensors are detached and moved to the CPU."""
    if is_torch(a):
        return a.detach().cpu()
    if isinstance(a, (list, tuple)):
        return np.asarray(a)
    return a


def rebalance(weight: Any, num_physical: int, num_gpus: int, num_groups: int = 1, num_nodes: int = 1,
              policy: Union[Policy, str] = "default") -> Placement:
    """A fresh placement for ``weight`` [num_layers, num_logical].

    Hierarchical (groups packed onto nodes, replicas inside each node) when ``num_groups % num_nodes == 0``,
    else global. ``policy``: ``"deepseek"`` reproduces DeepSeek's published EPLB exactly; ``"default"``
    improves on it and is never less balanced. Raises ``epx.InvalidArgumentError`` (a ``ValueError``)
    naming the broken bound (negative/NaN loads, num_physical < num_logical, indivisible counts ...).
    """
    return _native.rebalance(_host(weight), num_physical, num_gpus, num_groups, num_nodes,
                             enum_arg(Policy, policy, "policy"))


def rebalance_migration_aware(weight: Any, current_phy2log: Any, num_physical: int, num_gpus: int,
                              num_groups: int = 1, num_nodes: int = 1,
                              max_balance_loss: float = 0.01) -> MigrationResult:
    """Like ``rebalance(policy="default")``, but moves as few slots of ``current_phy2log`` as it can.

    Per layer, the result is at most ``max_balance_loss`` (absolute balancedness) less balanced than a fresh
    placement; ``result.moved_experts`` counts the slots that change.
    """
    return _native.rebalance_migration_aware(_host(weight), _host(current_phy2log), num_physical, num_gpus,
                                             num_groups, num_nodes, max_balance_loss)


def placement_from_phy2log(phy2log: Any, num_logical: int) -> Placement:
    """A Placement (log2phy in slot order, logcnt, max_replicas) from phy2log [num_layers, num_physical]."""
    return _native.placement_from_phy2log(_host(phy2log), num_logical)


def balancedness_per_layer(weight: Any, phy2log: Any, num_gpus: int) -> np.ndarray:
    """float64 [num_layers]: mean GPU load / max GPU load of each layer (1 for a layer without load)."""
    return _native.balancedness_per_layer(_host(weight), _host(phy2log), num_gpus)


def balancedness(weight: Any, phy2log: Any, num_gpus: int) -> float:
    """The mean over layers of ``balancedness_per_layer``."""
    return _native.balancedness(_host(weight), _host(phy2log), num_gpus)


def count_moved_experts(old_phy2log: Any, new_phy2log: Any) -> int:
    """Slots whose logical expert differs between two placements of equal shape, all layers."""
    return _native.count_moved_experts(_host(old_phy2log), _host(new_phy2log))


def trivial_phy2log(num_layers: int, num_logical: int, num_physical: int) -> np.ndarray:
    """int32 [num_layers, num_physical]: slot i holds logical expert ``i % num_logical``."""
    return _native.trivial_phy2log(num_layers, num_logical, num_physical)


def gpu_loads(weight: Any, phy2log: Any, num_gpus: int) -> np.ndarray:
    """float64 [num_layers, num_gpus]: each GPU's load under the balancedness model.

    A GPU's load is the sum over its slots of ``weight[expert] / replica_count[expert]``.
    ``mean / max`` of a row is that layer's balancedness.
    """
    w = np.asarray(_host(weight), dtype=np.float64)
    p = np.asarray(_host(phy2log), dtype=np.int64)
    if w.ndim != 2 or p.ndim != 2 or w.shape[0] != p.shape[0]:
        raise invalid_argument(f"weight {w.shape} and phy2log {p.shape}: expected [num_layers, num_logical] and "
                               "[num_layers, num_physical]")
    num_layers, num_physical = p.shape
    if num_gpus < 1 or num_physical % num_gpus:
        raise invalid_argument(f"num_gpus: {num_gpus} does not divide {num_physical} physical slots")
    rows = np.arange(num_layers)[:, None]
    counts = np.zeros_like(w)
    np.add.at(counts, (np.broadcast_to(rows, p.shape), p), 1.0)
    per_slot = w[rows, p] / counts[rows, p]  # [num_layers, num_physical]
    return per_slot.reshape(num_layers, num_gpus, num_physical // num_gpus).sum(axis=2)


def choose_replicas(location: Union[ExpertLocation, DeviceReplicaTable], layer: int, topk_logical: Any, gpu: int,
                    mode: Union[ReplicaChoice, str] = "static", seed: int = 0, rank_invariant: bool = False,
                    first_token: int = 0, out: Any = None, stream: Any = None) -> Any:
    """Maps logical top-k ids [num_tokens, num_topk] of one layer to physical slots (-1 stays -1).

    ``gpu``: the caller's GPU (rank). ``mode="static"`` prefers a replica on the token's own GPU;
    ``"dynamic"`` picks uniformly by a hash of (seed, layer, token, k). With an ExpertLocation: host arrays,
    returns int64 [num_tokens, num_topk] (a torch CPU tensor for torch input, else numpy). With a
    ``DeviceReplicaTable`` (``DeviceReplicaTable.upload(location, device)``): CUDA tensors (int32 or int64) stay
    on the device, the kernel picks the same slots on ``stream`` (default: torch's current stream) with no host
    sync; the result (``out``, or a new tensor like ``topk_logical``) is returned. Ids outside [-1, num_logical)
    give -1 there (they are not checked on the host).
    """
    mode = enum_arg(ReplicaChoice, mode, "mode")
    if isinstance(location, DeviceReplicaTable):
        from ._tensors import cuda_stream_of

        result = out if out is not None else topk_logical.new_empty(topk_logical.shape)
        _native.choose_replicas_device(location, layer, topk_logical, result, gpu, mode, seed, rank_invariant,
                                       first_token, cuda_stream_of(stream, topk_logical))
        return result
    out_host = _native.choose_replicas(location, layer, _host(topk_logical), gpu, mode, seed, rank_invariant,
                                       first_token)
    if is_torch(topk_logical):
        import torch

        return torch.from_numpy(out_host).to(topk_logical.device)
    return out_host


def make_recorder(num_layers: int, num_logical: int, num_physical: int, num_gpus: int, buffer_steps: int = 1000,
                  mode: Union[RecordMode, str] = "stat", *, rank: int = 0,
                  max_record_bytes: int = 256 << 20) -> LoadRecorder:
    """A LoadRecorder, with the mode given by enum or name (``"stat"``, ``"stat_approx"``, ``"per_pass"``, ``"per_token"``).

    ``per_pass`` / ``per_token`` keep one record per forward pass (SGLang's modes of the same names), written with
    ``rank``, in at most ``max_record_bytes``; passes beyond it are counted in ``dropped_passes``.
    """
    return LoadRecorder(num_layers, num_logical, num_physical, num_gpus, buffer_steps, enum_arg(RecordMode, mode, "mode"),
                        rank, max_record_bytes)


def save_expert_distribution_records(path: Any, recorder: LoadRecorder, last_location: ExpertLocation,
                                     clear: bool = True) -> None:
    """Writes a per_pass / per_token recorder's records as SGLang's dump (``records``, ``last_physical_to_logical_map``),
    in JSON, to ``path``; then clears the recorder when ``clear`` (SGLang's ``dump_record`` resets its recorder).
    Raises ``epx.InvalidArgumentError`` in stat / stat_approx mode (their dump is ``save_sglang_logical_count``)."""
    text = recorder.records_json(last_location)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    if clear:
        recorder.clear()


def make_manager(initial: ExpertLocation, *, buffer_steps: int = 1000, record_mode: Union[RecordMode, str] = "stat",
                 num_groups: int = 1, rebalance_every_steps: int = 1000, utilization_threshold: float = 1.0,
                 layers_per_step: int = 0, policy: Union[Policy, str] = "default", migration_aware: bool = True,
                 max_balance_loss: float = 0.01,
                 gate_statistic: Union[GateStatistic, str] = "mean_step") -> RebalanceManager:
    """A RebalanceManager with enums given by enum or name; see RebalanceManager for the options.

    A due rebalance is skipped only when the gate statistic is strictly above ``utilization_threshold``
    (SGLang's rule; the default 1.0 never skips). ``gate_statistic="mean_step"`` is SGLang's (the mean of the
    per-step utilizations since the last due rebalance); ``"buffer"`` is one ratio of the buffer's summed counts.
    """
    return RebalanceManager(initial, buffer_steps=buffer_steps, record_mode=enum_arg(RecordMode, record_mode, "record_mode"),
                            num_groups=num_groups, rebalance_every_steps=rebalance_every_steps,
                            utilization_threshold=utilization_threshold, layers_per_step=layers_per_step,
                            policy=enum_arg(Policy, policy, "policy"), migration_aware=migration_aware,
                            max_balance_loss=max_balance_loss,
                            gate_statistic=enum_arg(GateStatistic, gate_statistic, "gate_statistic"))


def all_reduce_counts(group: _epx.Group, counts: Any) -> np.ndarray:
    """Collective: ``counts`` (integers >= 0, any shape; e.g. ``DispatchCounts.take()``) summed element-wise over
    the ranks of ``group``, as an int64 numpy array of the same shape on every rank (the input is unchanged).

    Every rank raises ``epx.InvalidArgumentError`` when the ranks passed different sizes, a count is negative or
    a sum exceeds INT64_MAX. A rank whose ``counts`` does not convert still joins the call (its peers see the size
    mismatch) and raises. The GIL is released while it waits.
    """
    if is_torch(counts):
        counts = counts.detach().cpu()
    elif isinstance(counts, (list, tuple)):
        try:
            counts = np.asarray(counts)
        except ValueError:
            pass  # NOTE: rejected inside the collective, so this rank still joins the call
    return _native.all_reduce_counts(group, counts)


# ---- SGLang's EPLB files ------------------------------------------------------------------------------


def _check_input_file(path: str, what: str) -> None:
    """Raises unless `path` is a regular file of at most MAX_INPUT_FILE_BYTES (as the CLI checks its inputs)."""
    bound = f"{MAX_INPUT_FILE_BYTES >> 30} GiB"
    try:
        st = os.stat(path)
    except OSError as e:
        raise invalid_argument(f"{what}: cannot read '{path}': {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise invalid_argument(f"{what}: '{path}' is a directory, not a file")
    # NOTE: checked before opening: opening a FIFO would block until a writer appears.
    if not stat.S_ISREG(st.st_mode):
        raise invalid_argument(f"{what}: '{path}' is not a regular file (input files are regular files of at most "
                               f"{bound})")
    if st.st_size > MAX_INPUT_FILE_BYTES:
        raise invalid_argument(f"{what}: '{path}' holds {st.st_size} bytes, more than the {bound} an input file may "
                               "hold")


def _read_input_file(path: Any, what: str) -> str:
    """The text of a regular file of at most MAX_INPUT_FILE_BYTES, as the CLI reads its input files."""
    path = os.fspath(path)
    bound = f"{MAX_INPUT_FILE_BYTES >> 30} GiB"
    _check_input_file(path, what)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise invalid_argument(f"{what}: '{path}' is not a regular file")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            total += len(chunk)
            if total > MAX_INPUT_FILE_BYTES:  # the file grew while it was read
                raise invalid_argument(f"{what}: '{path}' holds more than the {bound} an input file may hold")
            chunks.append(chunk)
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid_argument(f"{what}: '{path}' is not UTF-8 text ({e})") from None


def _sglang_text(source: Any, what: str, key: str) -> str:
    """JSON text from SGLang's forms: a dict (e.g. what torch.load returns for its .pt files), JSON text, a path to
    a .json file, or a path to a .pt file (read with torch.load(weights_only=True) when torch is installed; without
    torch it is refused with the conversion to use)."""
    if isinstance(source, Mapping):
        if key not in source:
            raise invalid_argument(f"{what}: the mapping has no key '{key}' (keys: {sorted(map(str, source))})")
        value = _host(source[key])
        out = {key: np.asarray(value).tolist()}
        for extra in ("rank", "average_utilization_rate_over_window"):
            if key == "logical_count" and source.get(extra) is not None:
                out[extra] = source[extra].item() if hasattr(source[extra], "item") else source[extra]
        return json.dumps(out)
    if isinstance(source, str) and source.lstrip().startswith("{"):
        return source  # JSON text, as SGLang's --init-expert-location also takes it
    path = os.fspath(source)
    if str(path).endswith(".pt"):
        _check_input_file(path, what)
        try:
            import torch
        except ImportError:
            raise invalid_argument(
                f"{what}: '{path}' is a torch .pt file, which epx reads only with torch installed (it needs torch's "
                f"unpickler): install torch, or convert it once to JSON where torch is: "
                f"json.dump({{'{key}': torch.load(p)['{key}'].tolist()}}, open('out.json', 'w'))") from None
        try:
            # NOTE: weights_only: tensors, numbers and containers only, never arbitrary pickled objects.
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises pickle/runtime errors of several kinds for a bad file
            raise invalid_argument(f"{what}: '{path}' is not a torch file of tensors and numbers ({e})") from None
        if not isinstance(obj, Mapping):
            raise invalid_argument(f"{what}: '{path}' holds a {type(obj).__name__}, not a dict with '{key}'")
        return _sglang_text(obj, what, key)
    return _read_input_file(path, what)


def load_sglang_logical_count(source: Any) -> SglangLogicalCount:
    """SGLang's recorded distribution, summed over its passes as SGLang's ``init_by_eplb`` does.

    ``source``: a path to a JSON file ``{"logical_count": [...]}`` (2-D [num_layers, num_logical] or the dump's
    3-D [buffer_size, num_layers, num_logical]; the dump's ``rank`` and ``average_utilization_rate_over_window``
    are kept when present), that JSON text, SGLang's ``.pt`` dump itself (read with torch when it is installed), or
    the dict ``torch.load`` returns for it (or its ``dump_record(output_mode="object")``). ``.counts`` (int64 [num_layers, num_logical]) is ``rebalance``'s
    ``weight``. Raises ``epx.InvalidArgumentError`` naming the field, index or file bound.
    """
    return parse_sglang_logical_count(_sglang_text(source, "logical_count", "logical_count"))


def load_sglang_expert_location(source: Any) -> SglangExpertLocation:
    """SGLang's ``--init-expert-location`` placement ``{"physical_to_logical_map": [[...]]}``: a path to a JSON
    file, a ``.pt`` one (read with torch when it is installed), the JSON text, or a dict (``torch.load`` of a
    ``.pt`` one).

    ``.phy2log`` is int32 [num_layers, num_physical]; the file does not say num_logical, so build the location with
    the model's: ``ExpertLocation(num_gpus, num_nodes, loc.phy2log, num_logical)``.
    """
    return parse_sglang_expert_location(_sglang_text(source, "physical_to_logical_map", "physical_to_logical_map"))


def save_sglang_logical_count(path: Any, logical_count: Any) -> None:
    """Writes ``{"logical_count": [[...] per layer]}`` of integer counts [num_layers, num_logical] (e.g.
    ``recorder.logical_loads(window)``): SGLang's ``--init-expert-location`` rebalances from it."""
    text = to_sglang_logical_count_json(_host(logical_count))
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def save_sglang_expert_location(path: Any, placement: Any) -> None:
    """Writes ``{"physical_to_logical_map": [[...] per layer]}`` (the only key, as SGLang needs) of an
    ExpertLocation, a Placement or a phy2log array [num_layers, num_physical]."""
    if isinstance(placement, ExpertLocation):
        placement = placement.phy2log_table
    elif isinstance(placement, Placement):
        placement = placement.phy2log
    text = to_sglang_expert_location_json(_host(placement))
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def plan_relocation(old_phy2log: Any, new_phy2log: Any, num_ranks: int, num_nodes: int = 1,
                    failed_ranks: Optional[Sequence[bool]] = None) -> RelocationPlan:
    """Plans moving one layer's weights from ``old_phy2log`` to ``new_phy2log`` (flat, one layer each).

    Slot counts may differ (e.g. 256 -> 288 slots on 32 ranks); both divide by ``num_ranks``.
    ``failed_ranks``: None or one bool per rank; experts only on failed ranks come out in ``lost_experts``.
    """
    return _native.plan_relocation(_host(old_phy2log), _host(new_phy2log), num_ranks, num_nodes,
                                   list(failed_ranks or []))


def _wait_for_writers(tensors: Sequence[Any]) -> None:
    """Waits for torch's current stream of every CUDA device among ``tensors`` (nothing for other arrays)."""
    devices = {t.device for t in tensors if getattr(t, "is_cuda", False)}
    if devices:
        import torch
        for device in devices:
            torch.cuda.current_stream(device).synchronize()


def relocate_weights(plan: RelocationPlan, group: _epx.Group, old_slots: Sequence[Any], new_slots: Sequence[Any],
                     max_slots_per_round: int = 8, failed_ranks: Optional[Sequence[bool]] = None,
                     staging_bytes: int = 64 << 20, transport: str = "auto") -> RelocationStats:
    """Executes ``plan`` for ``group.rank`` over a transport (docs/eplb.md, "Weight relocation"):

    - host groups (``epx.host_groups``; host arrays): the host transport (``transport`` "auto" or "host");
    - cuda groups (CUDA tensors of the rank's GPU; no ``failed_ranks``): "cuda" moves with copy engines (no SMs)
      through a staging region of ``staging_bytes`` per rank and needs peer access between all GPUs (one host);
      "nccl" sends and receives on the group's NCCL communicator (one process per GPU, ``epx.cuda_group``; any
      hosts); "auto" is ``choose_transport(group)``: "cuda" for ranks as threads and for processes whose GPUs
      all have peer access on one host, else "nccl".

    Collective: every live rank calls it with the same plan and the same ``transport``. ``old_slots[i]``
    [old_slots_per_rank, ...] and ``new_slots[i]`` [new_slots_per_rank, ...] are this rank's i-th weight tensor
    (any dtype, C-contiguous), disjoint or identical (in place). ``new_slots`` are written. The GIL is released.
    The copies run on the transport's own streams: for torch CUDA tensors this first waits for torch's current stream
    of each tensor's device (the weights' writers), and the weights are in place when it returns.
    """
    if transport not in ("auto", "host", "cuda", "nccl"):
        raise invalid_argument(f"transport must be 'auto', 'host', 'cuda' or 'nccl', got {transport!r}")
    _wait_for_writers(list(old_slots) + list(new_slots))
    return _native.relocate_weights(plan, group, list(old_slots), list(new_slots), max_slots_per_round,
                                    list(failed_ranks or []), staging_bytes, transport)


def choose_transport(group: _epx.Group) -> str:
    """The transport ``relocate_weights(..., transport="auto")`` uses for ``group``: "host" for host groups;
    for cuda groups "cuda" (copy engines) when the ranks are threads of one process, or processes on one host
    whose GPUs all have peer access, else "nccl". Collective for a cuda group of one process per GPU (every rank
    calls it; all get the same answer)."""
    return _native.choose_transport(group)


# ---- simulation --------------------------------------------------------------------------------------


@dataclass
class SimulationResult:
    """What ``simulate`` (and ``epx eplb simulate``) reports, plus the loads the plots need.

    ``as_dict()`` gives the CLI's JSON keys (``timeline`` as a list of records).
    """

    settings: Dict[str, Any]
    utilization_window_steps: int
    steps: np.ndarray  # int64 [num_reports]: step numbers of the timeline (1-based, every report_every)
    utilization_rebalanced: np.ndarray  # float64 [num_reports]: recorder utilization over the window, with EPLB
    utilization_static: np.ndarray  # float64 [num_reports]: the same load on the initial placement
    mean_utilization_rebalanced: float
    mean_utilization_static: float
    rebalances_computed: int
    rebalances_skipped: int
    moved_experts: int
    moved_bytes: float
    logical_load: np.ndarray = field(repr=False)  # int64 [num_layers, num_logical]: the last buffer's load
    initial_phy2log: np.ndarray = field(repr=False)  # int32 [num_layers, num_physical]
    final_phy2log: np.ndarray = field(repr=False)  # int32 [num_layers, num_physical]
    gpu_load_static: np.ndarray = field(repr=False)  # float64 [num_gpus]: logical_load on initial, summed over layers
    gpu_load_rebalanced: np.ndarray = field(repr=False)  # float64 [num_gpus]: the same on final_phy2log
    # Per due rebalance, RebalanceReport.to_json() as a dict (the CLI's "rebalances").
    rebalances: List[Dict[str, Any]] = field(default_factory=list, repr=False)

    def as_dict(self) -> Dict[str, Any]:
        return {
            "settings": dict(self.settings),
            "utilization_window_steps": self.utilization_window_steps,
            "timeline": [{"step": int(s), "utilization_rebalanced": float(a), "utilization_static": float(b)}
                         for s, a, b in zip(self.steps, self.utilization_rebalanced, self.utilization_static)],
            "mean_utilization_rebalanced": self.mean_utilization_rebalanced,
            "mean_utilization_static": self.mean_utilization_static,
            "rebalances_computed": self.rebalances_computed,
            "rebalances_skipped": self.rebalances_skipped,
            "moved_experts": self.moved_experts,
            "moved_bytes": self.moved_bytes,
            "gpu_load_static": self.gpu_load_static.tolist(),
            "gpu_load_rebalanced": self.gpu_load_rebalanced.tolist(),
            "rebalances": list(self.rebalances),
        }


class _Splitter:
    """Splits logical counts over each expert's replicas like ``epx eplb simulate`` (evenly, the remainder
    rotating with the step over the replicas in slot order)."""

    def __init__(self, location: ExpertLocation):
        table = np.asarray(location.phy2log_table, dtype=np.int64)  # [num_layers, num_physical]
        num_layers, num_physical = table.shape
        self.table = table
        self.rows = np.arange(num_layers)[:, None]
        order = np.argsort(table, axis=1, kind="stable")  # slots grouped by expert, ascending within
        sorted_experts = np.take_along_axis(table, order, axis=1)
        pos = np.broadcast_to(np.arange(num_physical), table.shape)
        replica_idx = np.zeros_like(table)
        starts = np.concatenate([np.ones((num_layers, 1), bool), sorted_experts[:, 1:] != sorted_experts[:, :-1]], 1)
        first_sorted = np.maximum.accumulate(np.where(starts, pos, 0), axis=1)
        np.put_along_axis(replica_idx, order, pos - first_sorted, axis=1)
        self.replica_idx = replica_idx  # k: the slot's index among its expert's replicas, in slot order
        counts = np.zeros((num_layers, int(table.max()) + 1), np.int64)
        np.add.at(counts, (np.broadcast_to(self.rows, table.shape), table), 1)
        self.num_replicas = counts[self.rows, table]

    def __call__(self, logical: np.ndarray, step: int) -> np.ndarray:
        c = logical[self.rows, self.table]
        n = self.num_replicas
        return c // n + (((self.replica_idx + step) % n) < (c % n)).astype(np.int64)


def simulate(layers: int = 61, experts: int = 256, replicas: int = 288, groups: int = 8, nodes: int = 4,
             gpus: int = 32, exponent: float = 1.0, drift: float = 0.01, steps: int = 1000, tokens: int = 4096,
             topk: int = 8, buffer: int = 100, every: int = 100, threshold: float = 1.0, gate: str = "mean_step",
             layers_per_step: int = 8,
             policy: str = "default", migration_aware: bool = True, max_balance_loss: float = 0.01, seed: int = 1,
             expert_bytes: float = 3.0 * 7168 * 2048, report_every: int = 50) -> SimulationResult:
    """Serving with a drifting Zipf load, with and without EPLB: ``epx eplb simulate`` in Python.

    Every step samples per-expert counts, splits them over the replicas of the managed placement (which a
    RebalanceManager rebalances every ``every`` steps, ``layers_per_step`` layers per step) and of the
    initial trivial placement (never rebalanced), and records both. The timeline samples the utilization
    over the last 10 steps every ``report_every`` steps. The arguments are the CLI's options.
    """
    if steps < 1 or report_every < 1:
        raise invalid_argument(f"steps ({steps}) and report_every ({report_every}) must be >= 1")
    load = DriftingZipf(layers, experts, exponent, float(tokens) * topk, drift, seed)
    initial = ExpertLocation.trivial(layers, experts, replicas, gpus, nodes)
    # Validate the shape up front so bad input fails before the run, as the CLI does.
    rebalance(np.ones((1, experts)), replicas, gpus, groups, nodes, policy)
    managed = make_manager(initial, buffer_steps=buffer, num_groups=groups, rebalance_every_steps=every,
                           utilization_threshold=threshold, layers_per_step=layers_per_step, policy=policy,
                           migration_aware=migration_aware, max_balance_loss=max_balance_loss, gate_statistic=gate)
    fixed = LoadRecorder(layers, experts, replicas, gpus, buffer, RecordMode.stat)
    split_fixed = _Splitter(initial)
    split_managed, managed_table = split_fixed, initial.phy2log_table
    window = 10
    report_steps, with_eplb, without = [], [], []
    sum_with = sum_without = 0.0
    computed = skipped = 0
    rebalances = []
    for step in range(steps):
        logical = load.sample()
        report = managed.step(split_managed(logical, step))
        computed += report.rebalance_computed
        skipped += report.rebalance_skipped
        if report.rebalance_due:
            rebalances.append(json.loads(report.rebalance.to_json()))
        if report.updates:
            managed_table = managed.location.phy2log_table
            split_managed = _Splitter(managed.location)
        fixed.record_pass(initial, split_fixed(logical, step))
        fixed.end_step()
        u_with, u_without = managed.recorder.utilization(window), fixed.utilization(window)
        sum_with += u_with
        sum_without += u_without
        if (step + 1) % report_every == 0:
            report_steps.append(step + 1)
            with_eplb.append(u_with)
            without.append(u_without)
        load.advance()
    logical_load = managed.recorder.logical_loads(buffer)
    final = np.array(managed_table)
    settings = dict(layers=layers, experts=experts, replicas=replicas, groups=groups, nodes=nodes, gpus=gpus,
                    exponent=exponent, drift=drift, steps=steps, tokens=tokens, topk=topk, buffer_steps=buffer,
                    rebalance_every=every, threshold=threshold, gate_statistic=gate, layers_per_step=layers_per_step,
                    policy=policy,
                    migration_aware=migration_aware, seed=seed, expert_bytes=expert_bytes)
    return SimulationResult(
        settings=settings, utilization_window_steps=window, steps=np.array(report_steps, np.int64),
        utilization_rebalanced=np.array(with_eplb), utilization_static=np.array(without),
        mean_utilization_rebalanced=sum_with / steps, mean_utilization_static=sum_without / steps,
        rebalances_computed=computed, rebalances_skipped=skipped, moved_experts=managed.total_moved_experts,
        moved_bytes=float(managed.total_moved_experts) * expert_bytes, logical_load=logical_load,
        initial_phy2log=np.array(initial.phy2log_table), final_phy2log=final,
        gpu_load_static=gpu_loads(logical_load, initial.phy2log_table, gpus).sum(axis=0),
        gpu_load_rebalanced=gpu_loads(logical_load, final, gpus).sum(axis=0), rebalances=rebalances)


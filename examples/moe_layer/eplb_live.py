"""EPLB live on the decode path: Zipf-skewed routing, per-slot counts from the low-latency dispatch, one
RebalanceManager per rank fed the all-reduced counts, the relocation of the expert weights between the ranks
(epx.eplb.relocate_weights), and the new placement used by the replica choice of the following steps."""

from __future__ import annotations

import time
from typing import Callable, Dict, List

import torch

from epx import eplb

from model import expert_weights


def relocate(rank, updates, max_check_slots: int) -> Dict:
    """Moves this rank's slots of every updated layer to the new placement; checks the moved weights."""
    moved = {"layers": [], "bytes_received": 0, "bytes_sent": 0, "seconds": 0.0, "checked_slots": 0}
    for u in updates:
        layer = u.layer
        plan = eplb.plan_relocation(u.old_phy2log, u.new_phy2log, rank.num_ranks)
        old13, old2 = rank.slots_w13[layer], rank.slots_w2[layer]
        new13, new2 = torch.empty_like(old13), torch.empty_like(old2)
        if rank.cuda:
            torch.cuda.synchronize(rank.device)
        t0 = time.perf_counter()
        stats = eplb.relocate_weights(plan, rank.group, [old13, old2], [new13, new2])
        if rank.cuda:
            torch.cuda.synchronize(rank.device)
        moved["seconds"] += time.perf_counter() - t0
        moved["bytes_received"] += stats.bytes_received
        moved["bytes_sent"] += stats.bytes_sent
        moved["layers"].append(layer)
        rank.slots_w13[layer], rank.slots_w2[layer] = new13, new2
        first = rank.rank * rank.slots_per_rank
        for i in range(min(rank.slots_per_rank, max_check_slots)):  # each moved slot holds its new expert's bytes
            w13, w2 = expert_weights(rank.cfg, layer, int(u.new_phy2log[first + i]), rank.device)
            if not (torch.equal(new13[i], w13) and torch.equal(new2[i], w2)):
                raise AssertionError(f"rank {rank.rank}: layer {layer} slot {first + i} does not hold expert "
                                     f"{int(u.new_phy2log[first + i])} after relocate_weights")
            moved["checked_slots"] += 1
    return moved


def run(rank, steps: int, every: int, step_fn: Callable[[int], float], recapture: Callable[[], None],
        max_check_slots: int, log: Callable[[str], None]) -> Dict:
    """`step_fn(i)` runs decode step i (new tokens) and returns its latency in seconds; `recapture()` rebuilds
    the decode graph after the placement changed. Returns the per-step utilization and latency timeline."""
    cfg = rank.cfg
    manager = eplb.make_manager(rank.location, buffer_steps=every, rebalance_every_steps=every,
                                num_groups=cfg.num_groups, policy="default", migration_aware=True)
    counts = eplb.DispatchCounts(cfg.layers, rank.num_physical, rank.num_ranks, rank.rank)
    for c in rank.counters:
        c.zero_()
    timeline: List[Dict] = []
    relocations: List[Dict] = []
    for i in range(steps):
        latency = step_fn(i)
        for layer, c in enumerate(rank.counters):
            counts.add_low_latency_cumulative(layer, c.cpu())
        total = eplb.all_reduce_counts(rank.group, counts.take())  # [layers, physical], every rank the same
        per_gpu = total.reshape(cfg.layers, rank.num_ranks, -1).sum(-1)
        report = manager.step(total)
        timeline.append({"step": i, "latency_us": latency * 1e6, "utilization": report.step_utilization,
                         "pairs_per_gpu": per_gpu.sum(0).tolist()})
        if report.rebalance_due:
            log(report.rebalance.to_log_line())
        if report.updates:
            moved = relocate(rank, report.updates, max_check_slots)
            moved.update(step=i, moved_experts=report.moved_experts)
            relocations.append(moved)
            rank.set_location(manager.location)
            recapture()
    return {"timeline": timeline, "relocations": relocations, "rebalances": manager.num_rebalances,
            "final_phy2log": manager.location.phy2log_table.tolist()}

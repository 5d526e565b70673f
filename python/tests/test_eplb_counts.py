"""epx.eplb's issue-16 pieces on numpy and host rank threads: DispatchCounts (normal dispatch, stat_approx,
low-latency counters across an int32 wrap, top-k), all_reduce_counts over 4 ranks, the rebalance gate
(SGLang's mean of per-step utilizations vs the buffer ratio) and the per-rebalance report (JSON + log line).

Routing of the multi-rank tests: 4 ranks, 2 layers, 8 physical slots (2 per rank); each rank routes its own
random top-2 tokens (some -1) to any slot; a rank "receives" the (token, slot) pairs whose slot is its own."""

import json

import numpy as np
import pytest

import epx
from epx import eplb

RANKS, LAYERS, SLOTS, TOPK = 4, 2, 8, 2
PER_RANK = SLOTS // RANKS


def routing(seed):
    """topk[rank][layer]: int64 [tokens, TOPK] physical slots, -1 for none."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(RANKS):
        layers = []
        for _ in range(LAYERS):
            t = rng.integers(0, SLOTS, size=(int(rng.integers(0, 30)), TOPK))
            t[rng.random(t.shape) < 0.1] = -1
            layers.append(t)
        out.append(layers)
    return out


def global_counts(topk):
    out = np.zeros((LAYERS, SLOTS), np.int64)
    for rank in topk:
        for layer, t in enumerate(rank):
            np.add.at(out[layer], t[t >= 0], 1)
    return out


def received(topk, dst, layer):
    """int32 [PER_RANK]: what rank dst receives per local slot in `layer`."""
    return global_counts(topk)[layer, dst * PER_RANK:(dst + 1) * PER_RANK].astype(np.int32)


@pytest.mark.parametrize("source", ["normal", "low_latency", "topk"])
def test_dispatch_counts_all_reduced_over_four_ranks(source):
    topk = routing(7)
    expected = global_counts(topk)

    def body(rank, group):
        counts = eplb.DispatchCounts(LAYERS, SLOTS, RANKS, rank, eplb.RecordMode.stat)
        assert (counts.rank, counts.num_layers, counts.num_physical, counts.num_gpus) == (rank, LAYERS, SLOTS, RANKS)
        # Low-latency counters that already hold an earlier pass's values: only the increase counts.
        earlier = np.full(PER_RANK, 5, np.int32)
        if source == "low_latency":
            for layer in range(LAYERS):
                counts.add_low_latency_cumulative(layer, earlier)
            counts.take()
        for layer in range(LAYERS):
            if source == "normal":
                counts.add_normal_dispatch(layer, received(topk, rank, layer))
            elif source == "low_latency":
                counts.add_low_latency_cumulative(layer, earlier + received(topk, rank, layer))
            else:
                counts.add_topk(layer, topk[rank][layer])
        mine = counts.take()
        assert mine.shape == (LAYERS, SLOTS) and mine.dtype == np.int64
        return mine, eplb.all_reduce_counts(group, mine)

    results = epx.run_host_ranks(epx.host_groups(RANKS), body)
    for rank, (mine, total) in enumerate(results):
        np.testing.assert_array_equal(total, expected)
        if source != "topk":  # received counts sit in the rank's own slots only
            own = np.zeros(SLOTS, bool)
            own[rank * PER_RANK:(rank + 1) * PER_RANK] = True
            assert (mine[:, ~own] == 0).all()


def test_dispatch_counts_stat_approx_and_counter_wrap():
    counts = eplb.DispatchCounts(1, 4, 2, 1, eplb.RecordMode.stat_approx)
    counts.add_normal_dispatch(0, np.array([128, 0], np.int32), expert_alignment=128)
    np.testing.assert_array_equal(counts.take(), [[0, 0, 128, 0]])
    exact = eplb.DispatchCounts(1, 4, 2, 1)
    with pytest.raises(epx.InvalidArgumentError, match="stat_approx"):
        exact.add_normal_dispatch(0, np.array([128, 0], np.int32), expert_alignment=128)
    # int32 counters that wrap: 2^31 - 2 -> -2^31 + 3 is an increase of 5; uint32 views of the same bits agree.
    ll = eplb.DispatchCounts(1, 4, 2, 0)
    ll.add_low_latency_cumulative(0, np.array([2**31 - 2, 7], np.int32))
    ll.take()
    ll.add_low_latency_cumulative(0, np.array([-2**31 + 3, 7], np.int32))
    np.testing.assert_array_equal(ll.take(), [[5, 0, 0, 0]])
    ll.add_low_latency_cumulative(0, np.array([2**31 + 10, 9], np.uint32))
    np.testing.assert_array_equal(ll.take(), [[7, 2, 0, 0]])
    ll.reset_low_latency_baseline(0)
    ll.add_low_latency_cumulative(0, np.array([4, 1], np.int64))
    np.testing.assert_array_equal(ll.take(), [[4, 1, 0, 0]])
    with pytest.raises(epx.InvalidArgumentError, match="is not a 32-bit counter value"):
        ll.add_low_latency_cumulative(0, np.array([2**32, 0], np.int64))
    # One pass must not mix received and sent counts.
    mixed = eplb.DispatchCounts(1, 4, 2, 0)
    mixed.add_topk(0, np.array([[0, 3]]))
    with pytest.raises(epx.InvalidArgumentError):
        mixed.add_normal_dispatch(0, np.array([1, 1], np.int32))
    with pytest.raises(epx.InvalidArgumentError):
        eplb.DispatchCounts(1, 4, 2, 2)  # rank outside [0, num_gpus)
    with pytest.raises(epx.InvalidArgumentError):
        eplb.DispatchCounts(1, 4, 2, 0, eplb.RecordMode.per_token)


def test_all_reduce_counts_rejects_bad_counts_on_every_rank():
    def body(rank, group):
        out = []
        # Sizes differ on rank 2: every rank raises, naming the ranks.
        try:
            eplb.all_reduce_counts(group, np.ones(5 if rank == 2 else 4, np.int64))
        except epx.InvalidArgumentError as e:
            out.append(str(e))
        # A float array on rank 1: that rank raises its conversion error after joining the call with no counts,
        # the others see the size mismatch (not a timeout, and the next call pairs up).
        try:
            eplb.all_reduce_counts(group, np.ones(3, np.float64) if rank == 1 else np.ones(3, np.int64))
        except epx.InvalidArgumentError as e:
            out.append(str(e))
        # A negative count on rank 3: every rank raises naming it.
        try:
            eplb.all_reduce_counts(group, np.array([1, -1 if rank == 3 else 1]))
        except epx.InvalidArgumentError as e:
            out.append(str(e))
        out.append(eplb.all_reduce_counts(group, [[rank, 1], [2, 3]]))
        return out

    results = epx.run_host_ranks(epx.host_groups(RANKS, timeout_ms=60_000), body)
    for rank, (sizes, floats, negative, total) in enumerate(results):
        assert "rank 2 passed 5 counts, rank 0 passed 4" in sizes
        if rank == 1:
            assert "counts: expected an integer array" in floats
        else:
            assert "rank 1 passed 0 counts" in floats
        assert "rank 3 has counts[1] = -1" in negative
        np.testing.assert_array_equal(total, [[0 + 1 + 2 + 3, 4], [8, 12]])


def test_gate_statistics_and_rebalance_report():
    # 2 GPUs x 2 slots, 1 layer. Steps alternate all load on GPU 0 / all on GPU 1: each step's utilization is
    # (mean + 1e-5) / (max + 1e-5) ~ 0.5, while the summed buffer is perfectly balanced (~1.0).
    initial = eplb.ExpertLocation.trivial(1, 4, 4, 2)
    a = np.array([[10, 10, 0, 0]])
    b = np.array([[0, 0, 10, 10]])
    for gate, skipped in (("mean_step", False), ("buffer", True)):
        mgr = eplb.make_manager(initial, buffer_steps=4, rebalance_every_steps=4, utilization_threshold=0.9,
                                policy="deepseek", gate_statistic=gate)
        reports = [mgr.step(c) for c in (a, b, a, b)]
        assert [r.rebalance_due for r in reports] == [False, False, False, True]
        rb = reports[-1].rebalance
        assert rb.gate_statistic == eplb.GateStatistic[gate] and rb.threshold == pytest.approx(0.9)
        assert rb.skipped == skipped and reports[-1].rebalance_skipped == skipped
        assert rb.step == 3 and rb.gpu_physical_count_sum == 20
        assert rb.current_step_balancedness == pytest.approx(reports[-1].step_utilization)
        assert rb.current_step_balancedness == pytest.approx((10 + 1e-5) / (20 + 1e-5))
        assert rb.last_10_average_balancedness == pytest.approx((10 + 1e-5) / (20 + 1e-5))
        if gate == "mean_step":
            assert rb.gate_window_steps == 4 and rb.gate_utilization == pytest.approx(0.5, abs=1e-6)
            assert rb.moved_experts == reports[-1].moved_experts
        else:
            assert rb.gate_window_steps == 4 and rb.gate_utilization == pytest.approx(1.0, abs=1e-6)
            assert rb.moved_experts == 0 and rb.placement_balancedness_after == rb.placement_balancedness_before
        j = json.loads(rb.to_json())
        assert j["gate_statistic"] == gate and j["skipped"] == skipped and j["step"] == 3
        assert j["gpu_physical_count_sum"] == 20 and j["moved_experts"] == rb.moved_experts
        line = rb.to_log_line()
        assert line.startswith("[Expert Balancedness] forward_pass_id=3 current_pass_balancedness=0.500 ")
        assert ("Skipped ep rebalancing" in line) == skipped
        rec = mgr.recorder
        np.testing.assert_allclose(rec.step_utilizations(10), [(10 + 1e-5) / (20 + 1e-5)] * 4)
        assert rec.mean_step_utilization(2) == pytest.approx((10 + 1e-5) / (20 + 1e-5))
        assert rec.last_step_count_sum == 20
    assert epx._epx.eplb.gate_statistic_from_string("buffer") == eplb.GateStatistic.buffer
    with pytest.raises(epx.InvalidArgumentError, match="gate_statistic: 'median' is not one of"):
        eplb.make_manager(initial, buffer_steps=4, rebalance_every_steps=4, gate_statistic="median")


def test_simulate_reports_each_due_rebalance_like_the_cli():
    # Pinned from `epx eplb simulate --layers 4 --experts 16 --replicas 20 --groups 4 --nodes 1 --gpus 4 --steps 60
    #  --tokens 256 --buffer 20 --every 20 [--gate buffer --threshold 0.5]`, whose "rebalances" are equal.
    shape = dict(layers=4, experts=16, replicas=20, groups=4, nodes=1, gpus=4, steps=60, tokens=256, buffer=20,
                 every=20)
    r = eplb.simulate(**shape)
    assert r.settings["gate_statistic"] == "mean_step"
    assert [d["step"] for d in r.rebalances] == [19, 39, 59]
    assert [(d["skipped"], d["moved_experts"]) for d in r.rebalances] == [(False, 34), (False, 16), (False, 17)]
    assert [d["gate_utilization"] for d in r.rebalances] == pytest.approx([0.6925, 0.8721, 0.8968], abs=1e-4)
    assert all(d["gate_statistic"] == "mean_step" and d["gate_window_steps"] == 20 for d in r.rebalances)
    assert sum(d["moved_experts"] for d in r.rebalances) == r.moved_experts == 67
    assert r.as_dict()["rebalances"] == r.rebalances
    # The buffer ratio is above 0.5 at every rebalance: all skipped, nothing moved.
    b = eplb.simulate(**shape, gate="buffer", threshold=0.5)
    assert b.settings["gate_statistic"] == "buffer" and b.settings["threshold"] == 0.5
    assert [(d["skipped"], d["moved_experts"]) for d in b.rebalances] == [(True, 0)] * 3
    assert all(d["gate_utilization"] > 0.5 for d in b.rebalances)
    assert (b.rebalances_skipped, b.rebalances_computed, b.moved_experts) == (3, 0, 0)

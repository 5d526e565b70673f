"""epx.eplb on numpy: placement (DeepSeek's published example, invariants on random loads), balancedness,
ExpertLocation + JSON, replica choice, the recorder and manager, relocation over 4 host rank threads, the
simulation (bit-equal to `epx eplb simulate`) and bad input."""

import json

import numpy as np
import pytest

import epx
from epx import eplb

# DeepSeek EPLB README: 2 layers, 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs.
DEEPSEEK_WEIGHT = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                            [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
DEEPSEEK_PHY2LOG = np.array([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                             [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])
DEEPSEEK_LOGCNT = np.array([[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
                            [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]])


def check_consistent(p, weight_shape, num_physical):
    num_layers, num_logical = weight_shape
    assert p.phy2log.shape == (num_layers, num_physical) and p.phy2log.dtype == np.int32
    assert p.log2phy.shape == (num_layers, num_logical, p.max_replicas)
    assert p.logcnt.shape == (num_layers, num_logical)
    assert (p.logcnt >= 1).all()
    assert (p.logcnt.sum(axis=1) == num_physical).all()
    assert p.max_replicas == p.logcnt.max()
    for layer in range(num_layers):
        for e in range(num_logical):
            slots = p.log2phy[layer, e]
            valid = slots[: p.logcnt[layer, e]]
            assert (slots[p.logcnt[layer, e]:] == -1).all()
            assert sorted(valid.tolist()) == np.flatnonzero(p.phy2log[layer] == e).tolist()


def test_deepseek_published_example():
    p = eplb.rebalance(DEEPSEEK_WEIGHT, num_physical=16, num_gpus=8, num_groups=4, num_nodes=2, policy="deepseek")
    np.testing.assert_array_equal(p.phy2log, DEEPSEEK_PHY2LOG)
    np.testing.assert_array_equal(p.logcnt, DEEPSEEK_LOGCNT)
    assert p.hierarchical and p.max_replicas == 2
    check_consistent(p, DEEPSEEK_WEIGHT.shape, 16)
    # The same placement from int32, float32 and a non-contiguous (transposed) view of the loads.
    for w in (DEEPSEEK_WEIGHT.astype(np.int32), DEEPSEEK_WEIGHT.astype(np.float32),
              np.asfortranarray(DEEPSEEK_WEIGHT.astype(np.float64)), DEEPSEEK_WEIGHT.tolist()):
        np.testing.assert_array_equal(eplb.rebalance(w, 16, 8, 4, 2, eplb.Policy.deepseek).phy2log, DEEPSEEK_PHY2LOG)


@pytest.mark.parametrize("groups,nodes", [(4, 2), (1, 1), (3, 2)])
def test_random_loads_invariants(groups, nodes):
    rng = np.random.default_rng(5)
    weight = rng.integers(0, 1000, size=(6, 24)).astype(np.float64)
    trivial = eplb.trivial_phy2log(6, 24, 32)
    np.testing.assert_array_equal(trivial, np.tile(np.arange(32) % 24, (6, 1)))
    base = eplb.balancedness(weight, trivial, 8)
    deepseek = eplb.rebalance(weight, 32, 8, groups, nodes, "deepseek")
    default = eplb.rebalance(weight, 32, 8, groups, nodes, "default")
    for p in (deepseek, default):
        check_consistent(p, weight.shape, 32)
        np.testing.assert_array_equal(eplb.placement_from_phy2log(p.phy2log, 24).logcnt, p.logcnt)
    b_deepseek = eplb.balancedness_per_layer(weight, deepseek.phy2log, 8)
    b_default = eplb.balancedness_per_layer(weight, default.phy2log, 8)
    assert b_deepseek.shape == (6,)
    assert (b_default >= b_deepseek - 1e-12).all()  # "never less balanced"
    assert eplb.balancedness(weight, default.phy2log, 8) == pytest.approx(b_default.mean())
    assert b_deepseek.mean() > base
    # gpu_loads is the balancedness model: mean / max per layer.
    loads = eplb.gpu_loads(weight, default.phy2log, 8)
    assert loads.shape == (6, 8)
    np.testing.assert_allclose(loads.sum(axis=1), weight.sum(axis=1))
    np.testing.assert_allclose(loads.mean(axis=1) / loads.max(axis=1), b_default)


def test_migration_aware_keeps_a_balanced_placement():
    rng = np.random.default_rng(1)
    weight = rng.integers(1, 500, size=(4, 16)).astype(np.float64)
    current = eplb.rebalance(weight, 24, 4, policy="default").phy2log
    r = eplb.rebalance_migration_aware(weight, current, 24, 4)
    assert r.moved_experts == 0  # the current placement is already the fresh one
    np.testing.assert_array_equal(r.placement.phy2log, current)
    assert eplb.count_moved_experts(current, r.placement.phy2log) == 0
    moved = eplb.rebalance_migration_aware(weight[:, ::-1].copy(), current, 24, 4)
    assert moved.moved_experts == eplb.count_moved_experts(current, moved.placement.phy2log)
    assert moved.moved_experts <= moved.fresh_moved_experts


def test_expert_location_json_and_layers():
    p = eplb.rebalance(DEEPSEEK_WEIGHT, 16, 8, 4, 2, "deepseek")
    loc = eplb.ExpertLocation.from_placement(p, num_gpus=8, num_nodes=2)
    assert (loc.num_layers, loc.num_logical, loc.num_physical, loc.slots_per_gpu, loc.gpus_per_node) == (2, 12, 16, 2, 4)
    np.testing.assert_array_equal(loc.phy2log_table, DEEPSEEK_PHY2LOG)
    assert loc.replicas(0, 5).tolist() == [0, 2] and loc.replica_count(1, 11) == 1
    assert loc.gpu_of_slot(15) == 7 and loc.max_replicas == 2
    text = loc.to_json()
    assert json.loads(text)["phy2log"] == DEEPSEEK_PHY2LOG.tolist()
    again = eplb.ExpertLocation.from_json(text)
    assert again == loc
    assert eplb.ExpertLocation(8, 2, DEEPSEEK_PHY2LOG, num_logical=12) == loc
    table = loc.phy2log_table
    assert not table.flags.writeable
    loc.set_layer(1, DEEPSEEK_PHY2LOG[0])
    np.testing.assert_array_equal(loc.phy2log(1), DEEPSEEK_PHY2LOG[0])
    np.testing.assert_array_equal(table[1], DEEPSEEK_PHY2LOG[1])  # a held table does not change
    assert loc != again
    with pytest.raises(epx.InvalidArgumentError):
        eplb.ExpertLocation.from_json('{"num_layers": 1}')
    with pytest.raises(ValueError):  # expert 11 has no replica
        loc.set_layer(0, np.zeros(16, np.int32))


def test_choose_replicas():
    loc = eplb.ExpertLocation.trivial(1, 4, 8, num_gpus=4)  # slots 0..7 hold 0,1,2,3,0,1,2,3; GPU g: slots 2g, 2g+1
    topk = np.array([[0, 1], [2, -1], [3, 0]], dtype=np.int64)
    out = eplb.choose_replicas(loc, 0, topk, gpu=2)  # GPU 2 holds slots 4 (expert 0) and 5 (expert 1)
    assert out.dtype == np.int64 and out.shape == (3, 2)
    assert out[0].tolist() == [4, 5] and out[1, 1] == -1 and out[2, 1] == 4
    assert out[1, 0] in (2, 6) and out[2, 0] in (3, 7)
    dyn = eplb.choose_replicas(loc, 0, topk, gpu=0, mode="dynamic", seed=3)
    for t in range(3):
        for k in range(2):
            e = topk[t, k]
            assert dyn[t, k] == -1 if e < 0 else dyn[t, k] in loc.replicas(0, int(e)).tolist()
    with pytest.raises(epx.InvalidArgumentError):
        eplb.choose_replicas(loc, 0, np.array([[4]]), gpu=0)  # expert out of range


def test_recorder_loads_and_utilization():
    loc = eplb.ExpertLocation.trivial(2, 3, 4, num_gpus=2)  # slot 3 holds expert 0
    rec = eplb.make_recorder(2, 3, 4, 2, buffer_steps=2, mode="per_pass")
    counts = [np.array([[1, 2, 3, 4], [0, 0, 0, 8]]), np.array([[10, 0, 0, 0], [1, 1, 1, 1]]),
              np.array([[5, 5, 5, 5], [2, 0, 0, 0]])]
    for c in counts:
        rec.record_pass(loc, c)
        rec.end_step()
    assert rec.num_steps == 3 and rec.steps_in_buffer == 2 and rec.mode == eplb.RecordMode.per_pass
    np.testing.assert_array_equal(rec.physical_loads(2), counts[1] + counts[2])
    np.testing.assert_array_equal(rec.physical_loads(1), counts[2])
    np.testing.assert_array_equal(rec.logical_loads(1), [[10, 5, 5], [2, 0, 0]])
    gpu = (counts[2].reshape(2, 2, 2).sum(axis=2)).astype(float)
    np.testing.assert_allclose(rec.utilization_per_layer(1), (gpu.mean(1) + 1e-5) / (gpu.max(1) + 1e-5))
    assert rec.utilization(1) == pytest.approx(rec.utilization_per_layer(1).mean())
    records = rec.records()  # every pass since construction (not only the buffered steps), as SGLang keeps them
    assert [r["step"] for r in records] == [0, 1, 2] and [r["forward_pass_id"] for r in records] == [1, 2, 3]
    np.testing.assert_array_equal(records[2]["global_physical_count"], counts[2])
    rec.clear()
    assert rec.steps_in_buffer == 0 and rec.num_steps == 3
    with pytest.raises(epx.InvalidArgumentError):
        rec.record_pass(loc, np.zeros((2, 3), np.int64))  # wrong size


def test_manager_rebalances_and_applies_layers_in_chunks():
    num_layers, num_logical, num_physical, num_gpus = 4, 8, 12, 4
    initial = eplb.ExpertLocation.trivial(num_layers, num_logical, num_physical, num_gpus)
    mgr = eplb.make_manager(initial, buffer_steps=2, rebalance_every_steps=2, utilization_threshold=0.99,
                            layers_per_step=3, policy="deepseek")
    skew = np.tile(np.arange(num_physical, dtype=np.int64) ** 2, (num_layers, 1))  # hot high slots
    r0 = mgr.step(skew)
    assert not r0.rebalance_computed and r0.updates == []
    r1 = mgr.step(skew)
    assert r1.rebalance_computed and [u.layer for u in r1.updates] == [0, 1, 2]
    assert mgr.num_pending_layers == 1 and mgr.num_rebalances == 1
    for u in r1.updates:
        np.testing.assert_array_equal(u.new_phy2log, mgr.location.phy2log(u.layer))
        np.testing.assert_array_equal(u.old_phy2log, initial.phy2log(u.layer))
    assert r1.moved_experts == sum(eplb.count_moved_experts(u.old_phy2log, u.new_phy2log) for u in r1.updates)
    r2 = mgr.step(skew)
    assert [u.layer for u in r2.updates] == [3] and mgr.num_pending_layers == 0
    assert mgr.total_moved_experts == r1.moved_experts + r2.moved_experts
    assert mgr.recorder.num_steps == 3
    with pytest.raises(epx.InvalidArgumentError):
        eplb.make_manager(initial, buffer_steps=10, rebalance_every_steps=5)  # N < buffer


def test_relocation_over_four_host_ranks():
    num_ranks, old_per_rank, new_per_rank, hidden = 4, 3, 4, 5
    rng = np.random.default_rng(2)
    old = rng.permutation(np.arange(num_ranks * old_per_rank) % 10).astype(np.int32)
    new = rng.permutation(np.arange(num_ranks * new_per_rank) % 10).astype(np.int32)
    plan = eplb.plan_relocation(old, new, num_ranks, num_nodes=2)
    assert (plan.num_ranks, plan.old_slots_per_rank, plan.new_slots_per_rank) == (4, 3, 4)
    assert len(plan.slots) == 16 and plan.lost_experts.size == 0
    assert [s.expert for s in plan.slots] == new.tolist()
    assert plan.num_transfers == plan.count(eplb.SlotAction.peer_intra_node) + plan.count(
        eplb.SlotAction.peer_inter_node)

    def expert_rows(ids):  # a weight row that says which expert it belongs to
        return np.repeat(ids.astype(np.float32)[:, None], hidden, axis=1) * 10 + np.arange(hidden, dtype=np.float32)

    def body(rank, group):
        old_w = expert_rows(old[rank * old_per_rank:(rank + 1) * old_per_rank])
        new_w = np.full((new_per_rank, hidden), -1.0, np.float32)
        stats = eplb.relocate_weights(plan, group, [old_w], [new_w], max_slots_per_round=2)
        return new_w, stats

    results = epx.run_host_ranks(epx.host_groups(num_ranks), body)
    for rank, (new_w, stats) in enumerate(results):
        np.testing.assert_array_equal(new_w, expert_rows(new[rank * new_per_rank:(rank + 1) * new_per_rank]))
        assert stats.bytes_received == stats.slots_received * hidden * 4
    assert sum(s.slots_received for _, s in results) == plan.num_transfers
    failed = eplb.plan_relocation(old, new, num_ranks, failed_ranks=[False, True, False, False])
    assert failed.count(eplb.SlotAction.dead_rank) == new_per_rank


def test_relocation_transport_choice_on_host_groups():
    plan = eplb.plan_relocation(np.array([0, 1], np.int32), np.array([1, 0], np.int32), 2)
    assert eplb.choose_transport(epx.host_groups(1)[0]) == "host"

    def body(rank, group, transport):
        old_w = np.full((1, 3), float(rank), np.float32)
        new_w = np.full((1, 3), -1.0, np.float32)
        eplb.relocate_weights(plan, group, [old_w], [new_w], transport=transport)
        return new_w

    for transport in ("auto", "host"):
        results = epx.run_host_ranks(epx.host_groups(2), lambda r, g: body(r, g, transport))
        assert [w[0, 0] for w in results] == [1.0, 0.0]
    group = epx.host_groups(1)[0]
    one = eplb.plan_relocation(np.array([0], np.int32), np.array([0], np.int32), 1)
    w = np.zeros((1, 3), np.float32)
    for transport, needle in (("nccl", "needs a cuda group"), ("cuda", "needs a cuda group"),
                              ("carrier-pigeon", "transport must be")):
        with pytest.raises(epx.InvalidArgumentError, match=needle):
            eplb.relocate_weights(one, group, [w], [w.copy()], transport=transport)


def test_simulate_matches_the_cli():
    # `epx eplb simulate --layers 8 --experts 32 --replicas 40 --groups 4 --nodes 2 --gpus 8 --steps 300
    #  --tokens 512 --buffer 50 --every 50 --layers-per-step 4` (same seed and defaults otherwise).
    r = eplb.simulate(layers=8, experts=32, replicas=40, groups=4, nodes=2, gpus=8, steps=300, tokens=512, buffer=50,
                      every=50, layers_per_step=4)
    assert r.mean_utilization_rebalanced == 0.7232486331391644
    assert r.mean_utilization_static == 0.412965923554957
    assert (r.rebalances_computed, r.rebalances_skipped, r.moved_experts) == (6, 0, 380)
    assert r.steps.tolist() == [50, 100, 150, 200, 250, 300]
    np.testing.assert_array_equal(r.utilization_rebalanced[:2], [0.46280436923994983, 0.7828850410649115])
    np.testing.assert_array_equal(r.utilization_static[-1], 0.4251021888843998)
    assert r.gpu_load_static.sum() == pytest.approx(r.logical_load.sum())
    assert r.gpu_load_rebalanced.max() < r.gpu_load_static.max()
    d = r.as_dict()
    assert d["timeline"][1] == {"step": 100, "utilization_rebalanced": 0.7828850410649115,
                                "utilization_static": 0.41479842774942655}
    json.dumps(d)


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from epx import plot

    r = eplb.simulate(layers=2, experts=8, replicas=12, groups=2, nodes=1, gpus=4, steps=60, tokens=64, buffer=10,
                      every=10, report_every=10)
    plot.simulation_report(r, str(tmp_path / "r.png"))
    plot.utilization_over_time(r.as_dict(), path=str(tmp_path / "u.png"))  # the CLI's JSON works too
    assert plot.main([str(tmp_path / "none.json")]) == 2
    (tmp_path / "sim.json").write_text(json.dumps(r.as_dict()))
    assert plot.main([str(tmp_path / "sim.json"), str(tmp_path / "cli.png")]) == 0
    for name in ("r.png", "u.png", "cli.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("call,needle", [
    (lambda: eplb.rebalance(-DEEPSEEK_WEIGHT, 16, 8), "weight"),
    (lambda: eplb.rebalance(np.array([[1.0, np.nan]]), 2, 1), "weight"),
    (lambda: eplb.rebalance(DEEPSEEK_WEIGHT[0], 16, 8), "weight: expected 2 dimensions, got 1"),
    (lambda: eplb.rebalance(DEEPSEEK_WEIGHT, 8, 8), "physical experts) must be >= the 12 logical experts"),
    (lambda: eplb.rebalance(DEEPSEEK_WEIGHT, 16, 8, policy="fastest"), "policy: 'fastest' is not one of"),
    (lambda: eplb.rebalance("abc", 16, 8), "weight"),
    (lambda: eplb.balancedness(DEEPSEEK_WEIGHT, DEEPSEEK_PHY2LOG.astype(np.float32), 8), "phy2log: expected an integer"),
    (lambda: eplb.count_moved_experts(np.array([2**40]), np.array([0])), "does not fit 32-bit"),
    (lambda: eplb.make_recorder(1, 2, 3, 2), "num_physical"),
    (lambda: eplb.plan_relocation([0, 1, 2], [0, 1, 2], 2), "num_ranks"),
])
def test_bad_input_raises_invalid_argument(call, needle):
    with pytest.raises(epx.InvalidArgumentError) as info:
        call()
    assert isinstance(info.value, ValueError)
    assert needle in str(info.value)
    assert info.value.code == "invalid_argument"

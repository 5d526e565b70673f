"""Multi-node expert parallelism from Python on the host backend (issue 17): ranks as threads, numpy only.

Topologies: 4 ranks as 2 nodes x 2 ranks (gpus_per_node=2) and 4 nodes x 1 rank (gpus_per_node=1), numbered
node-major (2 x 2: ranks 0, 1 on node 0 and 2, 3 on node 1). Routing: E = 16 experts, 4 per rank; token t of rank
r picks K = 4 distinct experts from a generator seeded by r, every fifth token has one -1 slot, token 0 of every
rank goes nowhere, and rank 3 is idle (T = 0) in the idle case. Data: bf16 values k / 8 with |k| <= 16, so every
fp32 sum is exact and the hierarchical combine must equal the flat one bit for bit (include/epx/buffer.h,
CombineResult); bf16 travels as uint16 bits (epx.bf16), so neither ml_dtypes nor torch is needed.
"""

import numpy as np
import pytest

import epx

R, E, K, H = 4, 16, 4, 64
NUM_LOCAL = E // R


def bf16_bits(values):
    """uint16 bf16 bits of float32 values that bf16 holds exactly."""
    return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bits(array):
    """An output's bf16 bits (a uint16 array, or ml_dtypes.bfloat16 when that is installed)."""
    return np.asarray(array).view(np.uint16)


def to_f32(bf16):
    return (bits(bf16).astype(np.uint32) << 16).view(np.float32)


def make_inputs(rank, num_tokens):
    rng = np.random.default_rng(1700 + rank)
    x = bf16_bits(rng.integers(-16, 17, (num_tokens, H)) / 8)
    idx = np.array([rng.permutation(E)[:K] for _ in range(num_tokens)], np.int64).reshape(num_tokens, K)
    idx[::5, 1] = -1
    if num_tokens:
        idx[0] = -1
    weights = rng.random((num_tokens, K)).astype(np.float32)
    return x, idx, weights


def inputs_for(idle):
    return [make_inputs(r, 0 if (idle and r == R - 1) else 37 + 5 * r) for r in range(R)]


def destinations(idx):
    """bool [T, R]: token t has an expert on rank d."""
    return np.stack([((idx >= 0) & (idx // NUM_LOCAL == d)).any(axis=1) for d in range(R)], axis=1).reshape(-1, R)


def run(gpus_per_node, fn):
    return epx.run_host_ranks(epx.host_groups(R, gpus_per_node=gpus_per_node), fn)


def test_topology_of_host_groups():
    groups = epx.host_groups(R, gpus_per_node=2)
    for rank, group in enumerate(groups):
        t = group.topology
        assert (t.num_nodes, t.gpus_per_node, t.num_ranks) == (2, 2, R)
        assert (t.node_of(rank), t.local_rank_of(rank)) == (rank // 2, rank % 2)
        assert t.rank_of(rank // 2, rank % 2) == rank
    assert groups[0].topology == groups[3].topology
    assert repr(groups[0].topology) == "epx.Topology(num_nodes=2, gpus_per_node=2)"
    assert "num_nodes=2" in repr(groups[1])
    one = epx.host_groups(R)[0].topology  # default: one node holding every rank
    assert (one.num_nodes, one.gpus_per_node) == (1, R)
    assert epx.host_groups(R, gpus_per_node=1)[0].topology.num_nodes == R
    assert epx.host_groups(R, gpus_per_node=R)[0].topology.num_nodes == 1
    with pytest.raises(epx.InvalidArgumentError, match=r"rank: 4 is outside \[0, 4\)"):
        groups[0].topology.node_of(4)
    with pytest.raises(epx.InvalidArgumentError, match="local_rank: 2"):
        groups[0].topology.rank_of(0, 2)


@pytest.mark.parametrize("gpus_per_node, match", [
    (3, "gpus_per_node = 3 must divide num_ranks = 4"),
    (5, r"gpus_per_node must be in \[0, num_ranks = 4\] \(0: one node\), got 5"),
    (-1, "gpus_per_node must be in .*got -1"),
])
def test_bad_gpus_per_node_names_the_argument(gpus_per_node, match):
    with pytest.raises(epx.InvalidArgumentError, match=match):
        epx.host_groups(R, gpus_per_node=gpus_per_node)
    # The CUDA constructors check it before touching a GPU, in CUDA and host-only builds alike.
    with pytest.raises(epx.InvalidArgumentError, match=match):
        epx.cuda_groups([0] * R, gpus_per_node=gpus_per_node)
    if not epx.built_with_cuda():
        with pytest.raises(epx.InvalidArgumentError, match=match):
            epx._epx.cuda_group_from_nccl_id(b"\0" * 128, 0, R, 0, gpus_per_node=gpus_per_node)


def test_normal_routing_argument():
    group = epx.host_groups(1)[0]
    assert epx.Buffer(group).normal_routing == epx.NormalRouting.auto
    assert epx.Buffer(group, normal_routing="hierarchical").normal_routing == epx.NormalRouting.hierarchical
    assert epx.Buffer(group, normal_routing=epx.NormalRouting.flat).normal_routing == epx.NormalRouting.flat
    # The routing taken: auto resolved by the topology (one node: flat; two: hierarchical), forced kept.
    assert epx.Buffer(group).resolved_normal_routing == epx.NormalRouting.flat
    assert epx.Buffer(group).resolved_low_latency_routing == epx.LowLatencyRouting.flat
    assert epx.Buffer(group, normal_routing="hierarchical").resolved_normal_routing == epx.NormalRouting.hierarchical
    with pytest.raises(epx.InvalidArgumentError, match="normal_routing: 'diagonal' is not one of auto, flat, "
                                                       "hierarchical"):
        epx.Buffer(group, normal_routing="diagonal")


@pytest.mark.parametrize("gpus_per_node", [2, 1])
def test_layout_counts_tokens_per_node(gpus_per_node):
    inputs = inputs_for(idle=False)
    num_nodes = R // gpus_per_node

    def fn(rank, group):
        _, idx, _ = inputs[rank]
        layout = epx.Buffer(group).get_dispatch_layout(idx, E)
        dest = destinations(idx)
        per_node = dest.reshape(-1, num_nodes, gpus_per_node).any(axis=2).sum(axis=0)
        assert np.asarray(layout.num_tokens_per_node).dtype == np.int32
        assert np.asarray(layout.num_tokens_per_node).tolist() == per_node.tolist()
        assert np.asarray(layout.num_tokens_per_rank).tolist() == dest.sum(axis=0).tolist()
        return True

    assert all(run(gpus_per_node, fn))
    # One node: a single entry, the tokens that go anywhere.
    _, idx, _ = inputs[0]
    one = epx.Buffer(epx.host_groups(1)[0]).get_dispatch_layout(idx, E)
    assert np.asarray(one.num_tokens_per_node).tolist() == [int((idx >= 0).any(axis=1).sum())]


def exchange(gpus_per_node, routing, inputs, pass_layout):
    """Every rank's fresh, cached and worst-token dispatch and its combine (identity experts), as numpy."""

    def fn(rank, group):
        buffer = epx.Buffer(group, normal_routing=routing)
        x, idx, w = inputs[rank]
        layout = buffer.get_dispatch_layout(idx, E) if pass_layout else None
        res = buffer.dispatch(epx.bf16(x), idx, w, num_experts=E, layout=layout)
        recv = bits(res.recv_x).copy()
        cached = buffer.dispatch(epx.bf16(x), handle=res.handle)
        worst = buffer.dispatch(epx.bf16(x), idx, w, num_experts=E, num_worst_tokens=sum(len(i[0]) for i in inputs))
        out = buffer.combine(epx.bf16(recv), res.handle, res.recv_topk_weights)
        return dict(recv_x=recv, recv_src_idx=np.asarray(res.recv_src_idx).copy(),
                    recv_topk_idx=np.asarray(res.recv_topk_idx).copy(),
                    recv_topk_weights=np.asarray(res.recv_topk_weights).copy(),
                    counts=list(res.num_recv_tokens_per_expert),
                    prefix=np.asarray(res.rank_prefix_matrix).copy(), cached_x=bits(cached.recv_x).copy(),
                    worst_x=bits(worst.recv_x).copy(), worst_src=np.asarray(worst.recv_src_idx).copy(),
                    out_x=bits(out.x).copy(), out_w=np.asarray(out.topk_weights).copy())

    return run(gpus_per_node, fn)


@pytest.mark.parametrize("gpus_per_node", [2, 1])
@pytest.mark.parametrize("idle", [False, True])
def test_hierarchical_equals_flat(gpus_per_node, idle):
    inputs = inputs_for(idle)
    flat = exchange(gpus_per_node, "flat", inputs, pass_layout=False)
    for routing, pass_layout in (("hierarchical", False), ("auto", True)):
        hier = exchange(gpus_per_node, routing, inputs, pass_layout)
        for rank in range(R):
            for key, value in flat[rank].items():
                assert np.array_equal(np.asarray(hier[rank][key]), np.asarray(value)), (routing, rank, key)

    # And both against the contract: rows by source rank then token, combine = x * (ranks the token went to).
    for rank in range(R):
        got = flat[rank]
        src = [(s, t) for s in range(R) for t in np.flatnonzero(destinations(inputs[s][1])[:, rank])]
        assert got["recv_src_idx"].tolist() == [t for _, t in src]
        assert np.array_equal(got["recv_x"], np.array([inputs[s][0][t] for s, t in src]).reshape(-1, H))
        assert np.array_equal(got["cached_x"], got["recv_x"])
        n = len(src)
        assert np.array_equal(got["worst_x"][:n], got["recv_x"]) and (got["worst_src"][n:] == -1).all()
        x, idx, w = inputs[rank]
        fan = destinations(idx).sum(axis=1, keepdims=True)
        assert np.array_equal(to_f32(got["out_x"]), to_f32(x) * fan)
        assert np.array_equal(got["out_w"], np.where(idx >= 0, w, 0).astype(np.float32))
        assert got["prefix"][:, rank].tolist() == np.cumsum(
            [int(destinations(inputs[s][1])[:, rank].sum()) for s in range(R)]).tolist()


@pytest.mark.parametrize("gpus_per_node, routing, partials, expected", [
    (2, "flat", "fp32", 1.0), (2, "hierarchical", "fp32", 1.0078125), (2, "auto", "fp32", 1.0078125),
    (1, "hierarchical", "fp32", 1.0), (2, "hierarchical", "bf16", 1.0), (2, "flat", "bf16", 1.0),
])
def test_combine_order_shows_the_routing(gpus_per_node, routing, partials, expected):
    """One token of rank 0 goes to all four ranks, which return 1, 2^-8, 2^-24 and 2^-24. Flat order (and one rank
    per node): ((1 + 2^-8) + 2^-24) + 2^-24 = 1 + 2^-8 in fp32 (each 2^-24 is a tie, kept even), which rounds to
    bf16 1.0 (a tie again). 2 x 2 hierarchical: (1 + 2^-8) + (2^-24 + 2^-24) = 1 + 2^-8 + 2^-23, above the tie: bf16
    1 + 2^-7. With bf16 node partials node 0's 1 + 2^-8 rounds (a tie) to 1 first, so 1 + 2^-23 rounds to 1.0; the
    flat routing ignores node_partials. So the result tells which path ran."""
    values = [1.0, 2.0 ** -8, 2.0 ** -24, 2.0 ** -24]

    def fn(rank, group):
        buffer = epx.Buffer(group, normal_routing=routing, node_partials=partials)
        assert buffer.node_partials == epx.NodePartials[partials]
        num_tokens = 1 if rank == 0 else 0
        x = bf16_bits(np.ones((num_tokens, H)))
        idx = np.array([[0, 4, 8, 12]] * num_tokens, np.int64).reshape(num_tokens, 4)
        res = buffer.dispatch(epx.bf16(x), idx, num_experts=E)
        assert bits(res.recv_x).shape == (1, H)
        out = buffer.combine(epx.bf16(bf16_bits(np.full((1, H), values[rank]))), res.handle)
        return to_f32(out.x)

    results = run(gpus_per_node, fn)
    assert results[0].shape == (1, H) and (results[0] == expected).all()


def test_resolved_routings_follow_the_topology():
    # Two nodes of two ranks: auto resolves to hierarchical on both paths; flat, when asked, stays flat.
    def fn(rank, group):
        auto = epx.Buffer(group)
        flat = epx.Buffer(group, normal_routing="flat", low_latency_routing="flat")
        return (auto.resolved_normal_routing, auto.resolved_low_latency_routing, flat.resolved_normal_routing,
                flat.resolved_low_latency_routing)

    for got in run(2, fn):
        assert got == (epx.NormalRouting.hierarchical, epx.LowLatencyRouting.hierarchical, epx.NormalRouting.flat,
                       epx.LowLatencyRouting.flat)


def test_node_partials_argument():
    group = epx.host_groups(1)[0]
    assert epx.Buffer(group).node_partials == epx.NodePartials.fp32
    assert epx.Buffer(group, node_partials=epx.NodePartials.bf16).node_partials == epx.NodePartials.bf16
    with pytest.raises(epx.InvalidArgumentError, match="node_partials: 'fp16' is not one of fp32, bf16"):
        epx.Buffer(group, node_partials="fp16")


def test_low_latency_routing_argument():
    group = epx.host_groups(1)[0]
    assert epx.Buffer(group).low_latency_routing == epx.LowLatencyRouting.auto
    assert (epx.Buffer(group, low_latency_routing="hierarchical").low_latency_routing
            == epx.LowLatencyRouting.hierarchical)
    assert (epx.Buffer(group, low_latency_routing=epx.LowLatencyRouting.flat).low_latency_routing
            == epx.LowLatencyRouting.flat)
    with pytest.raises(epx.InvalidArgumentError, match="low_latency_routing: 'diagonal' is not one of auto, flat, "
                                                       "hierarchical"):
        epx.Buffer(group, low_latency_routing="diagonal")


@pytest.mark.parametrize("gpus_per_node", [2, 1])
def test_low_latency_across_nodes(gpus_per_node):
    """The hierarchical low-latency routing (auto on more than one node) receives what the flat one does, bit for
    bit, hooks included, and its combine equals the flat one (k / 8 values and weights in sixteenths: exact fp32
    sums, so the node partials add up to the same bits)."""
    M, LL_H = 64, 2 * H  # low-latency rows are a multiple of 128 wide
    inputs = [(np.concatenate([x, x], axis=1), idx, (np.round(w * 16) / 16).astype(np.float32))
              for x, idx, w in inputs_for(idle=True)]
    nbytes = epx.low_latency_buffer_size_hint(M, LL_H, R, E)

    def fn(rank, group):
        x, idx, w = inputs[rank]
        out = {}
        for routing in ("flat", "auto"):
            buffer = epx.Buffer(group, num_low_latency_bytes=nbytes, low_latency_routing=routing)
            d = buffer.low_latency_dispatch(epx.bf16(x), idx, M, E, return_recv_hook=True)
            d.recv_hook()
            counts = np.asarray(d.recv_count).copy()
            rows = [bits(d.recv_x[e, :counts[e]]).copy() for e in range(NUM_LOCAL)]
            c = buffer.low_latency_combine(epx.bf16(bits(d.recv_x)), idx, w, d.handle)
            out[routing] = (counts, np.asarray(d.recv_src_info).copy(), np.asarray(d.recv_layout_range).copy(),
                            rows, bits(c.x).copy())
        flat, hier = out["flat"], out["auto"]
        for a, b in zip(flat[:3], hier[:3]):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(flat[3], hier[3]):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(flat[4], hier[4])
        expect = to_f32(x) * np.where(idx >= 0, w, 0).sum(1, keepdims=True)
        np.testing.assert_allclose(to_f32(hier[4]), expect, rtol=2 ** -8, atol=0)
        return True

    assert all(run(gpus_per_node, fn))


def round_bf16(f32):
    """float32 values rounded to the nearest bf16 (ties to even), as float32 (no NaNs here)."""
    u = np.asarray(f32, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)
    return (r << 16).view(np.float32)


@pytest.mark.parametrize("gpus_per_node", [2, 1])
def test_low_latency_bf16_node_partials(gpus_per_node):
    """node_partials="bf16" on the hierarchical low-latency routing: out = bf16(sum over nodes ascending of
    bf16(p_n)), p_n = 0 + w * x over the node's top-k slots ascending in fp32 (include/epx/buffer.h,
    LowLatencyCombineResult), computed here in numpy; the fp32 partials of the same call differ from it somewhere."""
    M, LL_H = 64, 2 * H
    rng = np.random.default_rng(4242)
    inputs = [(np.concatenate([x, x], axis=1), idx, rng.random(w.shape).astype(np.float32))
              for x, idx, w in inputs_for(idle=True)]
    nbytes = epx.low_latency_buffer_size_hint(M, LL_H, R, E)
    experts_per_node = NUM_LOCAL * gpus_per_node

    def fn(rank, group):
        x, idx, w = inputs[rank]
        out = {}
        for partials in ("fp32", "bf16"):
            buffer = epx.Buffer(group, num_low_latency_bytes=nbytes, low_latency_routing="hierarchical",
                                node_partials=partials)
            d = buffer.low_latency_dispatch(epx.bf16(x), idx, M, E)
            out[partials] = bits(buffer.low_latency_combine(epx.bf16(bits(d.recv_x)), idx, w, d.handle).x).copy()
        xf = to_f32(x)
        acc = np.zeros_like(xf)
        for n in range(R // gpus_per_node):
            partial = np.zeros_like(xf)
            for k in range(K):
                on_node = ((idx[:, k] >= 0) & (idx[:, k] // experts_per_node == n))[:, None]
                partial = np.where(on_node, (partial + w[:, k:k + 1] * xf).astype(np.float32), partial)
            acc = (acc + round_bf16(partial)).astype(np.float32)
        np.testing.assert_array_equal(to_f32(out["bf16"]), round_bf16(acc))
        return len(x) == 0 or not np.array_equal(out["fp32"], out["bf16"])

    assert all(run(gpus_per_node, fn))

"""epx.Buffer on the host backend (ranks as threads) against numpy references.

Routing: every rank draws its own tokens; token t of rank r picks K distinct experts uniformly at
random, and about one token in five gets one -1 ("no expert") entry. Experts are split evenly over ranks.
"""

import gc
import time

import numpy as np
import pytest

import epx

ml_dtypes = pytest.importorskip("ml_dtypes")
import reference  # noqa: E402
BF16 = ml_dtypes.bfloat16


def make_inputs(rank, num_tokens, hidden, num_topk, num_experts, seed=0):
    rng = np.random.default_rng(seed * 1000 + rank)
    x = rng.standard_normal((num_tokens, hidden)).astype(BF16)
    idx = np.array([rng.permutation(num_experts)[:num_topk] for _ in range(num_tokens)], np.int64)
    if num_tokens:
        masked = rng.random(num_tokens) < 0.2
        idx[masked, rng.integers(0, num_topk, masked.sum())] = -1
    weights = rng.random((num_tokens, num_topk)).astype(np.float32)
    return x, idx.reshape(num_tokens, num_topk).copy(), weights


def run(num_ranks, fn, timeout_ms=60_000):
    groups = epx.host_groups(num_ranks, timeout_ms=timeout_ms)
    return epx.run_host_ranks(groups, fn)


def test_import_and_version():
    assert epx.version() == epx.__version__
    assert isinstance(epx.built_with_cuda(), bool)
    assert issubclass(epx.InvalidArgumentError, ValueError)
    assert issubclass(epx.TimeoutError, TimeoutError)
    assert issubclass(epx.InvalidArgumentError, epx.Error)


def test_kernel_tuning_is_buffer_configuration():
    """NormalConfig / LowLatencyConfig carry the kernels' tuning into the buffer; ranges are checked on every
    backend (the cuda backend also checks that every rank passed the same values)."""
    normal, low_latency = epx.NormalConfig(), epx.LowLatencyConfig()
    assert (normal.copy_engines, normal.whole_copies, normal.stream_signals, normal.max_copy_chunks,
            normal.stage_timeline, normal.early_copies) == (True, True, True, 8, False, epx.EarlyCopies.never)
    assert (low_latency.combine_send_parts, low_latency.token_rows_min_tokens,
            low_latency.programmatic_launch, low_latency.expert_side_reduction) == (2, 64, True, False)
    normal.copy_engines, normal.max_copy_chunks, low_latency.combine_send_parts = False, 3, 4
    low_latency.programmatic_launch = False
    low_latency.expert_side_reduction = True
    normal.early_copies = epx.EarlyCopies.auto
    group = epx.host_groups(1)[0]
    buffer = epx.Buffer(group, normal=normal, low_latency=low_latency)
    assert buffer.num_ranks == 1
    assert low_latency.programmatic_launch is False
    assert low_latency.expert_side_reduction is True
    normal.max_copy_chunks = 9
    with pytest.raises(ValueError, match=r"normal.max_copy_chunks must be in \[1, 8\], got 9"):
        epx.Buffer(group, normal=normal)
    low_latency.combine_send_parts = 3
    with pytest.raises(epx.InvalidArgumentError, match="combine_send_parts must be 1, 2, 4 or 8, got 3"):
        epx.Buffer(group, low_latency=low_latency)
    low_latency.combine_send_parts, low_latency.token_rows_min_tokens = 2, -1
    with pytest.raises(epx.InvalidArgumentError, match="token_rows_min_tokens must be >= 0, got -1"):
        epx.Buffer(group, low_latency=low_latency)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_normal_dispatch_combine_matches_reference(num_ranks):
    T, H, K, E = 33, 256, 4, 8 * num_ranks
    inputs = [make_inputs(r, T - r, H, K, E, seed=num_ranks) for r in range(num_ranks)]
    local = E // num_ranks

    def body(rank, group):
        buffer = epx.Buffer(group)
        x, idx, w = inputs[rank]
        layout = buffer.get_dispatch_layout(idx, E)
        recv = buffer.dispatch(x, idx, w, num_experts=E, layout=layout)
        # Reference: rows by source rank, then token; local expert ids; weights where local.
        rows, src, tidx, tw = reference.normal_dispatch(inputs, rank, E, num_ranks)
        assert recv.recv_x.dtype == BF16 and recv.recv_x.shape == (len(rows), H)
        np.testing.assert_array_equal(recv.recv_x.view(np.uint16), np.array(rows).view(np.uint16))
        np.testing.assert_array_equal(recv.recv_src_idx, src)
        np.testing.assert_array_equal(recv.recv_topk_idx, np.array(tidx).reshape(-1, K))
        np.testing.assert_array_equal(recv.recv_topk_weights, np.array(tw, np.float32).reshape(-1, K))
        counts = np.bincount(np.array(tidx)[np.array(tidx) >= 0], minlength=local) if tidx else np.zeros(local)
        assert recv.num_recv_tokens_per_expert == counts.tolist()
        np.testing.assert_array_equal(recv.recv_expert_counts, counts)
        sent = np.array([[sum(((i >= 0) & (i // local == d)).any() for i in inputs[s][1])
                          for d in range(num_ranks)] for s in range(num_ranks)])
        np.testing.assert_array_equal(recv.rank_prefix_matrix, np.cumsum(sent, axis=0))
        with pytest.raises(ValueError, match="num_sms"):
            buffer.dispatch(x, handle=recv.handle, num_sms=10_000)
        np.testing.assert_array_equal(layout.num_tokens_per_rank,
                                      [sum(((i >= 0) & (i // local == d)).any() for i in idx)
                                       for d in range(num_ranks)])

        # Combine: expert output = received row * 2; each token comes back once per rank it went to.
        expert_out = (recv.recv_x.astype(np.float32) * 2).astype(BF16)
        out = buffer.combine(expert_out, recv.handle, recv.recv_topk_weights)
        dest = np.array([[((i >= 0) & (i // local == d)).any() for d in range(num_ranks)] for i in idx])
        expect = (x.astype(np.float32) * 2) * dest.sum(1, keepdims=True)
        np.testing.assert_allclose(out.x.astype(np.float32), expect, rtol=2 ** -7, atol=1e-6)
        np.testing.assert_array_equal(out.topk_weights, np.where(idx >= 0, w, 0))

        # Cached mode: same routes, new data, no topk.
        again = buffer.dispatch((x.astype(np.float32) + 1).astype(BF16), handle=recv.handle)
        assert again.recv_topk_idx is None
        np.testing.assert_array_equal(again.recv_x.view(np.uint16),
                                      (recv.recv_x.astype(np.float32) + 1).astype(BF16).view(np.uint16))
        return True

    assert all(run(num_ranks, body))


def test_worst_tokens_and_alignment():
    num_ranks, T, H, K, E = 4, 16, 128, 2, 16
    inputs = [make_inputs(r, T, H, K, E, seed=7) for r in range(num_ranks)]

    def body(rank, group):
        buffer = epx.Buffer(group)
        x, idx, w = inputs[rank]
        exact = buffer.dispatch(x, idx, w, num_experts=E, expert_alignment=4)
        assert all(c % 4 == 0 for c in exact.num_recv_tokens_per_expert)
        worst = buffer.dispatch(x, idx, w, num_experts=E, num_worst_tokens=num_ranks * T)
        n = exact.recv_x.shape[0]
        assert worst.recv_x.shape == (num_ranks * T, H)
        assert worst.num_recv_tokens_per_expert == []
        np.testing.assert_array_equal(worst.recv_x[:n].view(np.uint16), exact.recv_x.view(np.uint16))
        assert (worst.recv_src_idx[n:] == -1).all() and (worst.recv_topk_idx[n:] == -1).all()
        return n

    assert min(run(num_ranks, body)) > 0


def deepep_v2_sum(rows_by_rank, idx_row, local, biases):
    """DeepEP V2's combine order for one token, written from its definition: fp32 0 + the biases, then each rank's row
    by the last top-k slot whose expert is on it, one rounding to bf16."""
    acc = np.zeros(biases[0].shape, np.float32)
    for b in biases:
        acc = acc + b.astype(np.float32)
    last = {}
    for k, e in enumerate(idx_row):
        if e >= 0:
            last[int(e) // local] = k
    for r in sorted(rows_by_rank, key=lambda r: last[r]):
        acc = acc + rows_by_rank[r].astype(np.float32)
    return acc.astype(BF16)


def test_combine_in_deepep_v2_order():
    # CombineArgs::order_topk_idx: three ranks (so the order of the partials matters), rows whose sums round
    # differently in another order, two small biases; every rank's result bit for bit against the definition.
    num_ranks, T, H, K, E = 3, 40, 128, 4, 12
    local = E // num_ranks
    inputs = [make_inputs(r, T, H, K, E, seed=11) for r in range(num_ranks)]
    rng = np.random.default_rng(5)
    biases = [[(rng.standard_normal((T, H)) * 1e-6).astype(BF16) for _ in range(2)] for _ in range(num_ranks)]

    def body(rank, group):
        buffer = epx.Buffer(group)
        x, idx, w = inputs[rank]
        recv = buffer.dispatch(x, idx, w, num_experts=E)
        # Every rank receives the same x row of a token; they return it times 1, -1 and a tiny factor, so the sum
        # cancels and what survives depends on the order (bf16 values of similar size add exactly in any order).
        y = (recv.recv_x.astype(np.float32) * [1.0, -1.0, 1.37e-6][rank]).astype(BF16)
        ordered = buffer.combine(y, recv.handle, recv.recv_topk_weights, bias_0=biases[rank][0],
                                 bias_1=biases[rank][1], order_topk_idx=idx)
        plain = buffer.combine(y, recv.handle, recv.recv_topk_weights, bias_0=biases[rank][0], bias_1=biases[rank][1])
        np.testing.assert_array_equal(ordered.topk_weights, plain.topk_weights)
        with pytest.raises(ValueError, match="order_topk_idx"):
            buffer.combine(y, recv.handle, order_topk_idx=idx[:-1])
        return recv.recv_src_idx, recv.rank_prefix_matrix, y, ordered.x, plain.x

    results = run(num_ranks, body)
    differs = 0
    for s in range(num_ranks):
        x, idx, _ = inputs[s]
        rows = [dict() for _ in range(T)]
        for r in range(num_ranks):
            src, prefix, y, _, _ = results[r]
            begin = prefix[s - 1][r] if s > 0 else 0
            for j in range(begin, prefix[s][r]):
                rows[src[j]][r] = y[j]
        want = np.stack([deepep_v2_sum(rows[t], idx[t], local, [b[t] for b in biases[s]]) for t in range(T)])
        np.testing.assert_array_equal(results[s][3].view(np.uint16), want.view(np.uint16))
        differs += int((results[s][3].view(np.uint16) != results[s][4].view(np.uint16)).sum())
    assert differs > 0  # the default order rounds some sums differently: the option changed something


def test_combine_order_needs_the_flat_routing():
    num_ranks, T, H, K, E = 4, 8, 64, 2, 8
    inputs = [make_inputs(r, T, H, K, E, seed=2) for r in range(num_ranks)]

    def body(rank, group):
        buffer = epx.Buffer(group, normal_routing="hierarchical")
        x, idx, w = inputs[rank]
        recv = buffer.dispatch(x, idx, num_experts=E)
        with pytest.raises(epx.UnsupportedError, match="order_topk_idx .* needs the flat routing"):
            buffer.combine(recv.recv_x, recv.handle, order_topk_idx=idx)
        buffer.combine(recv.recv_x, recv.handle)  # the group stays usable

    epx.run_host_ranks(epx.host_groups(num_ranks, gpus_per_node=2), body)


def test_combine_takes_plain_uint16_rows_as_bf16():
    # Without ml_dtypes epx returns bf16 outputs as plain uint16 arrays; combine (whose rows and biases can only be
    # bf16) takes them as they are, as the README's quick start does.
    num_ranks, T, H, K, E = 2, 12, 64, 2, 8
    inputs = [make_inputs(r, T, H, K, E, seed=3) for r in range(num_ranks)]

    def body(rank, group):
        buffer = epx.Buffer(group)
        x, idx, w = inputs[rank]
        recv = buffer.dispatch(x, idx, w, num_experts=E)
        marked = buffer.combine(recv.recv_x, recv.handle, bias_0=x)
        plain = buffer.combine(recv.recv_x.view(np.uint16), recv.handle, bias_0=x.view(np.uint16))
        np.testing.assert_array_equal(plain.x.view(np.uint16), marked.x.view(np.uint16))

    run(num_ranks, body)


def test_fp8_dispatch_carries_scales():
    num_ranks, T, H, K, E = 2, 8, 256, 2, 4
    rng = np.random.default_rng(3)
    data = [(rng.integers(0, 0x7e, (T, H), dtype=np.uint8), rng.random((T, H // 128)).astype(np.float32),
             make_inputs(r, T, H, K, E)[1]) for r in range(num_ranks)]

    def body(rank, group):
        buffer = epx.Buffer(group)
        q, s, idx = data[rank]
        recv = buffer.dispatch(epx.fp8(q), idx, num_experts=E, x_scales=s)
        rows = [(d[0][t], d[1][t]) for d in data for t in range(T)
                if ((d[2][t] >= 0) & (d[2][t] // (E // num_ranks) == rank)).any()]
        got = recv.recv_x.view(np.uint8) if recv.recv_x.dtype != np.uint8 else recv.recv_x
        np.testing.assert_array_equal(got, np.array([r[0] for r in rows]))
        np.testing.assert_array_equal(recv.recv_x_scales, np.array([r[1] for r in rows]))
        column_major = np.asfortranarray(s)  # DeepEP's tests pass scales this way
        again = buffer.dispatch(epx.fp8(q), idx, num_experts=E, x_scales=column_major)
        np.testing.assert_array_equal(again.recv_x_scales, recv.recv_x_scales)
        return True

    assert all(run(num_ranks, body))


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_low_latency_packed_rows_and_combine(num_ranks):
    T, H, K, E, M = 12, 256, 4, 4 * num_ranks, 16
    local = E // num_ranks
    inputs = [make_inputs(r, T - r, H, K, E, seed=11) for r in range(num_ranks)]
    nbytes = epx.low_latency_buffer_size_hint(M, H, num_ranks, E)

    def body(rank, group):
        buffer = epx.Buffer(group, num_low_latency_bytes=nbytes)
        x, idx, w = inputs[rank]
        d = buffer.low_latency_dispatch(x, idx, M, E)
        assert d.recv_x.shape == (local, num_ranks * M, H)
        for e in range(local):
            ge = rank * local + e
            # Packed: rows [0, count) by source rank, then source token (then k).
            expect = [(s, t) for s in range(num_ranks) for t in range(inputs[s][1].shape[0])
                      for k in range(K) if inputs[s][1][t, k] == ge]
            count = int(d.recv_count[e])
            assert count == len(expect)
            np.testing.assert_array_equal(d.recv_src_info[e, :count], [t for _, t in expect])
            rows = np.array([inputs[s][0][t] for s, t in expect]).reshape(-1, H)
            np.testing.assert_array_equal(d.recv_x[e, :count].view(np.uint16), rows.view(np.uint16))
            begin = 0
            for s in range(num_ranks):
                n = sum(1 for src, _ in expect if src == s)
                rng = int(d.recv_layout_range[e, s])
                assert (rng >> 32, rng & 0xFFFFFFFF) == (begin, n)
                begin += n
        # Combine with identity experts: out[t] = sum_k w[t,k] * x[t] over valid k.
        c = buffer.low_latency_combine(d.recv_x, idx, w, d.handle)
        expect = x.astype(np.float32) * np.where(idx >= 0, w, 0).sum(1, keepdims=True)
        np.testing.assert_allclose(c.x.astype(np.float32), expect, rtol=2 ** -6, atol=1e-5)
        # Hooks: send now, receive later.
        h = buffer.low_latency_dispatch(x, idx, M, E, return_recv_hook=True)
        h.recv_hook()
        np.testing.assert_array_equal(h.recv_count, d.recv_count)
        return True

    assert all(run(num_ranks, body))


def test_low_latency_hooks_keep_the_buffer_alive():
    """A receive hook refers to its buffer's engine: dropping the Buffer (and the call's result) before calling the
    hook must not free it (it crashed before); the hooks still deliver."""
    T, H, K, E, M = 8, 128, 4, 8, 8
    inputs = [make_inputs(r, T, H, K, E, seed=5) for r in range(2)]

    def body(rank, group):
        x, idx, w = inputs[rank]
        buffer = epx.Buffer(group, num_low_latency_bytes=epx.low_latency_buffer_size_hint(M, H, 2, E))
        d = buffer.low_latency_dispatch(x, idx, M, E, return_recv_hook=True)
        dispatch_hook, recv_x, handle = d.recv_hook, d.recv_x, d.handle
        counts = d.recv_count
        del d
        dispatch_hook()
        c = buffer.low_latency_combine(recv_x, idx, w, handle, return_recv_hook=True)
        combine_hook, combined = c.recv_hook, c.x
        del buffer, c
        gc.collect()
        combine_hook()
        expect = x.astype(np.float32) * np.where(idx >= 0, w, 0).sum(1, keepdims=True)
        np.testing.assert_allclose(np.asarray(combined).astype(np.float32), expect, rtol=2 ** -6, atol=1e-5)
        return int(np.asarray(counts).sum())

    received = run(2, body)
    assert sum(received) == sum(int((inp[1] >= 0).sum()) for inp in inputs)


def test_low_latency_wait_recv_cost_ns_names_the_late_rank():
    """wait_recv_cost_ns (DeepEP's wait-time statistics): rank 1 starts each call 50 ms late; rank 0's entry for it
    grows by about that much per call, its own entry far less; the entries accumulate over calls."""
    T, H, K, E, M = 8, 128, 4, 8, 8
    inputs = [make_inputs(r, T, H, K, E, seed=3) for r in range(2)]
    late_s = 0.05

    def body(rank, group):
        buffer = epx.Buffer(group, num_low_latency_bytes=epx.low_latency_buffer_size_hint(M, H, 2, E))
        x, idx, w = inputs[rank]
        dispatch_ns, combine_ns = np.zeros(2, np.int64), np.zeros(2, np.int64)
        for _ in range(2):
            if rank == 1:
                time.sleep(late_s)
            d = buffer.low_latency_dispatch(x, idx, M, E, wait_recv_cost_ns=dispatch_ns)
            if rank == 1:
                time.sleep(late_s)
            buffer.low_latency_combine(d.recv_x, idx, w, d.handle, wait_recv_cost_ns=combine_ns)
        return dispatch_ns, combine_ns

    (d0, c0), (d1, c1) = run(2, body)
    for waits in (d0, c0):
        assert waits[1] >= 2 * late_s * 1e9 * 0.9, waits
        assert waits[0] < late_s * 1e9, waits
    assert d1[0] < late_s * 1e9 and c1[0] < late_s * 1e9, (d1, c1)
    with pytest.raises(ValueError, match="wait_recv_cost_ns"):
        run(1, lambda rank, group: epx.Buffer(group, num_low_latency_bytes=1).low_latency_dispatch(
            inputs[0][0], inputs[0][1], M, E, wait_recv_cost_ns=np.zeros(3, np.int64)))


def test_low_latency_scale_options():
    """round_scale: UE8M0 quantization with fp32 powers of two; column_major_scales: DeepGEMM's layout, the same
    values as a transposed view; UE8M0 column-major packs four exponents per int32."""
    num_ranks, T, H, K, E, M = 2, 10, 1024, 3, 8, 16
    inputs = [make_inputs(r, T, H, K, E, seed=5) for r in range(num_ranks)]
    nbytes = epx.low_latency_buffer_size_hint(M, H, num_ranks, E)

    def body(rank, group):
        buffer = epx.Buffer(group, num_low_latency_bytes=nbytes)
        x, idx, _ = inputs[rank]

        def scales(**kw):
            d = buffer.low_latency_dispatch(x, idx, M, E, use_fp8=True, **kw)
            return d.recv_count.copy(), np.array(d.recv_x_scales), d.recv_x_scales.strides

        count, fp32, _ = scales()
        _, ue8m0, _ = scales(use_ue8m0=True)
        _, rounded, _ = scales(round_scale=True)
        _, fp32_cm, strides = scales(column_major_scales=True)
        _, ue8m0_cm, _ = scales(use_ue8m0=True, column_major_scales=True)
        local, rows, blocks = fp32.shape
        assert fp32_cm.shape == fp32.shape and strides == (4 * blocks * rows, 4, 4 * rows)
        assert ue8m0_cm.shape == (local, rows, blocks // 4) and ue8m0_cm.dtype == np.int32
        for e in range(local):
            n = int(count[e])
            np.testing.assert_array_equal(fp32_cm[e, :n], fp32[e, :n])
            np.testing.assert_array_equal(rounded[e, :n], np.ldexp(1.0, ue8m0[e, :n].astype(np.int32) - 127))
            words = ue8m0[e, :n].astype(np.uint32).reshape(n, blocks // 4, 4)
            packed = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)
            np.testing.assert_array_equal(ue8m0_cm[e, :n].view(np.uint32), packed)
        with pytest.raises(epx.InvalidArgumentError, match="multiple of 512, got 384"):
            buffer.low_latency_dispatch(x[:, :384].copy(), idx, M, E, use_fp8=True, use_ue8m0=True,
                                        column_major_scales=True)
        return True

    assert all(run(num_ranks, body))


def test_bad_input_raises_named_errors():
    def body(rank, group):
        buffer = epx.Buffer(group)
        x, idx, w = make_inputs(rank, 4, 128, 2, 8)
        with pytest.raises(epx.InvalidArgumentError) as err:
            buffer.dispatch(x.astype(np.float32), idx, w, num_experts=8)
        assert err.value.code == "invalid_argument" and "x" in str(err.value)
        bad = idx.copy()
        bad[0, 0] = 8
        with pytest.raises(ValueError, match="topk_idx"):
            buffer.get_dispatch_layout(bad, 8)
        with pytest.raises(ValueError, match="x"):
            buffer.dispatch(np.zeros((2, 2, 2, 2, 2), np.float32), idx, num_experts=8)
        with pytest.raises(ValueError, match="stream"):
            buffer.dispatch(x, idx, num_experts=8, stream="not a stream")
        with pytest.raises(epx.InvalidArgumentError):
            buffer.mask_rank(rank)
        return True

    assert all(run(2, body))
    with pytest.raises(ValueError, match="num_ranks"):
        epx.host_groups(0)


def test_input_the_binding_rejects_still_takes_part():
    # Rank 1 passes float64 x to each collective call in turn; the binding rejects it before the C++ call.
    # Rank 1 must still take part: rank 0 raises PeerFailureError naming it at once, and the next calls
    # are in step. (Before, rank 1 skipped the call and rank 0's call paired with rank 1's next one.)
    T, H, K, E, M = 6, 128, 2, 4, 8
    inputs = [make_inputs(r, T, H, K, E, seed=5) for r in range(2)]
    nbytes = epx.low_latency_buffer_size_hint(M, H, 2, E)

    def body(rank, group):
        buffer = epx.Buffer(group, num_low_latency_bytes=nbytes)
        x, idx, w = inputs[rank]

        def fails(call, bad_call):
            if rank == 1:
                with pytest.raises(epx.InvalidArgumentError, match="element type"):
                    bad_call()
            else:
                with pytest.raises(epx.PeerFailureError, match=r"failed on ranks \[1\]"):
                    call()

        fails(lambda: buffer.dispatch(x, idx, w, num_experts=E),
              lambda: buffer.dispatch(x.astype(np.float64), idx, w, num_experts=E))
        recv = buffer.dispatch(x, idx, w, num_experts=E)
        rows, src, _, _ = reference.normal_dispatch(inputs, rank, E, 2)
        np.testing.assert_array_equal(recv.recv_x.view(np.uint16), np.array(rows).view(np.uint16))
        np.testing.assert_array_equal(recv.recv_src_idx, src)
        fails(lambda: buffer.combine(recv.recv_x, recv.handle),
              lambda: buffer.combine(recv.recv_x.astype(np.float64), recv.handle))
        out = buffer.combine(recv.recv_x, recv.handle)
        dest = reference.destinations(idx, E, 2)
        want = reference.normal_combine(x.astype(np.float32), dest).astype(BF16)
        np.testing.assert_array_equal(out.x.astype(np.float32), want.astype(np.float32))
        fails(lambda: buffer.low_latency_dispatch(x, idx, M, E),
              lambda: buffer.low_latency_dispatch(x.astype(np.float64), idx, M, E))
        d = buffer.low_latency_dispatch(x, idx, M, E)
        assert int(np.sum(d.recv_count)) == sum(len(r) for r in reference.low_latency_rows(inputs, rank, E, 2))
        fails(lambda: buffer.low_latency_combine(d.recv_x, idx, w, d.handle),
              lambda: buffer.low_latency_combine(np.zeros(d.recv_x.shape), idx, w, d.handle))
        c = buffer.low_latency_combine(d.recv_x, idx, w, d.handle)
        np.testing.assert_array_equal(c.x.astype(np.float32), reference.low_latency_combine(
            x.astype(np.float32), idx, w).astype(BF16).astype(np.float32))
        assert buffer.rank_mask() == [False, False]
        return True

    assert all(run(2, body, timeout_ms=10_000))


# Wrong-typed or out-of-range scalar and handle arguments, one per case: (call, keyword, value, error, message).
# "dispatch handle" / "low-latency handle" stand for a handle of the other kind, made in the test.
SCALAR_FAULTS = [
    ("dispatch", "num_experts", "4", TypeError, "num_experts: expected an int, got str"),
    ("dispatch", "num_sms", 1.5, TypeError, "num_sms: expected an int, got float"),
    ("dispatch", "expert_alignment", None, TypeError, "expert_alignment: expected an int, got NoneType"),
    ("dispatch", "expert_alignment", True, TypeError, "expert_alignment: expected an int, got bool"),
    ("dispatch", "num_worst_tokens", 2 ** 64, epx.InvalidArgumentError,
     "num_worst_tokens: 18446744073709551616 does not fit in int64"),
    ("dispatch", "handle", 123, TypeError, "handle: expected an epx.DispatchHandle or None, got int"),
    ("dispatch", "layout", "layout", TypeError, "layout: expected an epx.Layout .* got str"),
    ("combine", "handle", "low-latency handle", TypeError,
     "handle: expected an epx.DispatchHandle, got epx._epx.LowLatencyHandle"),
    ("combine", "num_sms", 2 ** 31, epx.InvalidArgumentError, "num_sms: 2147483648 does not fit in int32"),
    ("low_latency_dispatch", "max_tokens_per_rank", 8.0, TypeError, "max_tokens_per_rank: expected an int, got float"),
    ("low_latency_dispatch", "num_experts", "4", TypeError, "num_experts: expected an int, got str"),
    ("low_latency_dispatch", "use_fp8", "no", TypeError, "use_fp8: expected a bool, got str"),
    ("low_latency_dispatch", "use_ue8m0", np.ones(2, bool), TypeError, "use_ue8m0: expected a bool, got numpy.ndarray"),
    ("low_latency_dispatch", "column_major_scales", np.ones(2, bool), TypeError,
     "column_major_scales: expected a bool, got numpy.ndarray"),
    ("low_latency_dispatch", "round_scale", "yes", TypeError, "round_scale: expected a bool, got str"),
    ("low_latency_combine", "handle", "dispatch handle", TypeError,
     "handle: expected an epx.LowLatencyHandle, got epx._epx.DispatchHandle"),
    ("low_latency_combine", "return_recv_hook", None, TypeError, "return_recv_hook: expected a bool, got NoneType"),
]


@pytest.mark.parametrize("call,keyword,value,error,message", SCALAR_FAULTS,
                         ids=[f"{c}-{k}={v!r}" for c, k, v, *_ in SCALAR_FAULTS])
def test_scalar_the_binding_rejects_still_takes_part(call, keyword, value, error, message):
    # Rank 1 passes one wrong scalar or handle to `call`, rank 0 valid input. nanobind used to reject such a
    # typed argument before the binding ran, so rank 1 skipped the call and rank 0's call paired with rank 1's
    # next one. Now rank 1 raises an error naming the argument and still takes part: rank 0 raises
    # PeerFailureError naming it well before the group timeout, and then a full valid round (dispatch, combine,
    # low-latency dispatch and combine) matches the reference on both ranks.
    T, H, K, E, M = 6, 128, 2, 4, 8
    timeout_ms = 10_000
    inputs = [make_inputs(r, T, H, K, E, seed=9) for r in range(2)]
    nbytes = epx.low_latency_buffer_size_hint(M, H, 2, E)

    def body(rank, group):
        buffer = epx.Buffer(group, num_low_latency_bytes=nbytes)
        x, idx, w = inputs[rank]
        recv = buffer.dispatch(x, idx, w, num_experts=E) if call in ("combine", "low_latency_combine") else None
        ll = buffer.low_latency_dispatch(x, idx, M, E) if call in ("combine", "low_latency_combine") else None
        valid = {
            "dispatch": lambda **kw: buffer.dispatch(x, idx, w, **{"num_experts": E, **kw}),
            "combine": lambda **kw: buffer.combine(recv.recv_x, **{"handle": recv.handle, **kw}),
            "low_latency_dispatch": lambda **kw: buffer.low_latency_dispatch(
                x, idx, **{"max_tokens_per_rank": M, "num_experts": E, **kw}),
            "low_latency_combine": lambda **kw: buffer.low_latency_combine(
                ll.recv_x, idx, w, **{"handle": ll.handle, **kw}),
        }[call]
        if rank == 1:
            handles = {"dispatch handle": lambda: recv.handle, "low-latency handle": lambda: ll.handle}
            bad = handles[value]() if isinstance(value, str) and value in handles else value
            with pytest.raises(error, match=message):
                valid(**{keyword: bad})
        else:
            start = time.monotonic()
            with pytest.raises(epx.PeerFailureError, match=r"failed on ranks \[1\]"):
                valid()
            assert time.monotonic() - start < timeout_ms / 1000 / 4

        d = buffer.dispatch(x, idx, w, num_experts=E)
        rows, src, _, _ = reference.normal_dispatch(inputs, rank, E, 2)
        np.testing.assert_array_equal(d.recv_x.view(np.uint16), np.array(rows).view(np.uint16))
        np.testing.assert_array_equal(d.recv_src_idx, src)
        c = buffer.combine(d.recv_x, d.handle)
        want = reference.normal_combine(x.astype(np.float32), reference.destinations(idx, E, 2)).astype(BF16)
        np.testing.assert_array_equal(c.x.astype(np.float32), want.astype(np.float32))
        ld = buffer.low_latency_dispatch(x, idx, M, E)
        expect = reference.low_latency_rows(inputs, rank, E, 2)
        np.testing.assert_array_equal(ld.recv_count, [len(r) for r in expect])
        lc = buffer.low_latency_combine(ld.recv_x, idx, w, ld.handle)
        np.testing.assert_array_equal(lc.x.astype(np.float32), reference.low_latency_combine(
            x.astype(np.float32), idx, w).astype(BF16).astype(np.float32))
        assert buffer.rank_mask() == [False, False]
        return True

    assert all(run(2, body, timeout_ms=timeout_ms))


def test_timeout_is_a_timeout_error():
    groups = epx.host_groups(2, timeout_ms=200)

    def body(rank, group):
        if rank == 0:
            with pytest.raises(TimeoutError) as err:
                group.barrier()
            assert isinstance(err.value, epx.TimeoutError) and err.value.code == "timeout"
        return True

    assert all(epx.run_host_ranks(groups, body))


def test_rank_mask_round_trip():
    def body(rank, group):
        buffer = epx.Buffer(group, num_low_latency_bytes=epx.low_latency_buffer_size_hint(8, 128, 4, 8))
        assert buffer.rank_mask() == [False] * 4
        buffer.mask_rank((rank + 1) % 4)
        assert buffer.rank_mask()[(rank + 1) % 4]
        buffer.mask_rank((rank + 2) % 4)
        buffer.unmask_rank((rank + 1) % 4)
        assert buffer.rank_mask() == [r == (rank + 2) % 4 for r in range(4)]
        with pytest.raises(ValueError, match="rank"):
            buffer.unmask_rank(4)
        buffer.clear_rank_mask()
        assert buffer.rank_mask() == [False] * 4
        return True

    assert all(run(4, body))


def test_run_host_ranks_reraises_first_error_by_rank():
    def body(rank, group):
        if rank >= 1:
            raise KeyError(rank)
        return rank

    with pytest.raises(KeyError) as err:
        epx.run_host_ranks(epx.host_groups(3), body)
    assert err.value.args == (1,)


def test_torch_cpu_tensors_come_back_as_torch():
    torch = pytest.importorskip("torch")
    T, H, K, E = 6, 128, 2, 4

    def body(rank, group):
        buffer = epx.Buffer(group)
        x, idx, w = make_inputs(rank, T, H, K, E)
        xt = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
        recv = buffer.dispatch(xt, torch.from_numpy(idx), torch.from_numpy(w), num_experts=E)
        assert isinstance(recv.recv_x, torch.Tensor) and recv.recv_x.dtype == torch.bfloat16
        out = buffer.combine(recv.recv_x, recv.handle)
        assert isinstance(out.x, torch.Tensor) and out.x.shape == (T, H)
        return True

    assert all(run(2, body))


def test_cuda_calls_without_a_gpu_raise_unsupported():
    """import epx worked (no GPU library is loaded at import); a CUDA call names what is missing."""
    try:
        groups = epx.cuda_groups([0])
    except epx.UnsupportedError as e:  # no CUDA backend in this build, or no driver/GPU here
        assert e.code == "unsupported"
        assert any(word in str(e) for word in ("CUDA backend", "driver", "GPU")), str(e)
        assert isinstance(e, NotImplementedError)
    else:
        assert groups[0].backend == "cuda"


def test_empty_numpy_arrays_are_accepted():
    """numpy gives [0, H] arrays strides (0, 0); an idle rank passes such arrays."""
    def body(rank, group):
        buffer = epx.Buffer(group)
        x, idx, w = make_inputs(rank, 0 if rank == 0 else 3, 128, 2, 4)
        if rank == 0:
            x, idx, w = np.empty((0, 128), BF16), np.empty((0, 2), np.int64), np.empty((0, 2), np.float32)
            assert x.strides == (0, 0) or x.strides[0] == 0
        recv = buffer.dispatch(x, idx, w, num_experts=4)
        out = buffer.combine(recv.recv_x, recv.handle)
        return out.x.shape

    assert epx.run_host_ranks(epx.host_groups(2), body) == [(0, 128), (3, 128)]

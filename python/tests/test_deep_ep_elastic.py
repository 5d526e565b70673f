"""epx.deep_ep.ElasticBuffer (DeepEP V2's expert-parallel API) on the host backend: torch CPU tensors, ranks as threads.

Routing: E = 16 experts; rank r has T - r tokens (DeepEP's test gives ranks different counts), each picking K = 4
distinct experts from a generator seeded by r; token 0 goes nowhere and token 2 has one -1 slot (weight 0 there, as
DeepEP's test sets it). Combine inputs are bf16 values k / 8 with |k| <= 16, so every fp32 sum is exact whatever the
order, and results compare bit for bit. The reference is written here from the routing alone: rows in (source rank,
token) order, src_token_global_idx = source * num_max_tokens_per_rank + token. Skipped without torch.
"""

import pytest

torch = pytest.importorskip("torch")
import epx  # noqa: E402
from epx import deep_ep  # noqa: E402

R, T, H, K, E, M = 2, 37, 256, 4, 16, 40


def make(rank, num_experts=E):
    g = torch.Generator().manual_seed(900 + rank)
    tokens = T - rank
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:K] for _ in range(tokens)])
    idx[0] = -1
    idx[2, 1] = -1
    w = torch.rand(tokens, K, generator=g)
    w[idx < 0] = 0
    return x, idx, w


def exact_rows(rows, salt):
    """bf16 [rows, H] of values k / 8, |k| <= 16, from a generator seeded by salt: fp32 sums of these are exact."""
    g = torch.Generator().manual_seed(salt)
    return (torch.randint(-16, 17, (rows, H), generator=g).float() / 8).to(torch.bfloat16)


def reference(inputs, me, num_ranks, num_experts=E):
    """Rows rank `me` receives: (x rows, local idx, masked weights, global idx, first local k, rows per source)."""
    num_local = num_experts // num_ranks
    xs, idxs, ws, gidx, first, per_source = [], [], [], [], [], []
    for s, (x, idx, w) in enumerate(inputs):
        mine = (idx >= 0) & (idx // num_local == me)
        sel = mine.any(dim=1)
        xs.append(x[sel])
        idxs.append(torch.where(mine, idx - me * num_local, torch.full_like(idx, -1))[sel])
        ws.append(torch.where(mine, w, torch.zeros_like(w))[sel])
        gidx.append(s * M + sel.nonzero().flatten())
        first.append(s * K + mine.int().argmax(dim=1)[sel])
        per_source.append(int(sel.sum()))
    return (torch.cat(xs), torch.cat(idxs), torch.cat(ws), torch.cat(gidx).int(), torch.cat(first).int(),
            per_source)


def run(fn, num_ranks=R, gpus_per_node=0, **kw):
    groups = epx.host_groups(num_ranks, gpus_per_node=gpus_per_node) if gpus_per_node else epx.host_groups(num_ranks)

    def body(rank, group):
        kw.setdefault("num_max_tokens_per_rank", M)
        buffer = deep_ep.ElasticBuffer(group, hidden=H, explicitly_destroy=True, **kw)
        try:
            return fn(rank, buffer)
        finally:
            buffer.destroy()

    return epx.run_host_ranks(groups, body)


def align(v, a):
    return (v + a - 1) // a * a


def expected_combine(inputs, rows_of, num_ranks, bias=()):
    """Per source rank: the sum over ranks of the rows they return for its tokens (+ biases), as bf16."""
    out = []
    for s, (x, _, _) in enumerate(inputs):
        acc = torch.zeros(x.shape[0], H)
        for r in range(num_ranks):
            for t, row in rows_of(r, s).items():
                acc[t] += row.float()
        for b in bias:
            acc += b[s].float()
        out.append(acc.to(torch.bfloat16))
    return out


def test_dispatch_cached_and_combine():
    inputs = [make(r) for r in range(R)]
    alignment = 4
    bias = [exact_rows(inputs[r][0].shape[0], 50 + r) for r in range(R)]

    def fn(rank, buffer):
        x, idx, w = inputs[rank]
        assert buffer.get_logical_domain_size() == (1, R) and buffer.get_physical_domain_size() == (1, R)
        stats = torch.zeros(E // R, dtype=torch.int32)
        recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
            x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=alignment,
            cumulative_local_expert_recv_stats=stats, async_with_compute_stream=True)
        event.current_stream_wait()  # host backend: already complete
        ref_x, ref_idx, ref_w, ref_g, ref_first, per_source = reference(inputs, rank, R)
        assert torch.equal(recv_x, ref_x) and torch.equal(recv_idx, ref_idx) and torch.equal(recv_w, ref_w)
        n = ref_x.shape[0]
        assert handle.num_recv_tokens == n and handle.recv_src_metadata.shape == (n, 2 + K)
        assert torch.equal(handle.recv_src_metadata[:, 0], ref_g)
        assert torch.equal(handle.recv_src_metadata[:, 1], ref_first)
        assert bool((handle.recv_src_metadata[:, 2:] == -1).all())
        assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == torch.tensor(per_source).cumsum(0).tolist()
        counts = [int((ref_idx == e).sum()) for e in range(E // R)]
        assert stats.tolist() == counts
        assert handle.num_recv_tokens_per_expert_list == [align(c, alignment) for c in counts]
        assert handle.psum_num_recv_tokens_per_expert.tolist() == \
            torch.tensor([align(c, alignment) for c in counts]).cumsum(0).tolist()
        assert handle.num_unaligned_recv_tokens_per_expert is None and not handle.do_expand
        assert handle.topk_idx is not idx and torch.equal(handle.topk_idx, idx)

        cached_x, cached_idx, cached_w, cached_handle, _ = buffer.dispatch(x, handle=handle)
        assert cached_handle is handle and cached_w is None
        assert torch.equal(cached_x, recv_x) and torch.equal(cached_idx, recv_idx)
        # With weights, a cached dispatch still returns them (epx runs a fresh dispatch on the handle's routing).
        _, _, cached_w, _, _ = buffer.dispatch(x, handle=handle, topk_weights=w)
        assert torch.equal(cached_w, recv_w)

        # Each rank returns rows k / 8 that depend on (its rank, the token's global index).
        y = torch.stack([exact_rows(1, 1000 * rank + int(g))[0] for g in ref_g]) if n else torch.empty(0, H)
        # Weights as DeepEP V2 returns them (the source's weight also where the expert is elsewhere) are masked.
        full_w = torch.cat([inp[2][(inp[1] >= 0).__and__(inp[1] // (E // R) == rank).any(dim=1)] for inp in inputs])
        combined, combined_w, _ = buffer.combine(y.to(torch.bfloat16), handle, topk_weights=full_w,
                                                 bias=(bias[rank], bias[rank]))
        return handle.recv_src_metadata, handle.dst_buffer_slot_idx, y, combined, combined_w

    results = run(fn)

    def rows_of(r, s):
        meta, _, y, _, _ = results[r]
        return {int(g) - s * M: y[i] for i, g in enumerate(meta[:, 0]) if int(g) // M == s}

    expected = expected_combine(inputs, rows_of, R, bias=(bias, bias))
    for s in range(R):
        _, dst, _, combined, combined_w = results[s]
        assert torch.equal(combined, expected[s])
        assert torch.equal(combined_w, inputs[s][2])
        # dst_buffer_slot_idx[t, r]: the row of token t at rank r, whose metadata names it.
        for t in range(inputs[s][0].shape[0]):
            for r in range(R):
                j = int(dst[t, r])
                sent = bool(((inputs[s][1][t] >= 0) & (inputs[s][1][t] // (E // R) == r)).any())
                assert (j >= 0) == sent
                if sent:
                    assert int(results[r][0][j, 0]) == s * M + t


@pytest.mark.parametrize("fp8", [False, True])
def test_expand_mode(fp8):
    inputs = [make(r) for r in range(R)]
    alignment = 8

    def fn(rank, buffer):
        x, idx, w = inputs[rank]
        plain_x, plain_idx, plain_w, plain_handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                                 expert_alignment=alignment)
        if fp8:
            scales = torch.rand(x.shape[0], H // 128) + 0.5
            data = x.to(torch.float8_e4m3fn)
            send, plain = (data, scales), buffer.dispatch((data, scales), topk_idx=idx, num_experts=E)[0]
        else:
            send = x
        stats = torch.zeros(E // R, dtype=torch.int32)
        recv, recv_idx, recv_w, handle, _ = buffer.dispatch(
            send, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=alignment, do_expand=True,
            use_tma_aligned_col_major_sf=True, cumulative_local_expert_recv_stats=stats)
        assert recv_idx is None and handle.do_expand
        recv_x, recv_sf = recv if fp8 else (recv, None)
        meta = handle.recv_src_metadata
        assert torch.equal(meta[:, 0], plain_handle.recv_src_metadata[:, 0])
        counts = [int((plain_idx == e).sum()) for e in range(E // R)]
        assert stats.tolist() == counts and handle.num_unaligned_recv_tokens_per_expert.tolist() == counts
        psum = handle.psum_num_recv_tokens_per_expert.tolist()
        starts = [0] + [align(p, alignment) for p in psum[:-1]]
        assert [p - s for p, s in zip(psum, starts)] == counts
        assert handle.num_expanded_tokens == sum(align(c, alignment) for c in counts) == recv_x.shape[0]
        assert recv_w.shape == (recv_x.shape[0],)
        # Every local (row, k) pair has its own slot, inside its expert's block, in row order.
        slots = meta[:, 2:]
        assert torch.equal(slots >= 0, plain_idx >= 0)
        for e in range(E // R):
            mine = slots[plain_idx == e]
            assert mine.tolist() == list(range(starts[e], starts[e] + counts[e]))
        for i in range(meta.shape[0]):
            for k in range(K):
                s = int(slots[i, k])
                if s < 0:
                    continue
                want = plain[0][i] if fp8 else plain_x[i]
                assert torch.equal(recv_x[s].view(torch.uint8), want.view(torch.uint8))
                if fp8:
                    assert torch.equal(recv_sf[s], plain[1][i])
                assert float(recv_w[s]) == float(plain_w[i, k])
        if fp8:  # TMA-aligned column-major scales
            assert recv_sf.stride() == (1, align(recv_x.shape[0], 4))

        cached, _, cached_w, _, _ = buffer.dispatch(send, handle=handle, topk_weights=w, do_expand=True,
                                                    do_zero_padding=True)
        cached_x = cached[0] if fp8 else cached
        valid = slots[slots >= 0].long()
        assert torch.equal(cached_x[valid].view(torch.uint8), recv_x[valid].view(torch.uint8))
        assert torch.equal(cached_w[valid], recv_w[valid])
        for e in range(E // R):
            assert bool((cached_x[psum[e]:align(psum[e], alignment)].float() == 0).all())
            assert bool((cached_w[psum[e]:align(psum[e], alignment)] == 0).all())

        # Expand combine: one row per slot; the rank sums a token's rows in top-k order first.
        z = exact_rows(recv_x.shape[0], 77 + rank)
        combined, combined_w, _ = buffer.combine(z, handle, topk_weights=recv_w)
        local_sum = torch.zeros(meta.shape[0], H)
        for k in range(K):
            ok = slots[:, k] >= 0
            local_sum[ok] += z[slots[ok, k].long()].float()
        return meta, local_sum.to(torch.bfloat16), combined, combined_w

    results = run(fn)

    def rows_of(r, s):
        meta, rows, _, _ = results[r]
        return {int(g) - s * M: rows[i] for i, g in enumerate(meta[:, 0]) if int(g) // M == s}

    expected = expected_combine(inputs, rows_of, R)
    for s in range(R):
        assert torch.equal(results[s][2], expected[s])
        assert torch.equal(results[s][3], inputs[s][2])


@pytest.mark.parametrize("expand", [False, True])
def test_without_cpu_sync_outputs_have_worst_case_rows(expand):
    inputs = [make(r) for r in range(R)]

    def fn(rank, buffer):
        x, idx, w = inputs[rank]
        exact_x, _, exact_w, exact, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                        do_expand=expand)
        recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                              do_cpu_sync=False, do_expand=expand)
        n = exact.num_recv_tokens
        assert handle.num_recv_tokens == R * M and handle.num_recv_tokens_per_expert_list == []
        assert int(handle.psum_num_recv_tokens_per_scaleup_rank[-1]) == n
        meta = handle.recv_src_metadata
        assert meta.shape == (R * M, 2 + K) and torch.equal(meta[:n], exact.recv_src_metadata)
        assert bool((meta[n:] == -1).all())
        if expand:
            bound = R * M * min(K, E // R)
            assert handle.num_expanded_tokens == bound == recv_x.shape[0] == recv_w.shape[0]
            valid = exact.recv_src_metadata[:, 2:]
            valid = valid[valid >= 0].long()
            assert torch.equal(recv_x[valid], exact_x[valid]) and torch.equal(recv_w[valid], exact_w[valid])
            z = exact_rows(bound, 5 + rank)
            zz = torch.zeros(exact.num_expanded_tokens, H, dtype=torch.bfloat16)
            zz[valid] = z[valid]
            a, _, _ = buffer.combine(z, handle)
            b, _, _ = buffer.combine(zz, exact)
        else:
            assert recv_x.shape[0] == R * M and torch.equal(recv_x[:n], exact_x)
            assert bool((recv_idx[n:] == -1).all())
            z = exact_rows(R * M, 5 + rank)
            a, _, _ = buffer.combine(z, handle)
            b, _, _ = buffer.combine(z[:n], exact)
        assert torch.equal(a, b)
        # A cached dispatch of a no-sync handle keeps the worst-case rows (an expand handle also gives plain rows).
        assert buffer.dispatch(x, handle=handle, do_expand=expand)[0].shape[0] == recv_x.shape[0]
        assert buffer.dispatch(x, handle=handle)[0].shape[0] == R * M

    run(fn)


def test_two_nodes():
    num_ranks, gpus = 4, 2
    inputs = [make(r) for r in range(num_ranks)]

    def fn(rank, buffer):
        assert buffer.get_logical_domain_size() == (2, 2)
        assert (buffer.scaleout_rank_idx, buffer.scaleup_rank_idx) == (rank // 2, rank % 2)
        x, idx, w = inputs[rank]
        recv_x, recv_idx, _, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        ref_x, ref_idx, _, ref_g, _, per_source = reference(inputs, rank, num_ranks)
        assert torch.equal(recv_x, ref_x) and torch.equal(recv_idx, ref_idx)
        assert torch.equal(handle.recv_src_metadata[:, 0], ref_g)
        by_local = [per_source[i] + per_source[i + gpus] for i in range(gpus)]
        assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == torch.tensor(by_local).cumsum(0).tolist()
        y = torch.stack([exact_rows(1, 10 * rank + int(g))[0] for g in ref_g])
        combined, combined_w, _ = buffer.combine(y, handle, topk_weights=torch.ones(y.shape[0], K))
        return handle.recv_src_metadata, y, combined, combined_w

    results = run(fn, num_ranks=num_ranks, gpus_per_node=gpus)

    def rows_of(r, s):
        meta, y, _, _ = results[r]
        return {int(g) - s * M: y[i] for i, g in enumerate(meta[:, 0]) if int(g) // M == s}

    expected = expected_combine(inputs, rows_of, num_ranks)
    for s in range(num_ranks):
        assert torch.equal(results[s][2], expected[s])
        assert torch.equal(results[s][3], (inputs[s][1] >= 0).float())


def test_combine_sums_in_deepep_order():
    # DeepEP's reference order (fp32 0 + the bias, then each rank's row by the last top-k slot whose expert is on it,
    # one rounding): three ranks return a token's row times 1, -1 and a tiny factor, so what survives the
    # cancellation depends on the order; compared bit for bit.
    num_ranks, num_experts = 3, 12
    inputs = [make(r, num_experts) for r in range(num_ranks)]
    bias = [(torch.randn(inputs[r][0].shape[0], H, generator=torch.Generator().manual_seed(r)) * 1e-6)
            .to(torch.bfloat16) for r in range(num_ranks)]

    def fn(rank, buffer):
        x, idx, w = inputs[rank]
        recv_x, _, recv_w, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts)
        y = (recv_x.float() * [1.0, -1.0, 1.37e-6][rank]).to(torch.bfloat16)
        combined, _, _ = buffer.combine(y, handle, topk_weights=recv_w, bias=bias[rank])
        return handle.recv_src_metadata, y, combined

    results = run(fn, num_ranks=num_ranks)
    local = num_experts // num_ranks
    for s in range(num_ranks):
        x, idx, _ = inputs[s]
        want = torch.empty_like(x)
        for t in range(x.shape[0]):
            rows = {}
            for r in range(num_ranks):
                meta, y, _ = results[r]
                hit = (meta[:, 0] == s * M + t).nonzero().flatten()
                if hit.numel():
                    rows[r] = y[int(hit[0])]
            last = {int(e) // local: k for k, e in enumerate(idx[t].tolist()) if e >= 0}
            acc = bias[s][t].float()
            for r in sorted(rows, key=lambda r: last[r]):
                acc = acc + rows[r].float()
            want[t] = acc.to(torch.bfloat16)
        assert torch.equal(results[s][2].view(torch.int16), want.view(torch.int16))


def test_bad_arguments_name_the_argument():
    inputs = [make(r) for r in range(R)]

    def fn(rank, buffer):
        x, idx, w = inputs[rank]
        with pytest.raises(ValueError, match="topk_idx is required"):
            buffer.dispatch(x, num_experts=E)
        with pytest.raises(ValueError, match="num_experts is required"):
            buffer.dispatch(x, topk_idx=idx)
        with pytest.raises(ValueError, match="multiple of the ranks"):
            buffer.dispatch(x, topk_idx=idx, num_experts=E + 1)
        with pytest.raises(ValueError, match="num_max_tokens_per_rank=8 must be >= this rank's tokens"):
            buffer.dispatch(x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=8)
        with pytest.raises(ValueError, match="do_zero_padding needs do_expand"):
            buffer.dispatch(x, topk_idx=idx, num_experts=E, do_zero_padding=True)
        with pytest.raises(ValueError, match="previous_event needs allocate_on_comm_stream"):
            buffer.dispatch(x, topk_idx=idx, num_experts=E, previous_event=buffer.capture())
        with pytest.raises(ValueError, match="cumulative_local_expert_recv_stats must be int32"):
            buffer.dispatch(x, topk_idx=idx, num_experts=E, cumulative_local_expert_recv_stats=torch.zeros(3))
        with pytest.raises(ValueError, match="expert_alignment must be an integer >= 1"):
            buffer.dispatch(x, topk_idx=idx, num_experts=E, expert_alignment=0)
        _, _, _, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        with pytest.raises(ValueError, match="takes no topk_idx"):
            buffer.dispatch(x, topk_idx=idx, handle=handle)
        with pytest.raises(ValueError, match="cannot synchronize"):
            buffer.dispatch(x, handle=handle, do_cpu_sync=True)
        with pytest.raises(ValueError, match="do_expand=True needs a handle from an expand-mode dispatch"):
            buffer.dispatch(x, handle=handle, do_expand=True)
        with pytest.raises(ValueError, match="num_experts=32 differs from the handle's 16"):
            buffer.dispatch(x, handle=handle, num_experts=32)
        with pytest.raises(TypeError, match="EPHandle"):
            buffer.combine(x, (1, 2))
        with pytest.raises(NotImplementedError, match="Engram"):
            buffer.engram_fetch(torch.zeros(1))
        with pytest.raises(NotImplementedError, match="AGRS"):
            buffer.all_gather(x)
        assert buffer.get_theoretical_num_qps(buffer.get_theoretical_num_sms(E, K)) >= 1

    run(fn)
    group = epx.host_groups(1)[0]
    with pytest.raises(NotImplementedError, match="num_cpu_bytes"):
        deep_ep.ElasticBuffer(group, num_cpu_bytes=2 << 20)
    with pytest.raises(ValueError, match="num_max_tokens_per_rank must be an integer >= 0"):
        deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=-1)
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=4)
    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        buffer.destroy()
    assert deep_ep.ElasticBuffer.get_buffer_size_hint(group, 4096, 7168) % (2 << 20) == 0


def test_expand_combine_needs_multiple_reduction():
    inputs = [make(r) for r in range(R)]

    def fn(rank, buffer):
        x, idx, w = inputs[rank]
        recv_x, _, _, handle, _ = buffer.dispatch(x, topk_idx=idx, num_experts=E, do_expand=True)
        with pytest.raises(NotImplementedError, match="allow_multiple_reduction=False"):
            buffer.combine(recv_x, handle)
        # The non-expand layout combines as usual.
        recv_x, _, _, handle, _ = buffer.dispatch(x, topk_idx=idx, num_experts=E)
        buffer.combine(recv_x, handle)

    run(fn, allow_multiple_reduction=False)


@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize("sync", [True, False])
def test_idle_rank_and_a_rank_that_receives_nothing(expand, sync):
    # Rank 1 has no tokens; every token of rank 0 picks experts 0 and 1, both on rank 0, so rank 1 receives nothing.
    def fn(rank, buffer):
        tokens = 0 if rank == 1 else 5
        x = torch.randn(tokens, H).to(torch.bfloat16)
        idx = torch.tensor([[0, 1]] * tokens, dtype=torch.int64).reshape(tokens, 2)
        w = torch.rand(tokens, 2)
        recv_x, _, recv_w, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=4,
                                                       do_expand=expand, do_cpu_sync=sync, expert_alignment=4)
        received = [5 if rank == 0 else 0, 5 if rank == 0 else 0]  # pairs per local expert
        if sync:
            assert recv_x.shape[0] == (sum(-(-c // 4) * 4 for c in received) if expand else received[0])
        assert int(handle.psum_num_recv_tokens_per_scaleup_rank[-1]) == received[0]
        y = torch.ones(recv_x.shape[0], H, dtype=torch.bfloat16)
        combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w)
        assert combined.shape == (tokens, H) and bool((combined.float() == (2 if expand else 1)).all())
        assert torch.equal(combined_w, w)

    run(fn, num_max_tokens_per_rank=8)

"""epx.deep_ep (DeepEP's V1 API) on the host backend: torch CPU tensors, ranks as threads (epx.host_groups).

The same properties as python/tests/gpu/test_deep_ep_shim.py, without streams: layout, dispatch rows in
(source rank, token) order, rank_prefix_matrix, per-expert counts, cached / worst-token / layout-only /
fp8 dispatch, combine, low-latency packed rows and DeepEP's column-major scales, zero_copy / out / hook
combine, the mask-buffer calls. Skipped without torch.
"""

import pytest

torch = pytest.importorskip("torch")
import epx  # noqa: E402
from epx import deep_ep  # noqa: E402

R, T, H, K, E = 2, 61, 1024, 4, 16


def make(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.topk(torch.rand(T, E, generator=g), K).indices
    idx[3, 1] = -1
    idx[0] = -1
    return x, idx, torch.rand(T, K, generator=g)


INPUTS = [make(r) for r in range(R)]


def expected_rows(me, which):
    num_local = E // R
    xs, idxs, ws, per_source = [], [], [], []
    for s in range(R):
        x, idx, w = INPUTS[s]
        data = which(s)
        mine = (idx >= 0) & (idx // num_local == me)
        sel = mine.any(dim=1)
        xs.append(data[sel])
        idxs.append(torch.where(mine, idx - me * num_local, torch.full_like(idx, -1))[sel])
        ws.append(torch.where(mine, w, torch.zeros_like(w))[sel])
        per_source.append(int(sel.sum()))
    return torch.cat(xs), torch.cat(idxs), torch.cat(ws), per_source


def run(fn, **kw):
    def body(rank, group):
        buffer = deep_ep.Buffer(group, explicitly_destroy=True, **kw)
        try:
            return fn(rank, buffer)
        finally:
            buffer.destroy()

    return epx.run_host_ranks(epx.host_groups(R), body)


def test_normal_dispatch_combine():
    def fn(rank, buffer):
        x, idx, w = INPUTS[rank]
        per_rank, rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
        assert rdma is None
        assert in_rank.tolist() == [[bool(((idx[t] >= 0) & (idx[t] // (E // R) == r)).any()) for r in range(R)]
                                    for t in range(T)]
        assert per_expert.tolist() == [int((idx == e).sum()) for e in range(E)]
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        ref_x, ref_idx, ref_w, per_source = expected_rows(rank, lambda s: INPUTS[s][0])
        counts = [int((torch.stack([i for _, i, _ in INPUTS]) == rank * (E // R) + e).sum()) for e in range(E // R)]

        recv_x, recv_idx, recv_w, lst, handle, event = buffer.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
        assert torch.equal(recv_x, ref_x) and torch.equal(recv_idx, ref_idx) and torch.equal(recv_w, ref_w)
        assert lst == counts and event.event is None
        prefix = handle[0]
        assert prefix.dtype == torch.int32 and prefix[:, rank].tolist() == [sum(per_source[:s + 1]) for s in range(R)]

        # async_finish on the host backend: an already-complete event
        _, _, _, _, _, event = buffer.dispatch(x, topk_idx=idx, topk_weights=w, async_finish=True, **layout)
        event.current_stream_wait()

        wx, widx, _, empty, _, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=T * R, **layout)
        n = ref_x.shape[0]
        assert empty == [] and wx.shape[0] == T * R and torch.equal(wx[:n], ref_x) and bool((widx[n:] == -1).all())

        cx, c_idx, _, c_list, c_handle, _ = buffer.dispatch(x, handle=tuple(handle))  # rebuilt tuple
        assert torch.equal(cx, ref_x) and c_idx is None and c_list is None and c_handle is None

        lx, l_idx, _, l_list, _, _ = buffer.dispatch(x, **layout)  # layout only, no top-k
        assert torch.equal(lx, ref_x) and l_idx is None and l_list == counts

        amax = x.float().view(T, H // 128, 128).abs().amax(dim=2).clamp(min=1e-4)
        q = (x.float().view(T, H // 128, 128) / (amax / 448).unsqueeze(2)).to(torch.float8_e4m3fn).view(T, H)
        scales = (amax / 448).T.contiguous().T  # column-major, as DeepEP's test passes them
        (rq, rs), _, _, _, _, _ = buffer.dispatch((q, scales), topk_idx=idx, topk_weights=w, **layout)
        assert rq.dtype == torch.float8_e4m3fn and rs.shape == (n, H // 128)
        scales_of = lambda s: INPUTS[s][0].float().view(T, H // 128, 128).abs().amax(dim=2).clamp(min=1e-4) / 448  # noqa
        assert torch.equal(rs, expected_rows(rank, scales_of)[0])

        out, out_w, _ = buffer.combine(recv_x, handle, recv_w, bias=x)
        fan = in_rank.sum(dim=1, keepdim=True).float()
        torch.testing.assert_close(out.float(), x.float() * fan + x.float(), rtol=2 ** -7, atol=2e-2)
        torch.testing.assert_close(out_w, torch.where(idx >= 0, w, torch.zeros_like(w)))
        return True

    assert all(run(fn))


def test_low_latency():
    M = 64
    nbytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E)

    def fn(rank, buffer):
        x, idx, w = INPUTS[rank]
        num_local = E // R
        wsum = torch.where(idx >= 0, w, torch.zeros_like(w)).sum(dim=1, keepdim=True)
        for use_fp8, round_scale, use_ue8m0 in ((False, False, False), (True, False, False), (True, True, False),
                                                (True, True, True)):
            stats = torch.zeros(num_local, dtype=torch.int32)
            recv, count, handle, _, hook = buffer.low_latency_dispatch(
                x, idx, M, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8, round_scale=round_scale,
                use_ue8m0=use_ue8m0, return_recv_hook=True)
            hook()
            assert torch.equal(stats, count)
            if use_fp8:
                q, scales = recv
                cols = H // 512 if use_ue8m0 else H // 128
                assert scales.shape == (num_local, R * M, cols) and scales.stride() == (cols * R * M, 1, R * M)
                scales = scales.contiguous()
                if use_ue8m0:
                    scales = (scales.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
                data = (q.float().view(num_local, R * M, H // 128, 128) * scales.unsqueeze(3)).view(num_local, R * M, H)
                if round_scale:
                    assert torch.equal(torch.log2(scales[:, :1]), torch.round(torch.log2(scales[:, :1]))) or \
                        int(count[0]) == 0
            else:
                data = recv.float()
            for e in range(num_local):
                ge = rank * num_local + e
                rows, src, per_source = [], [], []
                for s in range(R):
                    tokens = torch.nonzero((INPUTS[s][1] == ge).any(dim=1)).flatten()
                    rows.append(INPUTS[s][0][tokens].float())
                    src.append(tokens.to(torch.int32))
                    per_source.append(int(tokens.numel()))
                n = int(count[e])
                assert n == sum(per_source)
                assert torch.equal(handle[0][e, :n], torch.cat(src))
                begins = [sum(per_source[:s]) for s in range(R)]
                assert handle[1][e].tolist() == [(b << 32) | c for b, c in zip(begins, per_source)]
                tol = dict(rtol=0.13, atol=1e-2) if use_fp8 else dict(rtol=0, atol=0)
                torch.testing.assert_close(data[e, :n], torch.cat(rows), **tol)

            sim = data.to(torch.bfloat16)
            tol = dict(rtol=0.13, atol=0.1) if use_fp8 else dict(rtol=2 ** -7, atol=1e-2)
            staging = buffer.get_next_low_latency_combine_buffer(handle)
            staging[:, :, :] = sim
            out = torch.empty(T, H, dtype=torch.bfloat16)
            combined, _, chook = buffer.low_latency_combine(sim, idx, w, handle, zero_copy=True, out=out,
                                                            return_recv_hook=True)
            chook()
            assert combined.data_ptr() == out.data_ptr()
            # The next combine's zero-copy input is the other tensor (the previous combine may still read this one).
            assert buffer.get_next_low_latency_combine_buffer(handle).data_ptr() != staging.data_ptr()
            torch.testing.assert_close(combined.float(), x.float() * wsum, **tol)

        status = torch.zeros(R, dtype=torch.int32)
        buffer.low_latency_update_mask_buffer(1 - rank, True)
        buffer.low_latency_query_mask_buffer(status)
        assert status.tolist() == [int(r == 1 - rank) for r in range(R)]
        buffer.low_latency_update_mask_buffer(1 - rank, False)
        buffer.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * R
        buffer.clean_low_latency_buffer(M, H, E)
        with pytest.raises(NotImplementedError, match="use_logfmt"):
            buffer.low_latency_combine(sim, idx, w, handle, use_logfmt=True)
        return True

    assert all(run(fn, num_rdma_bytes=nbytes, low_latency_mode=True))


def test_low_latency_expert_side_reduction():
    """epx_low_latency reaches the runtime: the expert-side reduction (bf16 partial per expert rank, then their sum)
    differs from the default order somewhere, and both stay close to x * sum(w)."""
    M = 64
    nbytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E)
    config = epx.LowLatencyConfig()
    config.expert_side_reduction = True

    def fn(rank, buffer):
        x, idx, w = INPUTS[rank]
        g = torch.Generator().manual_seed(7 + rank)
        recv, count, handle, _, _ = buffer.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        y = (recv.float() * (1 + torch.rand(recv.shape, generator=g))).to(torch.bfloat16)  # per-slot outputs
        combined, _, _ = buffer.low_latency_combine(y, idx, w, handle)
        return combined

    plain = run(fn, num_rdma_bytes=nbytes, low_latency_mode=True)
    side = run(fn, num_rdma_bytes=nbytes, low_latency_mode=True, epx_low_latency=config)
    assert any(not torch.equal(a, b) for a, b in zip(plain, side))
    for a, b in zip(plain, side):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -6, atol=2e-2)


def test_static_helpers_and_errors():
    deep_ep.Buffer.set_num_sms(24)
    assert deep_ep.Buffer.get_dispatch_config(8).num_sms == 24
    assert deep_ep.Config(24, 8, 256).get_nvl_buffer_size_hint(7168 * 2, 8) > 0
    assert deep_ep.Config().get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert deep_ep.Config().get_rdma_buffer_size_hint(7168 * 2, 16) == 0  # internode: epx keeps no RDMA memory
    with pytest.raises(ValueError):
        deep_ep.Buffer.set_num_sms(3)
    assert deep_ep.topk_idx_t == torch.int64
    with pytest.raises(RuntimeError):
        deep_ep.EventOverlap().current_stream_wait()


def test_event_overlap_hook_release_and_utils():
    """DeepEP's EventOverlap extras: a hook run once after the wait, ``with overlap(release_handle=True)``, the
    ``deep_ep.utils`` module and ``__version__``."""
    overlap = deep_ep.EventOverlap(deep_ep.EventHandle.completed())
    calls = []
    overlap.register_hook_after_wait(lambda: calls.append("hook"))
    with pytest.raises(RuntimeError, match="already registered"):
        overlap.register_hook_after_wait(lambda: None)
    with overlap(release_handle=True):
        calls.append("body")
    assert calls == ["body", "hook"]
    assert overlap.event is None
    with pytest.raises(RuntimeError, match="no event"):
        overlap.current_stream_wait()
    kept = deep_ep.EventOverlap(deep_ep.EventHandle.completed())
    kept.current_stream_wait()
    kept.current_stream_wait()  # without release_handle the event stays
    assert kept.event is not None
    from epx.deep_ep.utils import EventHandle, EventOverlap
    assert EventOverlap is deep_ep.EventOverlap and EventHandle is deep_ep.EventHandle
    assert deep_ep.__version__.startswith("1.2.1")

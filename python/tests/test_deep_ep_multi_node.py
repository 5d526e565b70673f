"""epx.deep_ep (DeepEP's V1 API) across nodes on the host backend: torch CPU tensors, ranks as threads.

Topology: 4 ranks as 2 nodes x 2 ranks (epx.host_groups(4, gpus_per_node=2)), numbered node-major; the shim takes
the nodes (DeepEP's RDMA ranks) from the epx group. Routing: E = 16 experts, 4 per rank; token t of rank r picks
K = 4 of them from a generator seeded by r, token 0 goes nowhere and token 3 has one -1 slot. Data: bf16 values k / 8
with |k| <= 16, so fp32 sums are exact. The same calls (bf16 and fp8 dispatch, cached, combine with and without
biases) on a one-node group of 4 ranks (flat routing) must give the same rows and sums. Skipped without torch.
"""

import pytest

torch = pytest.importorskip("torch")
import epx  # noqa: E402
from epx import deep_ep  # noqa: E402
from epx.deep_ep.buffer import gpus_per_node_from_hosts  # noqa: E402

R, G, T, H, K, E = 4, 2, 29, 256, 4, 16
NUM_LOCAL = E // R


def make(rank):
    g = torch.Generator().manual_seed(1700 + rank)
    x = (torch.randint(-16, 17, (T, H), generator=g).float() / 8).to(torch.bfloat16)  # exact fp32 sums
    idx = torch.topk(torch.rand(T, E, generator=g), K).indices
    idx[3, 1] = -1
    idx[0] = -1
    return x, idx, torch.rand(T, K, generator=g)


INPUTS = [make(r) for r in range(R)]


def in_rank_of(idx):
    return torch.stack([((idx >= 0) & (idx // NUM_LOCAL == d)).any(dim=1) for d in range(R)], dim=1)


def run(fn, gpus_per_node=G, **kw):
    def body(rank, group):
        buffer = deep_ep.Buffer(group, explicitly_destroy=True, **kw)
        try:
            return fn(rank, buffer)
        finally:
            buffer.destroy()

    return epx.run_host_ranks(epx.host_groups(R, gpus_per_node=gpus_per_node), body)


def normal_calls(rank, buffer):
    x, idx, w = INPUTS[rank]
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    cached_x, *_ = buffer.dispatch(x, handle=tuple(handle))  # a rebuilt tuple finds its epx handle again
    out, out_w, _ = buffer.combine(recv_x, handle, recv_w)
    out_bias, _, _ = buffer.combine(recv_x, handle, bias=(x, x))
    scales = x.float().view(T, H // 128, 128).abs().amax(dim=2).clamp(min=1e-4) / 448
    q = (x.float().view(T, H // 128, 128) / scales.unsqueeze(2)).to(torch.float8_e4m3fn).view(T, H)
    (fp8_x, fp8_s), *_ = buffer.dispatch((q, scales.T.contiguous().T), topk_idx=idx, topk_weights=w,
                                         num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                                         is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    return dict(per_rdma=per_rdma, in_rank=in_rank, recv_x=recv_x, recv_idx=recv_idx, recv_w=recv_w, counts=counts,
                handle=handle, cached_x=cached_x, out=out, out_w=out_w, out_bias=out_bias,
                fp8_x=fp8_x.view(torch.uint8), fp8_s=fp8_s)


def test_internode_buffer_matches_intranode():
    def internode(rank, buffer):
        assert buffer.is_internode() and buffer.get_num_rdma_ranks() == R // G
        assert (buffer.get_rdma_rank(), buffer.num_nvl_ranks) == (rank // G, G)
        return normal_calls(rank, buffer)

    def intranode(rank, buffer):
        assert not buffer.is_internode() and buffer.get_num_rdma_ranks() == 1
        return normal_calls(rank, buffer)

    multi = run(internode, num_rdma_bytes=1 << 20)
    single = run(intranode, gpus_per_node=0)
    for rank in range(R):
        m, s = multi[rank], single[rank]
        x, idx, w = INPUTS[rank]
        # Layout: DeepEP's num_tokens_per_rdma_rank, None on one node.
        assert s["per_rdma"] is None
        assert m["per_rdma"].dtype == torch.int32
        assert m["per_rdma"].tolist() == in_rank_of(idx).view(T, R // G, G).any(dim=2).sum(dim=0).tolist()
        # Same rows, metadata, counts and sums as the flat path.
        for key in ("recv_x", "recv_idx", "recv_w", "cached_x", "out", "out_w", "out_bias", "fp8_x", "fp8_s"):
            assert torch.equal(m[key], s[key]), (rank, key)
        assert m["counts"] == s["counts"]
        fan = in_rank_of(idx).sum(dim=1, keepdim=True).float()
        assert torch.equal(m["out"].float(), x.float() * fan)
        assert torch.equal(m["out_bias"].float(), x.float() * (fan + 2))
        # DeepEP's internode handle: 10 entries, [0] is_token_in_rank, [6] recv_gbl_rank_prefix_sum, [7] one row
        # per received token; the intranode handle stays DeepEP's 6-tuple.
        h = m["handle"]
        assert len(h) == 10 and len(s["handle"]) == 6
        assert torch.equal(h[0], m["in_rank"])
        assert h[6].dtype == torch.int32 and h[6].tolist() == s["handle"][0][:, rank].tolist()
        assert h[6].tolist() == torch.cumsum(torch.tensor([int(in_rank_of(INPUTS[p][1])[:, rank].sum())
                                                           for p in range(R)]), 0).tolist()
        assert h[7].size(0) == m["recv_x"].size(0)
        assert all(h[i] is None for i in (1, 2, 3, 4, 5, 8, 9))
        assert torch.equal(h.rank_prefix_matrix, s["handle"][0])


def test_internode_calls_and_layout_only_dispatch():
    def fn(rank, buffer):
        x, idx, w = INPUTS[rank]
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
        layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                      num_tokens_per_expert=per_expert)
        recv_x, _, recv_w, _, handle, _ = buffer.internode_dispatch(x, topk_idx=idx, topk_weights=w, **layout)
        out, out_w, _ = buffer.internode_combine(recv_x, handle, recv_w)
        fan = in_rank.sum(dim=1, keepdim=True).float()
        assert torch.equal(out.float(), x.float() * fan)
        assert torch.equal(out_w, torch.where(idx >= 0, w, torch.zeros_like(w)))
        # Without top-k (is_token_in_rank routes): the same rows, and an internode handle combine takes.
        lx, l_idx, _, _, l_handle, _ = buffer.dispatch(x, **layout)
        assert torch.equal(lx, recv_x) and l_idx is None and len(l_handle) == 10
        # Worst-token mode: exactly num_worst_tokens rows.
        wx, *_ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=T * R, **layout)
        assert wx.shape[0] == T * R and torch.equal(wx[:recv_x.shape[0]], recv_x)
        return True

    assert all(run(fn))


def test_one_node_buffer_refuses_internode_calls():
    def fn(rank, buffer):
        x, idx, _ = INPUTS[rank]
        with pytest.raises(RuntimeError, match="more than one node"):
            buffer.internode_dispatch(x)
        return True

    assert all(run(fn, gpus_per_node=0))


def test_rdma_size_hint_and_nodes_from_host_names():
    assert deep_ep.Config().get_rdma_buffer_size_hint(7168 * 2, 16) == 0
    assert gpus_per_node_from_hosts(["a"] * 8) == 0
    assert gpus_per_node_from_hosts(["a"] * 8 + ["b"] * 8) == 8
    assert gpus_per_node_from_hosts(["a", "a", "b", "b", "c", "c"]) == 2
    with pytest.raises(ValueError, match="same number of ranks"):
        gpus_per_node_from_hosts(["a", "a", "b"])
    with pytest.raises(ValueError, match="node-major"):
        gpus_per_node_from_hosts(["a", "b", "a", "b"])

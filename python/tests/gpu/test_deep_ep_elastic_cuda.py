"""epx.deep_ep.ElasticBuffer (DeepEP V2's expert-parallel API) on the CUDA backend, against the host backend.

One process, one thread per rank (epx.cuda_groups; with one GPU both ranks share it), the same inputs on both
backends: fresh dispatch with expert alignment and the cumulative counter, cached dispatch, expand mode with fp8 and
TMA-aligned column-major scales, cached expand with zero padding, dispatch without CPU sync, and combine of both
layouts with biases and weights. Every specified element is compared bit for bit (padding rows without
do_zero_padding and rows past the received ones hold unspecified data and are left out). The host-backend checks
against a reference written from the routing are python/tests/test_deep_ep_elastic.py.
"""

import pytest

torch = pytest.importorskip("torch")
import epx  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not epx.built_with_cuda(),
    reason="needs a GPU, torch with CUDA and an epx build with the CUDA backend")

from epx import deep_ep  # noqa: E402

R, T, H, K, E, M = 2, 300, 1024, 8, 32, 320


def devices():
    return [r % torch.cuda.device_count() for r in range(R)]


def make(rank):
    g = torch.Generator().manual_seed(4200 + rank)
    tokens = T - 7 * rank
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    idx[torch.rand(tokens, generator=g) < 0.2, 3] = -1
    w = torch.rand(tokens, K, generator=g)
    w[idx < 0] = 0
    scales = torch.rand(tokens, H // 128, generator=g) + 0.5
    bias = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    return x, idx, w, scales, bias


def scenario(rank, buffer, device):
    x, idx, w, scales, bias = (t.to(device) for t in make(rank))
    out = {}
    stats = torch.zeros(E // R, dtype=torch.int32, device=device)
    recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                          num_max_tokens_per_rank=M, expert_alignment=4,
                                                          cumulative_local_expert_recv_stats=stats)
    out.update(recv_x=recv_x, recv_idx=recv_idx, recv_w=recv_w, meta=handle.recv_src_metadata, stats=stats,
               psum_rank=handle.psum_num_recv_tokens_per_scaleup_rank,
               psum_expert=handle.psum_num_recv_tokens_per_expert,
               dst=handle.dst_buffer_slot_idx, counts=torch.tensor(handle.num_recv_tokens_per_expert_list))
    cached_x, cached_idx, _, _, _ = buffer.dispatch(x, handle=handle)
    out.update(cached_x=cached_x, cached_idx=cached_idx)
    y = (recv_x.float() * (rank + 1)).to(torch.bfloat16)
    combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w, bias=(bias, bias))
    out.update(combined=combined, combined_w=combined_w)

    fp8 = (x.to(torch.float8_e4m3fn), scales)
    (ex_x, ex_sf), _, ex_w, ex_handle, _ = buffer.dispatch(fp8, topk_idx=idx, topk_weights=w, num_experts=E,
                                                           num_max_tokens_per_rank=M, expert_alignment=8,
                                                           do_expand=True, use_tma_aligned_col_major_sf=True)
    assert ex_sf.stride() == (1, (ex_x.shape[0] + 3) // 4 * 4)
    slots = ex_handle.recv_src_metadata[:, 2:]
    valid = slots[slots >= 0].long()
    out.update(ex_meta=ex_handle.recv_src_metadata, ex_psum=ex_handle.psum_num_recv_tokens_per_expert,
               ex_x=ex_x.view(torch.uint8)[valid], ex_sf=ex_sf[valid], ex_w=ex_w[valid])
    (cz_x, _), _, cz_w, _, _ = buffer.dispatch(fp8, handle=ex_handle, topk_weights=w, do_expand=True,
                                               do_zero_padding=True)
    out.update(cz_x=cz_x.view(torch.uint8), cz_w=cz_w)
    z = (torch.arange(ex_x.shape[0] * H, device=device) % 33 - 16).view(-1, H).to(torch.bfloat16) / 8
    ex_combined, ex_combined_w, _ = buffer.combine(z, ex_handle, topk_weights=ex_w, bias=bias)
    out.update(ex_combined=ex_combined, ex_combined_w=ex_combined_w)

    ns_x, ns_idx, _, ns_handle, _ = buffer.dispatch(x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=M,
                                                    do_cpu_sync=False)
    n = int(ns_handle.psum_num_recv_tokens_per_scaleup_rank[-1])
    out.update(ns_rows=torch.tensor(ns_x.shape[0]), ns_x=ns_x[:n], ns_idx=ns_idx, ns_meta=ns_handle.recv_src_metadata)
    ns_y = torch.zeros(ns_x.shape[0], H, dtype=torch.bfloat16, device=device)
    ns_y[:n] = y
    out.update(ns_combined=buffer.combine(ns_y, ns_handle)[0])
    if device != "cpu":
        torch.cuda.current_stream().synchronize()
    return {k: v.cpu() for k, v in out.items()}


def run(groups, cuda):
    def body(rank, group):
        buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, explicitly_destroy=True)
        try:
            if not cuda:
                return scenario(rank, buffer, "cpu")
            torch.cuda.set_device(devices()[rank])
            # NOTE: ranks that share a GPU must not share its legacy default stream (tests/gpu/test_buffer_cuda.py).
            with torch.cuda.stream(torch.cuda.Stream()):
                return scenario(rank, buffer, f"cuda:{devices()[rank]}")
        finally:
            buffer.destroy()

    return epx.run_host_ranks(groups, body)


def test_cuda_matches_host():
    host = run(epx.host_groups(R, timeout_ms=15_000), cuda=False)
    cuda = run(epx.cuda_groups(devices(), timeout_ms=15_000), cuda=True)
    for rank in range(R):
        assert host[rank].keys() == cuda[rank].keys()
        for name, want in host[rank].items():
            got = cuda[rank][name]
            assert got.shape == want.shape and torch.equal(got, want), f"rank {rank}: {name} differs"

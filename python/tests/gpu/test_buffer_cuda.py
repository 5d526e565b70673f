"""epx.Buffer on the CUDA backend from torch, checked against the host backend on the same inputs.

One process, one thread per rank (epx.cuda_groups); with one GPU both ranks share it. Routing: each rank draws T tokens; each token picks K
distinct experts uniformly at random and about one in five has one -1 entry. Outputs are poisoned by
construction: epx allocates them from torch (uninitialized memory) and every element is compared.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import epx  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not epx.built_with_cuda(),
    reason="needs a GPU, torch with CUDA and an epx build with the CUDA backend")

NUM_RANKS = 2


def devices():
    return [r % torch.cuda.device_count() for r in range(NUM_RANKS)]


def make_inputs(rank, T, H, K, E, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int64) if T else \
        torch.empty(0, K, dtype=torch.int64)
    if T:
        masked = torch.rand(T, generator=g) < 0.2
        idx[masked, torch.randint(0, K, (int(masked.sum()),), generator=g)] = -1
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def on_own_stream(rank, fn):
    """Runs fn on a non-blocking stream of this rank's device.

    NOTE: ranks that share a GPU must not share its legacy default stream: a rank's kernel that spins on
    its peer would block the peer's own copies and launches queued behind it on that stream.
    """
    torch.cuda.set_device(devices()[rank])
    with torch.cuda.stream(torch.cuda.Stream()):
        return fn()


def run_backend(groups, fn, cuda):
    def body(rank, group):
        return on_own_stream(rank, lambda: fn(rank, group)) if cuda else fn(rank, group)

    return epx.run_host_ranks(groups, body)


def both_backends(fn):
    host = run_backend(epx.host_groups(NUM_RANKS, timeout_ms=15_000), lambda r, g: fn(r, g, "cpu"), cuda=False)
    cuda = run_backend(epx.cuda_groups(devices(), timeout_ms=15_000), lambda r, g: fn(r, g, f"cuda:{devices()[r]}"), cuda=True)
    return host, cuda


@pytest.mark.parametrize("T", [0, 1, 257, 4096])
def test_normal_dispatch_combine_matches_host(T):
    H, K, E = 7168 if T == 4096 else 512, 8, 64
    inputs = [make_inputs(r, T, H, K, E, seed=T) for r in range(NUM_RANKS)]

    def fn(rank, group, device):
        buffer = epx.Buffer(group, num_normal_bytes=epx.normal_buffer_size_hint(H, NUM_RANKS, 24, 4096))
        x, idx, w = (t.to(device) for t in inputs[rank])
        recv = buffer.dispatch(x, idx, w, num_experts=E)
        assert isinstance(recv.recv_x, torch.Tensor) and recv.recv_x.device == x.device
        out = buffer.combine(recv.recv_x, recv.handle, recv.recv_topk_weights)
        cached = buffer.dispatch(x, handle=recv.handle)
        torch.cuda.current_stream().synchronize() if x.is_cuda else None
        return {k: v.cpu() for k, v in dict(recv_x=recv.recv_x, recv_topk_idx=recv.recv_topk_idx,
                                              recv_topk_weights=recv.recv_topk_weights, recv_src_idx=recv.recv_src_idx,
                                              out=out.x, out_w=out.topk_weights, cached=cached.recv_x).items()}, \
            recv.num_recv_tokens_per_expert

    host, cuda = both_backends(fn)
    for (h, hc), (c, cc) in zip(host, cuda):
        assert hc == cc
        for key in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src_idx", "cached", "out_w"):
            assert torch.equal(h[key], c[key]), key
        torch.testing.assert_close(h["out"].float(), c["out"].float(), rtol=2 ** -7, atol=1e-3)


def test_outputs_come_from_torch_allocator_and_record_stream_works():
    H, K, E, T = 1024, 4, 16, 128
    inputs = [make_inputs(r, T, H, K, E, seed=5) for r in range(NUM_RANKS)]

    def fn(rank, group):
        buffer = epx.Buffer(group)
        side = torch.cuda.Stream()
        x, idx, w = (t.cuda() for t in inputs[rank])
        before = torch.cuda.memory_allocated()
        recv = buffer.dispatch(x, idx, w, num_experts=E)
        assert torch.cuda.memory_allocated() > before  # the caching allocator holds the outputs
        recv.recv_x.record_stream(side)
        with torch.cuda.stream(side):
            recv2 = buffer.dispatch(x, handle=recv.handle, stream=side)
        side.synchronize()
        assert torch.equal(recv.recv_x, recv2.recv_x)
        return True

    assert all(run_backend(epx.cuda_groups(devices(), timeout_ms=15_000), fn, cuda=True))


def test_low_latency_matches_host():
    T, H, K, E, M = 96, 7168, 8, 64, 128
    inputs = [make_inputs(r, T, H, K, E, seed=9) for r in range(NUM_RANKS)]
    nbytes = epx.low_latency_buffer_size_hint(M, H, NUM_RANKS, E)

    def fn(rank, group, device):
        buffer = epx.Buffer(group, num_low_latency_bytes=nbytes)
        x, idx, w = (t.to(device) for t in inputs[rank])
        d = buffer.low_latency_dispatch(x, idx, M, E)
        counts = d.recv_count.cpu()
        rows = [d.recv_x[e, :int(counts[e])].cpu() for e in range(E // NUM_RANKS)]
        src = [d.recv_src_info[e, :int(counts[e])].cpu() for e in range(E // NUM_RANKS)]
        c = buffer.low_latency_combine(d.recv_x, idx, w, d.handle)
        return counts, rows, src, d.recv_layout_range.cpu(), c.x.cpu()

    host, cuda = both_backends(fn)
    for h, c in zip(host, cuda):
        assert torch.equal(h[0], c[0])
        for a, b in zip(h[1], c[1]):
            assert torch.equal(a, b)
        for a, b in zip(h[2], c[2]):
            assert torch.equal(a, b)
        assert torch.equal(h[3], c[3])
        torch.testing.assert_close(h[4].float(), c[4].float(), rtol=2 ** -7, atol=1e-3)


def test_cuda_errors_are_named():
    def fn(rank, group):
        buffer = epx.Buffer(group)
        x = torch.zeros(4, 128, dtype=torch.bfloat16, device="cuda")
        idx = torch.full((4, 2), 99, dtype=torch.int64, device="cuda")
        with pytest.raises(epx.InvalidArgumentError):
            buffer.dispatch(x.float(), idx, num_experts=8)
        with pytest.raises(ValueError, match="x"):  # CPU tensor on a CUDA group
            buffer.dispatch(x.cpu(), idx.cpu(), num_experts=8)
        return True

    assert all(run_backend(epx.cuda_groups(devices(), timeout_ms=15_000), fn, cuda=True))

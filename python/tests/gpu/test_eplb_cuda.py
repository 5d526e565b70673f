"""EPLB replica choice on the GPU from torch: epx.eplb.choose_replicas with a DeviceReplicaTable matches the host
choice for every mode, int32 and int64 CUDA tensors, in place or not, under a CUDA graph too."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import epx  # noqa: E402
from epx import eplb  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not epx.built_with_cuda(),
    reason="needs a GPU, torch with CUDA and an epx build with the CUDA backend")


def random_location(rng, layers, logical, physical, gpus):
    loc = eplb.ExpertLocation.trivial(layers, logical, physical, gpus)
    for layer in range(layers):
        p2l = np.concatenate([np.arange(logical), rng.integers(0, logical, physical - logical)])
        rng.shuffle(p2l)
        loc.set_layer(layer, p2l.astype(np.int32))
    return loc


@pytest.mark.parametrize("mode", ["static", "dynamic"])
@pytest.mark.parametrize("rank_invariant", [False, True])
def test_device_choice_matches_host(mode, rank_invariant):
    rng = np.random.default_rng(11)
    loc = random_location(rng, 2, 256, 288, 8)
    table = eplb.DeviceReplicaTable.upload(loc, 0)
    assert (table.num_layers, table.num_logical, table.num_physical, table.num_gpus) == (2, 256, 288, 8)
    ids = rng.integers(-1, 256, (500, 8))
    want = eplb.choose_replicas(loc, 1, ids, 3, mode=mode, seed=5, rank_invariant=rank_invariant, first_token=77)
    for dtype in (torch.int64, torch.int32):
        x = torch.from_numpy(ids).to(dtype).cuda()
        got = eplb.choose_replicas(table, 1, x, 3, mode=mode, seed=5, rank_invariant=rank_invariant, first_token=77)
        assert got.dtype == dtype and got.is_cuda
        np.testing.assert_array_equal(got.cpu().numpy(), want)
        eplb.choose_replicas(table, 1, x, 3, mode=mode, seed=5, rank_invariant=rank_invariant, first_token=77, out=x)
        np.testing.assert_array_equal(x.cpu().numpy(), want)


def test_device_choice_in_a_cuda_graph():
    rng = np.random.default_rng(3)
    loc = random_location(rng, 1, 64, 96, 4)
    table = eplb.DeviceReplicaTable.upload(loc, 0)
    ids = torch.zeros(128, 8, dtype=torch.int64, device="cuda")
    out = torch.empty_like(ids)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        eplb.choose_replicas(table, 0, ids, 2, mode="dynamic", out=out)
    for seed in range(3):
        host = np.random.default_rng(seed).integers(-1, 64, (128, 8))
        ids.copy_(torch.from_numpy(host))
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_array_equal(out.cpu().numpy(), eplb.choose_replicas(loc, 0, host, 2, mode="dynamic"))


def test_relocation_over_the_cuda_transport():
    """256 -> 288 physical experts on 2 ranks (sharing the GPU when there is one): torch CUDA weights whose bytes
    encode their logical expert land slot by slot; a staging smaller than a slot forces many passes."""
    ranks = 2
    devs = [r % torch.cuda.device_count() for r in range(ranks)]
    rng = np.random.default_rng(3)
    old = np.arange(256, dtype=np.int32)
    rng.shuffle(old)
    new = np.concatenate([np.arange(256), rng.integers(0, 256, 32)]).astype(np.int32)
    rng.shuffle(new)
    plan = eplb.plan_relocation(old, new, ranks, 1)
    cols = 96  # int32 words per slot: word i of expert e is e * 1000 + i

    def slots(p2l, rank, per_rank, device):
        ids = torch.from_numpy(p2l[rank * per_rank:(rank + 1) * per_rank].astype(np.int64))
        return (ids[:, None] * 1000 + torch.arange(cols)[None, :]).to(torch.int32).to(device)

    def body(rank, group):
        device = f"cuda:{devs[rank]}"
        torch.cuda.set_device(devs[rank])
        src = slots(old, rank, 128, device)
        dst = torch.full((144, cols), -7, dtype=torch.int32, device=device)
        assert eplb.choose_transport(group) == "cuda"  # ranks as threads: copy engines
        stats = eplb.relocate_weights(plan, group, [src], [dst], max_slots_per_round=5, staging_bytes=1000)
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), slots(new, rank, 144, "cpu"))
        with pytest.raises(epx.InvalidArgumentError, match="create_cuda_groups"):  # no communicator for nccl
            eplb.relocate_weights(plan, group, [src], [dst], transport="nccl")
        return stats.bytes_received

    received = epx.run_host_ranks(epx.cuda_groups(devs, timeout_ms=15_000), body)
    assert sum(received) == plan.num_transfers * cols * 4

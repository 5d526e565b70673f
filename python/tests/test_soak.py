"""Soak: random shapes through every host-backend path, each round checked against reference.py.

Per round: ranks 1-8, tokens 0-300 per rank (each rank its own count), hidden a multiple of 128 up to 1024,
top-k 1-9, experts a multiple of the ranks (>= top-k), about one top-k entry in six -1, int32 or int64 ids.
Paths: layout, normal dispatch (with and without the layout), combine with weights, cached dispatch,
worst-token dispatch, low-latency dispatch and combine (with and without the hook).
Bounded by time: EPX_SOAK_SECONDS (default 30 s in CI; run longer with e.g. EPX_SOAK_SECONDS=600).
"""

import os
import time

import numpy as np
import pytest

import epx

ml_dtypes = pytest.importorskip("ml_dtypes")
import reference  # noqa: E402

BF16 = ml_dtypes.bfloat16


def make_round(rng):
    R = int(rng.integers(1, 9))
    K = int(rng.integers(1, 10))
    per_rank_min = -(-K // R)  # experts >= top-k
    E = R * int(rng.integers(per_rank_min, max(per_rank_min, 8) + 1))
    H = 128 * int(rng.integers(1, 9))
    id_dtype = np.int32 if rng.random() < 0.5 else np.int64
    inputs = []
    for _ in range(R):
        T = int(rng.integers(0, 301)) if rng.random() < 0.9 else 0
        x = rng.integers(-64, 64, (T, H)).astype(np.float32).astype(BF16)  # small integers: sums are exact
        idx = np.array([rng.permutation(E)[:K] for _ in range(T)], np.int64).reshape(T, K)
        idx[rng.random((T, K)) < 1 / 6] = -1
        w = rng.integers(0, 8, (T, K)).astype(np.float32) / 8
        inputs.append((x, idx.astype(id_dtype), w))
    return R, K, E, H, inputs


def run_round(R, K, E, H, inputs, M=300):
    ll_bytes = epx.low_latency_buffer_size_hint(M, H, R, E)

    def body(rank, group):
        checks = 0
        buffer = epx.Buffer(group, num_low_latency_bytes=ll_bytes)
        x, idx, w = inputs[rank]
        dest = reference.destinations(idx.astype(np.int64), E, R)
        layout = buffer.get_dispatch_layout(idx, E)
        np.testing.assert_array_equal(layout.is_token_in_rank, dest)
        np.testing.assert_array_equal(layout.num_tokens_per_rank, dest.sum(0))
        rows, src, tidx, tw = reference.normal_dispatch([(a, b.astype(np.int64), c) for a, b, c in inputs], rank, E, R)
        for given in (layout, None):
            recv = buffer.dispatch(x, idx, w, num_experts=E, layout=given)
            assert recv.recv_x.shape == (len(rows), H)
            if rows:
                np.testing.assert_array_equal(recv.recv_x.view(np.uint16), np.array(rows).view(np.uint16))
                np.testing.assert_array_equal(recv.recv_topk_idx, np.array(tidx))
                np.testing.assert_array_equal(recv.recv_topk_weights, np.array(tw))
            np.testing.assert_array_equal(recv.recv_src_idx, src)
            checks += 4
        out = buffer.combine((recv.recv_x.astype(np.float32) * 2).astype(BF16), recv.handle, recv.recv_topk_weights)
        np.testing.assert_array_equal(  # exact fp32 sums (small integers), rounded once to bf16
            out.x.astype(np.float32),
            reference.normal_combine(x.astype(np.float32), dest, 2).astype(BF16).astype(np.float32))
        np.testing.assert_array_equal(out.topk_weights, np.where(idx >= 0, w, 0))
        cached = buffer.dispatch(x, handle=recv.handle)
        np.testing.assert_array_equal(cached.recv_x.view(np.uint16), recv.recv_x.view(np.uint16))
        worst = buffer.dispatch(x, idx, w, num_experts=E, num_worst_tokens=len(rows) + 5)
        np.testing.assert_array_equal(worst.recv_x[:len(rows)].view(np.uint16), recv.recv_x.view(np.uint16))
        assert (worst.recv_src_idx[len(rows):] == -1).all()
        checks += 5

        packed = reference.low_latency_rows([(a, b.astype(np.int64), c) for a, b, c in inputs], rank, E, R)
        for hook in (False, True):
            d = buffer.low_latency_dispatch(x, idx, M, E, return_recv_hook=hook)
            if hook:
                d.recv_hook()
            for e, want in enumerate(packed):
                n = int(d.recv_count[e])
                assert n == len(want)
                np.testing.assert_array_equal(d.recv_src_info[e, :n], [t for _, t in want])
                if n:
                    np.testing.assert_array_equal(d.recv_x[e, :n].view(np.uint16),
                                                  np.array([inputs[s][0][t] for s, t in want]).view(np.uint16))
            c = buffer.low_latency_combine(d.recv_x, idx, w, d.handle, return_recv_hook=hook)
            if hook:
                c.recv_hook()
            np.testing.assert_array_equal(
                c.x.astype(np.float32),  # equal as numbers: epx sums from +0, the reference may give -0
                reference.low_latency_combine(x.astype(np.float32), idx, w).astype(BF16).astype(np.float32))
            checks += 3
        return checks

    return sum(epx.run_host_ranks(epx.host_groups(R, timeout_ms=30_000), body))


def test_soak_random_rounds():
    seconds = float(os.environ.get("EPX_SOAK_SECONDS", "30"))
    seed = int(os.environ.get("EPX_SOAK_SEED", str(int(time.time()))))
    rng = np.random.default_rng(seed)
    deadline = time.monotonic() + seconds
    rounds = checks = 0
    while time.monotonic() < deadline or rounds == 0:
        R, K, E, H, inputs = make_round(rng)
        try:
            checks += run_round(R, K, E, H, inputs)
        except Exception as e:  # name the round so it can be replayed
            raise AssertionError(f"soak seed {seed} round {rounds}: R={R} K={K} E={E} H={H} "
                                 f"T={[i[0].shape[0] for i in inputs]}: {e}") from e
        rounds += 1
    print(f"soak: seed {seed}, {rounds} rounds, {checks} checks in {seconds:.0f} s")
    assert rounds >= 1

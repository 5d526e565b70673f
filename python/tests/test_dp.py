"""epx.dp on the host backend: rank arithmetic, padding-mode rules, gather plans, dp_gather / dp_scatter on
4 rank threads against numpy, batch metadata (reduce and the per-step sync) and bad input.

Routing of the collective tests: 4 ranks, pure DP (every rank its own DP rank and leader) with counts
[3, 0, 5, 2] (rank 1 idle), or attn_dp 2 x attn_tp 2 (leaders 0 and 2; ranks 1 and 3 hold copies)."""

import time

import numpy as np
import pytest

import epx
from epx import dp

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

HIDDEN = 6


def test_layout_from_the_header_example():
    layout = dp.ParallelLayout(8, attn_cp_size=2, attn_tp_size=4, moe_dp_size=2, moe_ep_size=4)
    K = dp.ParallelGroupKind
    assert layout.groups(K.attn_cp) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups(K.attn_tp) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups(K.moe_ep) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups(K.moe_dp) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.group_of(K.attn_tp, 6) == [4, 5, 6, 7]
    c = layout.coords(5)
    assert (c.attn_dp_rank, c.attn_cp_rank, c.attn_tp_rank) == (0, 1, 1)
    assert (c.moe_dp_rank, c.moe_ep_rank, c.moe_tp_rank) == (1, 1, 0)
    assert layout.sizes.moe_tp_size == 1 and layout.attn_dp_size == 1
    assert layout.attn_rank(0, 1, 1) == 5 and layout.dp_leader(0) == 0 and not layout.is_dp_leader(4)
    pure = dp.ParallelLayout.pure_dp(4)
    assert [pure.dp_leader(d) for d in range(4)] == [0, 1, 2, 3] and pure.attn_tp_size == 1
    with pytest.raises(epx.InvalidArgumentError):
        dp.ParallelLayout(8, attn_dp_size=3)
    with pytest.raises(ValueError):
        pure.coords(4)


def test_padding_mode_rules():
    M = dp.DpPaddingMode
    assert dp.choose_padding_mode([4, 4, 4, 0]) == M.MAX_LEN  # 2 * 12 >= 4 * 4
    assert dp.choose_padding_mode([7, 0, 0, 0]) == M.SUM_LEN  # 2 * 7 < 7 * 4
    assert dp.choose_padding_mode([7, 0, 0, 0], symmetric_a2a=True) == M.MAX_LEN
    assert dp.choose_padding_mode([7, 0, 0, 0], in_cuda_graph=True) == M.MAX_LEN
    assert dp.choose_padding_mode([4, 4], is_extend_in_batch=True) == M.SUM_LEN
    assert dp.choose_padding_mode(np.array([4], np.int32), is_extend_in_batch=True) == M.MAX_LEN  # one DP rank


def test_gather_plans():
    p = dp.plan_dp_gather([3, 0, 5, 2], "MAX_LEN", attn_tp_size=2)
    assert (p.mode, p.slot_len, p.buffer_len, p.offsets, p.num_tokens) == (
        dp.DpPaddingMode.MAX_LEN, 6, 24, [0, 6, 12, 18], [3, 0, 5, 2])
    s = dp.plan_dp_gather(np.array([3, 0, 5, 2]), dp.DpPaddingMode.SUM_LEN)
    assert (s.slot_len, s.buffer_len, s.offsets) == (0, 10, [0, 3, 3, 8])
    for bad in ([-1, 2], []):
        with pytest.raises(epx.InvalidArgumentError):
            dp.plan_dp_gather(bad, "SUM_LEN")
    with pytest.raises(ValueError):
        dp.plan_dp_gather([1, 2], "MIN_LEN")
    with pytest.raises(epx.InvalidArgumentError):
        dp.plan_dp_gather([1.5, 2], "SUM_LEN")


def local_rows(dp_rank, count, dtype, extra=2):
    """DP rank d's batch: `count` rows of distinct values, plus `extra` padding rows that must not be read."""
    rows = (np.arange(count * HIDDEN, dtype=np.float32).reshape(count, HIDDEN) + 100 * dp_rank + 0.5).astype(dtype)
    return np.concatenate([rows, np.full((extra, HIDDEN), 999, dtype)])


def expected_global(plan, dtype):
    out = np.zeros((plan.buffer_len, HIDDEN), dtype)
    for d, (n, off) in enumerate(zip(plan.num_tokens, plan.offsets)):
        out[off:off + n] = local_rows(d, n, dtype)[:n]
    return out


DTYPES = [np.float32] + ([ml_dtypes.bfloat16] if ml_dtypes else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["MAX_LEN", "SUM_LEN"])
def test_gather_scatter_pure_dp_four_ranks(dtype, mode):
    counts = [3, 0, 5, 2]
    layout = dp.ParallelLayout.pure_dp(4)
    plan = dp.plan_dp_gather(counts, mode)
    want = expected_global(plan, dtype)

    def body(rank, group):
        local = local_rows(rank, counts[rank], dtype)
        global_batch = dp.dp_gather(group, layout, plan, local)
        back = dp.dp_scatter(group, layout, plan, global_batch)
        poisoned = np.full((counts[rank] + 3, HIDDEN), 7, dtype)
        dp.dp_scatter(group, layout, plan, global_batch, out=poisoned)
        partial = global_batch * np.asarray(rank + 1, dtype)  # rank r holds (r + 1) x the batch
        summed = dp.dp_scatter(group, layout, plan, partial, kind="reduce_scatter")
        return global_batch, back, poisoned, summed

    results = epx.run_host_ranks(epx.host_groups(4), body)
    for rank, (global_batch, back, poisoned, summed) in enumerate(results):
        assert global_batch.dtype == dtype and global_batch.shape == (plan.buffer_len, HIDDEN)
        np.testing.assert_array_equal(global_batch, want)
        mine = local_rows(rank, counts[rank], dtype)[:counts[rank]]
        np.testing.assert_array_equal(back, mine)
        np.testing.assert_array_equal(poisoned[:counts[rank]], mine)
        assert (poisoned[counts[rank]:] == 0).all()  # rows past the count are zeroed
        off = plan.offsets[rank]
        partials = [(want[off:off + counts[rank]] * np.asarray(r + 1, dtype)).astype(np.float32) for r in range(4)]
        np.testing.assert_array_equal(summed, sum(partials).astype(dtype))  # fp32 sum in rank order, one rounding


def test_gather_with_attention_tp_takes_the_leaders_rows():
    layout = dp.ParallelLayout(4, attn_dp_size=2)  # attn_tp 2: DP rank 0 = ranks {0, 1}, DP rank 1 = {2, 3}
    counts = [2, 3]
    plan = dp.plan_dp_gather(counts, "MAX_LEN", attn_tp_size=layout.attn_tp_size)

    def body(rank, group):
        d = layout.coords(rank).attn_dp_rank
        local = local_rows(d, counts[d], np.float32)
        if not layout.is_dp_leader(rank):
            local = local + 0  # the same batch as the leader's, another buffer
        return dp.dp_gather(group, layout, plan, local)

    for out in epx.run_host_ranks(epx.host_groups(4), body):
        np.testing.assert_array_equal(out, expected_global(plan, np.float32))


def test_gather_partial_sums_reduces_over_attention_tp():
    layout = dp.ParallelLayout(4, attn_dp_size=2)  # DP rank 0 = ranks {0, 1}, DP rank 1 = {2, 3}
    counts = [2, 3]
    plan = dp.plan_dp_gather(counts, "SUM_LEN", attn_tp_size=layout.attn_tp_size)

    def partial(rank):  # small integers: the fp32 sums are exact
        d = layout.coords(rank).attn_dp_rank
        return (np.arange(counts[d] * 4, dtype=np.float32).reshape(counts[d], 4) + 100 * rank)

    def body(rank, group):
        return dp.dp_gather(group, layout, plan, partial(rank), partial_sums=True)

    want = np.concatenate([partial(0) + partial(1), partial(2) + partial(3)])
    for out in epx.run_host_ranks(epx.host_groups(4), body):
        np.testing.assert_array_equal(out, want)

    # MAX_LEN: the same sums in padded slots of max(counts) rows, zero padding.
    max_plan = dp.plan_dp_gather(counts, "MAX_LEN", attn_tp_size=layout.attn_tp_size)

    def max_len(rank, group):
        return dp.dp_gather(group, layout, max_plan, partial(rank), partial_sums=True)

    want_max = np.zeros((max_plan.buffer_len, 4), dtype=np.float32)
    for d, rows in enumerate([partial(0) + partial(1), partial(2) + partial(3)]):
        want_max[max_plan.offsets[d]:max_plan.offsets[d] + counts[d]] = rows
    for out in epx.run_host_ranks(epx.host_groups(4), max_len):
        np.testing.assert_array_equal(out, want_max)


def test_reduce_batch_metadata():
    F = dp.ForwardMode
    records = [dp.BatchMetadata(num_tokens=5, forward_mode=F.DECODE, num_tokens_for_logprob=2, attention_pairs=7),
               dp.BatchMetadata.idle(),
               dp.BatchMetadata(num_tokens=3, forward_mode=F.DECODE, can_run_decode_graph=False,
                                prefill_graph_max_prefix_len=9)]
    g = dp.reduce_batch_metadata(records)
    assert g.num_tokens == [5, 0, 3] and g.num_tokens_for_logprob == [2, 0, 0] and g.attention_pairs == [7, 0, 0]
    assert g.forward_mode == F.DECODE and g.can_run_tbo and g.any_tokens
    # The idle rank's fallback record vetoes the prefill graph (SGLang), not the decode graph.
    assert not g.can_run_decode_graph and not g.can_run_prefill_graph and g.prefill_graph_max_prefix_len == 9
    assert not dp.BatchMetadata.idle().can_run_prefill_graph and dp.BatchMetadata.idle().can_run_decode_graph
    pre = dp.BatchMetadata.prebuilt()
    assert pre.forward_mode == F.PREBUILT and pre.num_tokens == 0
    records[2].forward_mode = F.EXTEND
    g = dp.reduce_batch_metadata(records)
    assert g.forward_mode is None and not g.can_run_tbo  # non-idle ranks disagree
    g = dp.reduce_batch_metadata([dp.BatchMetadata.idle()] * 2)
    assert g.forward_mode == F.IDLE and not g.any_tokens and not g.can_run_tbo
    assert dp.BATCH_METADATA_FIELDS == 11
    with pytest.raises(epx.InvalidArgumentError):
        dp.reduce_batch_metadata([])


def test_metadata_sync_four_ranks():
    layout = dp.ParallelLayout.pure_dp(4)
    counts = [4, 0, 1, 6]

    def body(rank, group):
        sync = dp.BatchMetadataSync(group, layout)
        local = None if counts[rank] == 0 else dp.BatchMetadata(num_tokens=counts[rank],
                                                                forward_mode=dp.ForwardMode.DECODE)
        return [sync.sync(local) for _ in range(2)]

    results = epx.run_host_ranks(epx.host_groups(4), body)
    for rank, steps in enumerate(results):
        for r in steps:
            assert r.global_info.num_tokens == counts and r.global_info.forward_mode == dp.ForwardMode.DECODE
            assert r.runs_batch and r.run_idle_batch == (counts[rank] == 0)
            assert r.step_wait_s >= 0


def test_metadata_sync_rejects_a_bad_record_before_communicating():
    group = epx.host_groups(1)[0]
    sync = dp.BatchMetadataSync(group, dp.ParallelLayout.pure_dp(1))
    with pytest.raises(epx.InvalidArgumentError):
        sync.sync(dp.BatchMetadata(num_tokens=-1, forward_mode=dp.ForwardMode.DECODE))
    with pytest.raises(epx.InvalidArgumentError):
        dp.BatchMetadataSync(group, dp.ParallelLayout.pure_dp(2))  # layout of 2 ranks, group of 1


def test_metadata_sync_with_inactive_ranks():
    # 4 ranks, pure DP; rank 3 is dead and never calls. The others list it (as a list, a tuple, numpy ints):
    # DP rank 3 counts as the fallback record (0 tokens, IDLE, prefill-graph vote 0) and nobody waits for it
    # (the group's timeout is 60 s; each step must take well under that).
    layout = dp.ParallelLayout.pure_dp(4)
    lists = {0: [3], 1: (3,), 2: np.array([3], np.int64)}
    extend = dict(forward_mode=dp.ForwardMode.EXTEND, is_extend_in_batch=True, can_run_decode_graph=False)

    def body(rank, group):
        if rank == 3:
            return None
        sync = dp.BatchMetadataSync(group, layout)
        out = []
        for _ in range(2):
            start = time.monotonic()
            local = None if rank == 1 else dp.BatchMetadata(num_tokens=5 + rank, **extend)
            out.append((sync.sync(local, lists[rank]), time.monotonic() - start))
        out.append((dp.sync_batch_metadata(sync, None, [3]), 0.0))
        return out

    results = epx.run_host_ranks(epx.host_groups(4, timeout_ms=60_000), body)
    for rank in range(3):
        for r, seconds in results[rank]:
            assert seconds < 30
            g = r.global_info
            if g.any_tokens:
                assert g.num_tokens == [5, 0, 7, 0] and g.forward_mode == dp.ForwardMode.EXTEND
                assert not g.can_run_prefill_graph and g.is_extend_in_batch and not g.can_run_decode_graph
                assert r.run_idle_batch == (rank == 1) and r.runs_batch
            else:  # the last step: every live rank idle
                assert g.num_tokens == [0, 0, 0, 0] and g.forward_mode == dp.ForwardMode.IDLE
                assert not r.runs_batch
    reference = dp.reduce_batch_metadata([dp.BatchMetadata(num_tokens=5, **extend), dp.BatchMetadata.idle(),
                                          dp.BatchMetadata(num_tokens=7, **extend), dp.BatchMetadata.idle()])
    assert results[0][0][0].global_info.can_run_tbo == reference.can_run_tbo
    assert results[0][0][0].global_info.num_tokens == reference.num_tokens


def test_metadata_sync_wrong_typed_argument_still_joins():
    # Rank 1 passes a str as its record, then a float in its inactive list: it raises TypeError naming the
    # argument after taking part with an error flag, so ranks 0, 2 and 3 raise PeerFailureError at once (not
    # after the 60 s timeout) and the next step pairs up on every rank.
    layout = dp.ParallelLayout.pure_dp(4)
    decode = dp.BatchMetadata(num_tokens=2, forward_mode=dp.ForwardMode.DECODE)

    def body(rank, group):
        sync = dp.BatchMetadataSync(group, layout)
        seen = []
        for bad_local, bad_list in (("decode", None), (decode, [3.0])):
            start = time.monotonic()
            try:
                if rank == 1:
                    sync.sync(bad_local, bad_list)
                else:
                    sync.sync(decode)
            except TypeError as e:
                seen.append(("type", str(e)))
            except epx.PeerFailureError as e:
                seen.append(("peer", str(e)))
            assert time.monotonic() - start < 30
        seen.append(sync.sync(decode).global_info.num_tokens)
        return seen

    results = epx.run_host_ranks(epx.host_groups(4, timeout_ms=60_000), body)
    assert results[1][0] == ("type", "local: expected an epx.dp.BatchMetadata or None, got str")
    assert results[1][1] == ("type", "inactive_ranks[0]: expected an int, got float")
    for rank in (0, 2, 3):
        assert results[rank][0][0] == "peer" and "local: expected an epx.dp.BatchMetadata" in results[rank][0][1]
        assert results[rank][1][0] == "peer" and "inactive_ranks[0]" in results[rank][1][1]
    for rank in range(4):
        assert results[rank][2] == [2, 2, 2, 2]


def test_metadata_sync_inactive_ranks_checked():
    group = epx.host_groups(1)[0]
    sync = dp.BatchMetadataSync(group, dp.ParallelLayout.pure_dp(1))
    with pytest.raises(epx.InvalidArgumentError, match=r"inactive rank 1 is not in \[0, 1\)"):
        sync.sync(None, [1])
    with pytest.raises(epx.InvalidArgumentError, match="rank 0 names itself inactive"):
        sync.sync(None, [0])
    with pytest.raises(TypeError, match="inactive_ranks: expected None or a sequence of ints, got str"):
        sync.sync(None, "3")
    assert sync.sync(None, []).global_info.num_tokens == [0]


def test_gather_rejects_bad_tensors():
    group = epx.host_groups(1)[0]
    layout = dp.ParallelLayout.pure_dp(1)
    plan = dp.plan_dp_gather([2], "SUM_LEN")
    with pytest.raises(epx.InvalidArgumentError):
        dp.dp_gather(group, layout, plan, np.zeros((2, HIDDEN), np.uint8))  # not bf16/fp32/int32/int64
    with pytest.raises(epx.InvalidArgumentError):
        dp.dp_gather(group, layout, plan, np.zeros((2, HIDDEN), np.float32), out=np.zeros((1, HIDDEN), np.float32))
    with pytest.raises(epx.InvalidArgumentError):
        dp.dp_scatter(group, layout, plan, np.zeros((2, HIDDEN), np.float32), kind="gather")


def test_gather_scatter_bad_argument_on_one_rank_fails_that_call_everywhere():
    # One rank passes an argument that does not convert (a str as local, a float64 local, a list as the plan, a
    # str in cp_shard_counts): that rank raises the conversion error after taking part in the call with an error
    # flag, the other three raise PeerFailureError naming it in the same call (not after the 60 s timeout), and
    # the next gather and reduce-scatter are right on every rank. Routing: 4 ranks, pure DP, counts [3, 0, 5, 2].
    counts = [3, 0, 5, 2]
    layout = dp.ParallelLayout.pure_dp(4)
    plan = dp.plan_dp_gather(counts, "SUM_LEN")
    want = expected_global(plan, np.float32)
    cases = [  # (bad rank, gather?, keyword arguments of the bad call, error type, message)
        (2, True, {"local": "rows"}, epx.InvalidArgumentError, "local: expected an array"),
        (3, True, {"local": np.zeros((2, HIDDEN), np.float64)}, epx.InvalidArgumentError,
         "unsupported element type (DLPack code 2, 64 bits)"),
        (0, True, {"plan": [3, 0, 5, 2]}, TypeError, "plan: expected an epx.dp.DpGatherPlan, got list"),
        (1, False, {"cp_shard_counts": ["a"]}, TypeError, "cp_shard_counts[0]: expected an int, got str"),
    ]

    def body(rank, group):
        seen = []
        for bad_rank, gather, bad_args, _, _ in cases:
            args = {"plan": plan}
            if gather:
                args["local"] = local_rows(rank, counts[rank], np.float32)
            else:
                args["global_buffer"] = want * np.float32(rank + 1)
                args["kind"] = "reduce_scatter"
            if rank == bad_rank:
                args.update(bad_args)
            start = time.monotonic()
            try:
                if gather:
                    dp.dp_gather(group, layout, **args)
                else:
                    dp.dp_scatter(group, layout, **args)
                seen.append(("ok", ""))
            except epx.PeerFailureError as e:
                seen.append(("peer", str(e)))
            except (TypeError, ValueError) as e:
                seen.append((type(e), str(e)))
            assert time.monotonic() - start < 30
            # The next calls pair up: the global batch, and the sum of (r + 1) x this rank's rows over r.
            global_batch = dp.dp_gather(group, layout, plan, local_rows(rank, counts[rank], np.float32))
            summed = dp.dp_scatter(group, layout, plan, global_batch * np.float32(rank + 1), kind="reduce_scatter")
            seen.append((global_batch, summed))
        return seen

    results = epx.run_host_ranks(epx.host_groups(4, timeout_ms=60_000), body)
    for rank in range(4):
        for i, (bad_rank, _, _, error, message) in enumerate(cases):
            kind, what = results[rank][2 * i]
            if rank == bad_rank:
                assert kind is error and message in what, (rank, kind, what)
            else:
                assert kind == "peer" and f"failed on ranks [{bad_rank}]" in what and message in what, (rank, what)
            global_batch, summed = results[rank][2 * i + 1]
            np.testing.assert_array_equal(global_batch, want)
            off = plan.offsets[rank]
            partials = [want[off:off + counts[rank]] * np.float32(r + 1) for r in range(4)]
            np.testing.assert_array_equal(summed, sum(partials))  # fp32 sum in rank order

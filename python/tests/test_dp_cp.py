"""Attention context parallelism (issue 16): SGLang's zigzag split (python/sglang/srt/layers/cp/zigzag.py) and
dp_gather / dp_scatter with CP shards on host groups.

Routing: 4 ranks = attn_dp 2 x attn_cp 2 (attn_tp 1); ranks 0, 1 are DP rank 0's CP ranks, 2, 3 DP rank 1's.
DP rank 0 runs a split extend batch [10, 5] (shards [8, 7]), DP rank 1 an unsplit decode batch of 3 tokens.
"""
import numpy as np
import pytest

import epx
from epx import dp


def test_zigzag_split_hand_worked():
    split = dp.plan_zigzag_split([10, 5], 2)
    assert split.block_lens == [3, 3, 2, 2, 2, 1, 1, 1]  # L = q * 2cp + r: the first r blocks get q + 1
    assert split.num_tokens == [8, 7] and split.max_rank_len == 8 and split.padded_rank_len == 8
    assert dp.zigzag_local_rows(split, 0) == [0, 1, 2, 10, 11, 8, 9, 14]  # early blocks, then late blocks
    assert dp.zigzag_local_rows(split, 1) == [3, 4, 5, 12, 6, 7, 13]
    assert dp.zigzag_gathered_rows(split) == [0, 1, 2, 8, 9, 10, 12, 13, 5, 6, 3, 4, 11, 14, 7]
    padded = dp.plan_zigzag_split(np.array([6]), 2, num_tokens=9)
    assert padded.seq_lens == [9] and padded.num_tokens == [5, 4] and padded.padded_rank_len == 8
    assert dp.can_zigzag_split([8], 2, "EXTEND") and dp.can_zigzag_split([4, 9], 2, dp.ForwardMode.MIXED)
    assert not dp.can_zigzag_split([8, 3], 2, "EXTEND")
    assert not dp.can_zigzag_split([8], 2, "DECODE")
    assert not dp.can_zigzag_split([8], 1, "EXTEND")
    with pytest.raises(epx.InvalidArgumentError, match="num_tokens must be -1"):
        dp.plan_zigzag_split([6], 2, num_tokens=5)


def _value(d, rows, hidden=3):
    rows = np.asarray(rows, dtype=np.float32)
    return 1 + 1000 * d + 10 * rows[:, None] + np.arange(hidden, dtype=np.float32)[None, :]


@pytest.mark.parametrize("mode", ["SUM_LEN", "MAX_LEN"])
def test_gather_and_scatter_with_cp_shards(mode):
    layout = dp.ParallelLayout(4, attn_dp_size=2, attn_cp_size=2)
    split = dp.plan_zigzag_split([10, 5], 2)
    counts = [15, 3]
    plan = dp.plan_dp_gather(counts, mode)

    def body(rank, group):
        c = layout.coords(rank)
        if c.attn_dp_rank == 0:
            shards = split.num_tokens
            local = np.full((split.padded_rank_len, 3), -7.0, np.float32)  # padded shard, padding never read
            rows = dp.zigzag_local_rows(split, c.attn_cp_rank)
            local[:len(rows)] = _value(0, rows)
        else:
            shards = None
            local = _value(1, range(3)) if c.attn_cp_rank == 0 else np.full((3, 3), -7.0, np.float32)
        out = dp.dp_gather(group, layout, plan, local, cp_shard_counts=shards)
        back = dp.dp_scatter(group, layout, plan, out, cp_shard_counts=shards)
        return out, back, local

    want = np.zeros((plan.buffer_len, 3), np.float32)
    at = np.asarray(dp.zigzag_gathered_rows(split))
    want[plan.offsets[0] + at] = _value(0, range(15))
    want[plan.offsets[1]:plan.offsets[1] + 3] = _value(1, range(3))
    for rank, (out, back, local) in enumerate(epx.run_host_ranks(epx.host_groups(4), body)):
        np.testing.assert_array_equal(out, want)
        c = layout.coords(rank)
        if c.attn_dp_rank == 0:
            n = split.num_tokens[c.attn_cp_rank]
            assert back.shape == (n, 3)
            np.testing.assert_array_equal(back, local[:n])
        else:
            np.testing.assert_array_equal(back, _value(1, range(3)))  # both CP ranks get the unsplit rows


def test_cp_shards_checked():
    layout = dp.ParallelLayout(2, attn_cp_size=2)
    plan = dp.plan_dp_gather([5], "SUM_LEN")
    group = epx.host_groups(2)[0]
    with pytest.raises(epx.InvalidArgumentError, match="must sum to plan.num_tokens"):
        dp.dp_gather(group, layout, plan, np.zeros((5, 3), np.float32), cp_shard_counts=[3, 3])
    with pytest.raises(epx.InvalidArgumentError, match="kReduceScatter takes no cp_shard_counts"):
        dp.dp_scatter(group, layout, plan, np.zeros((5, 3), np.float32), kind="reduce_scatter", cp_shard_counts=[3, 2])

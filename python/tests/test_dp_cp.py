"""Attention context parallelism (issue 16): SGLang's zigzag split (python/sglang/srt/layers/cp/zigzag.py), its
interleave split (cp/interleave.py) and dp_gather / dp_scatter with CP shards on host groups.

Routing: 4 ranks = attn_dp 2 x attn_cp 2 (attn_tp 1); ranks 0, 1 are DP rank 0's CP ranks, 2, 3 DP rank 1's.
Zigzag: DP rank 0 runs a split extend batch [10, 5] (shards [8, 7]), DP rank 1 an unsplit decode batch of 3 tokens.
Interleave: DP rank 0 runs [7, 4] plus one padding row (shards [6, 6]), DP rank 1 [3] (shards [2, 1]).
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


def test_interleave_split_hand_worked():
    # cp 3, sequences [5, 3], 10 rows (8, 9 padding): rank c takes rows c, c + 3, ...; rank-major
    # [0 3 6 9 | 1 4 7 | 2 5 8], so row i sits at start[i % 3] + i // 3 with starts [0, 4, 7].
    split = dp.plan_interleave_split([5, 3], 3, num_tokens=10)
    assert split.num_tokens == [4, 3, 3] and split.num_real_tokens == [3, 3, 2]
    assert split.num_batch_tokens == 10 and split.num_real_batch_tokens == 8 and split.seq_lens == [5, 3]
    assert split.max_rank_len == 4 and split.padded_rank_len == 6  # 4 rounded up to cp
    assert [dp.interleave_local_rows(split, c) for c in range(3)] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert dp.interleave_gathered_rows(split) == [0, 4, 7, 1, 5, 8, 2, 6, 9, 3]
    assert dp.interleave_gathered_rows(split, real_rows_only=True) == [0, 3, 6, 1, 4, 7, 2, 5]
    # Prefixes [4, 0]: rank 0's real rows 0, 3, 6 are sequence 0, 0, 1 with KV lengths 5, 8, 2.
    q = dp.interleave_local_queries(split, 0, prefix_lens=np.array([4, 0]))
    assert q.seq_idx == [0, 0, 1] and q.kv_lens == [5, 8, 2]
    assert dp.interleave_local_queries(split, 2).kv_lens == [3, 1]

    assert dp.can_interleave_split(2, "EXTEND", 2) and dp.can_interleave_split(4, dp.ForwardMode.MIXED, 9)
    assert not dp.can_interleave_split(4, "EXTEND", 3)
    assert not dp.can_interleave_split(2, "DECODE", 8)
    assert not dp.can_interleave_split(1, "EXTEND", 8)
    # A sequence shorter than cp stops zigzag, not interleave.
    assert dp.can_cp_split("interleave", [8, 1], 2, "EXTEND")
    assert not dp.can_cp_split(dp.CpStrategy.zigzag, [8, 1], 2, "EXTEND")
    assert dp.parse_cp_strategy("interleave") == dp.CpStrategy.interleave
    zigzag = dp.plan_cp_split("zigzag", [10, 5], 2)  # by name, the zigzag split of test_zigzag_split_hand_worked
    assert isinstance(zigzag, dp.ZigzagSplit) and dp.cp_local_rows(zigzag, 1) == [3, 4, 5, 12, 6, 7, 13]
    assert dp.cp_gathered_rows(zigzag) == dp.zigzag_gathered_rows(zigzag)
    with pytest.raises(epx.InvalidArgumentError, match="cp_strategy must be"):
        dp.parse_cp_strategy("round-robin-split")
    with pytest.raises(epx.InvalidArgumentError, match="strategy: 'ring' is not one of zigzag, interleave"):
        dp.can_cp_split("ring", [8], 2, "EXTEND")
    with pytest.raises(epx.InvalidArgumentError, match="num_tokens must be -1"):
        dp.plan_interleave_split([6], 2, num_tokens=5)
    with pytest.raises(epx.InvalidArgumentError, match="cp_rank must be in"):
        dp.interleave_local_rows(split, 3)
    with pytest.raises(epx.InvalidArgumentError, match="prefix_lens must be empty or hold num_seqs = 2"):
        dp.interleave_local_queries(split, 0, [1])


def test_interleave_split_matches_brute_force():
    rng = np.random.default_rng(7)
    for _ in range(100):
        cp = int(rng.integers(1, 6))
        lens = [int(x) for x in rng.integers(0, 25, size=int(rng.integers(1, 5)))]
        real = sum(lens)
        total = real + int(rng.integers(0, 6))
        split = dp.plan_cp_split("interleave", lens, cp, total)
        per_rank = [[r for r in range(total) if r % cp == c] for c in range(cp)]
        assert [dp.cp_local_rows(split, c) for c in range(cp)] == per_rank
        rank_major = [r for rows in per_rank for r in rows]
        assert dp.cp_gathered_rows(split) == sorted(range(total), key=rank_major.__getitem__)
        real_major = [r for rows in per_rank for r in rows if r < real]
        assert dp.interleave_gathered_rows(split, True) == sorted(range(real), key=real_major.__getitem__)
        assert split.padded_rank_len == -(-max(len(r) for r in per_rank) // cp) * cp


@pytest.mark.parametrize("mode", ["SUM_LEN", "MAX_LEN"])
def test_gather_and_scatter_with_interleave_shards(mode):
    layout = dp.ParallelLayout(4, attn_dp_size=2, attn_cp_size=2)
    splits = [dp.plan_cp_split("interleave", [7, 4], 2, num_tokens=12), dp.plan_cp_split("interleave", [3], 2)]
    assert splits[0].num_tokens == [6, 6] and splits[1].num_tokens == [2, 1]
    plan = dp.plan_dp_gather([12, 3], mode)

    def body(rank, group):
        c = layout.coords(rank)
        split = splits[c.attn_dp_rank]
        local = np.full((split.padded_rank_len, 3), -7.0, np.float32)  # padded shard, padding never read
        rows = dp.cp_local_rows(split, c.attn_cp_rank)
        local[:len(rows)] = _value(c.attn_dp_rank, rows)
        out = dp.dp_gather(group, layout, plan, local, cp_shard_counts=split.num_tokens)
        back = dp.dp_scatter(group, layout, plan, out, cp_shard_counts=split.num_tokens)
        return out, back, local

    want = np.zeros((plan.buffer_len, 3), np.float32)
    for d, split in enumerate(splits):
        at = np.asarray(dp.cp_gathered_rows(split))
        want[plan.offsets[d] + at] = _value(d, range(split.num_batch_tokens))
    for rank, (out, back, local) in enumerate(epx.run_host_ranks(epx.host_groups(4), body)):
        np.testing.assert_array_equal(out, want)
        for d, split in enumerate(splits):  # SGLang's restore: the slot's rows taken at restore_indices, in order
            slot = out[plan.offsets[d]:plan.offsets[d] + split.num_batch_tokens]
            np.testing.assert_array_equal(slot[dp.cp_gathered_rows(split)], _value(d, range(split.num_batch_tokens)))
        c = layout.coords(rank)
        n = splits[c.attn_dp_rank].num_tokens[c.attn_cp_rank]
        assert back.shape == (n, 3)
        np.testing.assert_array_equal(back, local[:n])

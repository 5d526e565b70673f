"""epx.tbo: split rules and children (the hand-worked cases of tests/unit/tbo_split_test.cpp), and the stage
executor running Python callables in the interleaved order (tests/unit/tbo_executor_test.cpp)."""

import threading

import numpy as np
import pytest

import epx
from epx import tbo


@pytest.mark.parametrize("lens,threshold,seq,token,two_chunk", [
    ([4096, 4096, 100], 0.48, 1, 4096, False),
    ([10, 20, 30, 500, 40], 0.48, 3, 300, True),
    ([1, 1, 1, 1], 0.48, 2, 2, False),
    ([7, 0, 0, 7], 0.48, 3, 7, False),
    ([48, 52], 0.48, 1, 48, False),
    ([47, 53], 0.48, 1, 50, True),
    ([53, 47], 0.48, 0, 50, True),
    ([49, 51], 0.5, 1, 50, True),
    ([1, 1000], 0.0, 1, 1, False),
    ([3], 0.48, 0, 1, True),
    ([1], 0.48, 0, 0, False),
    ([1, 1, 1], 0.48, 2, 2, False),
    ([4, 1, 4], 0.48, 1, 4, True),
])
def test_extend_split(lens, threshold, seq, token, two_chunk):
    assert tbo.compute_tbo_split_extend(lens, threshold) == tbo.TboSplit(seq, token, two_chunk)
    assert tbo.compute_tbo_split_extend(np.array(lens, np.int32), threshold) == tbo.TboSplit(seq, token, two_chunk)


def test_decode_and_by_mode():
    assert tbo.compute_tbo_split_decode(10) == tbo.TboSplit(5, 5, False)
    assert tbo.compute_tbo_split_decode(18, 2) == tbo.TboSplit(4, 8, False)
    assert tbo.compute_tbo_split_decode(4, 4) == tbo.TboSplit(0, 0, False)
    s = tbo.compute_tbo_split("EXTEND", 600, [10, 20, 30, 500, 40])
    assert (s.split_token_index, s.two_chunk) == (300, True)
    assert tbo.compute_tbo_split(tbo.ForwardMode.TARGET_VERIFY, 12, tokens_per_seq=4) == tbo.TboSplit(1, 4, False)
    assert tbo.compute_tbo_split("IDLE", 0) == tbo.TboSplit(0, 0, False)
    # MIXED (chunked prefill + decode) splits by the extend rule, as SGLang's is_extend() check does.
    assert tbo.compute_tbo_split("MIXED", 600, [10, 20, 30, 500, 40]) == s
    assert tbo.compute_tbo_split("PREBUILT", 0) == tbo.TboSplit(0, 0, False)
    assert tbo.compute_tbo_split("DRAFT_EXTEND", 5, [5]) is None
    assert tbo.DEFAULT_THRESHOLD == 0.48


def test_children_hand_worked():
    parent = tbo.TboSeqFields([10, 20, 30, 500, 40], [0, 5, 0, 100, 7], [10, 25, 30, 600, 47])
    c = tbo.split_tbo_children(parent, tbo.TboSplit(3, 300, True))
    assert c.a.extend_lens == [10, 20, 30, 240] and c.a.prefix_lens == [0, 5, 0, 100]
    assert c.a.seq_lens == [10, 25, 30, 340]
    assert c.b.extend_lens == [260, 40] and c.b.prefix_lens == [340, 7] and c.b.seq_lens == [600, 47]
    assert (c.num_tokens_a, c.num_tokens_b, c.seq_begin_b, c.a.num_seqs) == (300, 300, 3, 4)
    d = tbo.split_tbo_children(parent, tbo.TboSplit(2, 30, False))
    assert d.a.extend_lens == [10, 20] and d.b.extend_lens == [30, 500, 40] and d.b.prefix_lens == [0, 100, 7]
    dec = tbo.TboSeqFields([1, 1, 1], [9, 19, 29], [10, 20, 30])
    e = tbo.split_tbo_children(dec, tbo.compute_tbo_split_decode(3))
    assert e.a.seq_lens == [10] and e.b.seq_lens == [20, 30]


@pytest.mark.parametrize("call", [
    lambda: tbo.compute_tbo_split_extend([5, -1]),
    lambda: tbo.compute_tbo_split_extend([]),
    lambda: tbo.compute_tbo_split_extend([5], 0.51),
    lambda: tbo.compute_tbo_split_extend([5.0]),
    lambda: tbo.compute_tbo_split_decode(5, 0),
    lambda: tbo.compute_tbo_split_decode(10, 3),
    lambda: tbo.compute_tbo_split("IDLE", 3),
    lambda: tbo.compute_tbo_split("EXTEND", 601, [10, 20, 30, 500, 40]),
    lambda: tbo.compute_tbo_split("PREFILL", 1, [1]),
    lambda: tbo.split_tbo_children(tbo.TboSeqFields([10, 20], [0, 5], [10, 25]), tbo.TboSplit(1, 11, False)),
    lambda: tbo.split_tbo_children(tbo.TboSeqFields([10, 20], [0, 5], [10, 24]), tbo.TboSplit(1, 10, False)),
])
def test_bad_split_input(call):
    with pytest.raises(epx.InvalidArgumentError) as info:
        call()
    assert isinstance(info.value, ValueError)


def make_ops(stages, trace):
    """Stages of names; each operation appends its name to `trace`."""
    ops = []
    for s, names in enumerate(stages):
        if s:
            ops.append(tbo.YIELD)
        for name in names:
            ops.append(tbo.Operation(name, lambda batch, name=name: trace.append(name)))
    return ops


def test_split_stages():
    t = []
    ops = make_ops([["p", "q"], ["r"], [], ["s"]], t) + [None]
    stages = tbo.split_stages(ops)
    assert [[op.name for op in stage] for stage in stages] == [["p", "q"], ["r"], [], ["s"]]
    assert stages[0][1] is ops[1]
    assert tbo.split_stages([]) == [] and tbo.split_stages([tbo.YIELD]) == [[]]


@pytest.mark.parametrize("delta,expected", [
    (0, ["a0", "a0'", "b0", "a1", "b1", "a2", "b2"]),
    (1, ["a0", "a0'", "a1", "b0", "a2", "b1", "b2"]),
    (2, ["a0", "a0'", "a1", "a2", "b0", "b1", "b2"]),
    (3, ["a0", "a0'", "a1", "a2", "b0", "b1", "b2"]),
])
def test_executor_order_for_every_delta(delta, expected):
    t = []
    tbo.execute_two_batch_overlap(make_ops([["a0", "a0'"], ["a1"], ["a2"]], t), make_ops([["b0"], ["b1"], ["b2"]], t),
                                  delta)
    assert t == expected


def test_one_list_serves_both_batches():
    t = []

    def op(name):
        def fn(batch):
            t.append(f"{name}.{'AB'[batch]}")
        fn.__name__ = name
        return fn

    layer = [op("attn"), op("gate"), tbo.YIELD, ("dispatch", op("dispatch")), None, op("experts"), tbo.YIELD,
             op("combine")]
    tbo.execute_two_batch_overlap(layer, layer, delta_stages=1)
    assert t == ["attn.A", "gate.A", "dispatch.A", "attn.B", "gate.B", "experts.A", "dispatch.B", "combine.A",
                 "experts.B", "combine.B"]


def test_executor_errors():
    t = []
    three = make_ops([["x"], ["y"], ["z"]], t)
    two = make_ops([["x"], ["y"]], t)
    with pytest.raises(epx.InvalidArgumentError, match="same number of stages, got 3 and 2"):
        tbo.execute_two_batch_overlap(three, two, 0)
    for delta in (4, -1):
        with pytest.raises(ValueError):
            tbo.execute_two_batch_overlap(three, three, delta)
    with pytest.raises(ValueError):
        tbo.execute_two_batch_overlap([42], [42], 0)
    assert t == []  # nothing ran
    tbo.execute_two_batch_overlap([], [], 0)

    def fail(batch):
        raise KeyError("b0 failed")

    a = make_ops([["a0"], ["a1"]], t)
    b = [tbo.Operation("b0", fail), tbo.YIELD] + make_ops([["b1"]], t)
    with pytest.raises(KeyError, match="b0 failed"):  # the Python exception itself propagates
        tbo.execute_two_batch_overlap(a, b, 0)
    assert t == ["a0"]


def test_executor_lets_other_python_threads_run():
    # Each operation takes the GIL for its call only: a second Python thread runs while operations wait for it
    # (a deadlock or a stall here would time out).
    ticks = []
    stop = threading.Event()
    tick = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(1)
            tick.set()
            stop.wait(0.001)

    def op(batch):
        tick.clear()
        assert tick.wait(5)

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        tbo.execute_two_batch_overlap([op, None, op], [op, None, op], 1)
    finally:
        stop.set()
        thread.join()
    assert len(ticks) >= 4

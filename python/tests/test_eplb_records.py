"""SGLang's per_pass / per_token expert-distribution records in the epx recorder (issue 16): ids, rank, forward
mode, counts, top-k ids, the JSON dump with SGLang's keys, and the memory cap with its drop counter."""
import json

import numpy as np
import pytest

import epx
from epx import eplb
from epx.dp import ForwardMode


def test_per_pass_records_and_dump(tmp_path):
    loc = eplb.ExpertLocation.trivial(2, 3, 4, num_gpus=2)  # slot 3 holds expert 0
    rec = eplb.make_recorder(2, 3, 4, 2, buffer_steps=1, mode="per_pass", rank=3)
    a = np.array([[1, 0, 0, 2], [0, 1, 1, 0]])
    b = np.array([[0, 0, 3, 0], [4, 0, 0, 0]])
    rec.record_pass(loc, a, forward_mode=ForwardMode.EXTEND)
    rec.record_pass(loc, b, forward_pass_id=42, forward_mode=ForwardMode.DECODE)
    rec.end_step()
    rec.record_pass(loc, a)
    rec.end_step()
    records = rec.records()
    assert [r["forward_pass_id"] for r in records] == [1, 42, 43]
    assert [r["step"] for r in records] == [0, 0, 1] and {r["rank"] for r in records} == {3}
    assert records[1]["forward_mode"] == ForwardMode.DECODE and records[2]["forward_mode"] is None
    np.testing.assert_array_equal(records[1]["global_physical_count"], b)
    path = tmp_path / "records.json"
    eplb.save_expert_distribution_records(path, rec, loc)
    dump = json.loads(path.read_text())
    assert dump["mode"] == "per_pass" and dump["rank"] == 3 and dump["dropped_passes"] == 0
    assert dump["last_physical_to_logical_map"] == [[0, 1, 2, 0], [0, 1, 2, 0]]
    r0 = dump["records"][0]
    assert (r0["forward_pass_id"], r0["rank"], r0["gatherer_key"]) == (1, 3, "primary")
    assert r0["forward_mode"] == 1 and r0["forward_mode_name"] == "EXTEND"  # SGLang's ForwardMode.EXTEND
    assert r0["global_physical_count"] == a.tolist()
    assert r0["logical_count"] == [[3, 0, 0], [0, 1, 1]]
    assert rec.records() == []  # cleared, as SGLang's dump resets


def test_per_token_records():
    loc = eplb.ExpertLocation.trivial(2, 3, 4, num_gpus=2)
    rec = eplb.make_recorder(2, 3, 4, 2, mode="per_token")
    topk = np.array([[[0, 3], [3, -1]], [[1, 2], [-1, -1]]])  # [layers, tokens, top-k]
    rec.record_token_pass(loc, topk, forward_mode=ForwardMode.EXTEND, input_ids=[11, 12],
                          positions=np.array([0, 1]), extend_seq_lens=[2])
    rec.end_step()
    np.testing.assert_array_equal(rec.physical_loads(1), [[1, 0, 0, 2], [0, 1, 1, 0]])
    r = rec.records()[0]
    np.testing.assert_array_equal(r["topk_ids_of_layer"], topk)
    np.testing.assert_array_equal(r["input_ids"], [11, 12])
    np.testing.assert_array_equal(r["extend_seq_lens"], [2])
    dump = json.loads(rec.records_json(loc))
    assert dump["records"][0]["topk_ids_of_layer"] == topk.tolist()
    assert dump["records"][0]["positions"] == [0, 1] and dump["records"][0]["misc_objects"] == []
    with pytest.raises(epx.InvalidArgumentError, match=r"topk_physical\[1\] must be in \[-1, 4\)"):
        rec.record_token_pass(loc, np.array([[[0]], [[4]]]))
    with pytest.raises(epx.InvalidArgumentError, match="not allowed in per_token"):
        rec.record_pass(loc, np.zeros((2, 4), np.int64))
    with pytest.raises(epx.InvalidArgumentError, match="needs per_pass or per_token"):
        eplb.make_recorder(2, 3, 4, 2).records_json(loc)


def test_record_cap_drops_and_counts():
    loc = eplb.ExpertLocation.trivial(2, 3, 4, num_gpus=2)
    rec = eplb.make_recorder(2, 3, 4, 2, mode="per_token", max_record_bytes=4096)
    rec.record_token_pass(loc, np.zeros((2, 1000, 2), np.int64))  # 16 kB of ids: dropped
    rec.record_token_pass(loc, np.zeros((2, 1, 2), np.int64))
    rec.end_step()
    assert rec.dropped_passes == 1 and len(rec.records()) == 1
    assert rec.records()[0]["forward_pass_id"] == 2  # the dropped pass had id 1
    assert 0 < rec.record_bytes <= 4096
    np.testing.assert_array_equal(rec.physical_loads(1)[:, 0], [2002, 2002])  # the dropped pass still counts

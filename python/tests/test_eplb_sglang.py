"""SGLang's EPLB files through epx.eplb: its recorder's logical_count (2-D, the dump's 3-D with the passes summed,
the dict torch.load returns), its --init-expert-location physical_to_logical_map, the writers' round trips into
rebalance / ExpertLocation, and the file bounds (regular files, at most MAX_INPUT_FILE_BYTES). Fixtures are
written by the tests."""

import importlib.util
import json
import os

import numpy as np
import pytest

import epx
from epx import eplb

# SGLang's stat dump: [buffer_size=3, num_layers=2, num_logical=4]; the last ring entry was never filled.
DUMP = np.array([[[30, 5, 10, 15], [1, 1, 2, 2]],
                 [[10, 5, 10, 15], [0, 1, 1, 2]],
                 [[0, 0, 0, 0], [0, 0, 0, 0]]], np.int32)
SUMMED = DUMP.sum(axis=0)  # [[40, 10, 20, 30], [1, 2, 3, 4]]


def test_logical_count_from_json_file_text_and_dict(tmp_path):
    path = tmp_path / "dump.json"
    path.write_text(json.dumps({"rank": 0, "logical_count": DUMP.tolist(),
                                "average_utilization_rate_over_window": 0.5}))
    for source in (path, str(path), path.read_text(),
                   {"rank": 0, "logical_count": DUMP, "average_utilization_rate_over_window": 0.5}):
        c = eplb.load_sglang_logical_count(source)
        assert (c.num_passes, c.num_layers, c.num_logical) == (3, 2, 4)
        assert c.counts.dtype == np.int64
        np.testing.assert_array_equal(c.counts, SUMMED)
        assert c.rank == 0 and c.average_utilization_rate_over_window == pytest.approx(0.5)
    two_d = eplb.load_sglang_logical_count('{"logical_count": [[1, 2], [3, 4]]}')
    assert two_d.num_passes == 1 and two_d.rank is None and two_d.average_utilization_rate_over_window is None
    np.testing.assert_array_equal(two_d.counts, [[1, 2], [3, 4]])


def test_torch_dump_dict():
    torch = pytest.importorskip("torch")
    c = eplb.load_sglang_logical_count({"rank": torch.tensor(0), "logical_count": torch.from_numpy(DUMP),
                                        "average_utilization_rate_over_window": None})
    np.testing.assert_array_equal(c.counts, SUMMED)
    assert c.rank == 0 and c.average_utilization_rate_over_window is None


def test_planned_from_sglang_counts_and_written_back(tmp_path):
    c = eplb.load_sglang_logical_count({"logical_count": DUMP})
    p = eplb.rebalance(c.counts, num_physical=6, num_gpus=2, policy="deepseek")
    np.testing.assert_array_equal(p.phy2log, eplb.rebalance(SUMMED.astype(float), 6, 2, policy="deepseek").phy2log)
    # What SGLang's --init-expert-location reads: the only key, one row per layer.
    out = tmp_path / "location.json"
    eplb.save_sglang_expert_location(out, p)
    assert json.loads(out.read_text()) == {"physical_to_logical_map": p.phy2log.tolist()}
    loc = eplb.load_sglang_expert_location(out)
    assert (loc.num_layers, loc.num_physical, loc.num_logical_seen) == (2, 6, 4)
    np.testing.assert_array_equal(loc.phy2log, p.phy2log)
    built = eplb.ExpertLocation(2, 1, loc.phy2log, 4)
    eplb.save_sglang_expert_location(tmp_path / "again.json", built)
    assert (tmp_path / "again.json").read_text() == out.read_text()
    eplb.save_sglang_expert_location(tmp_path / "array.json", p.phy2log)
    assert (tmp_path / "array.json").read_text() == out.read_text()
    # A recorder's logical loads as SGLang's logical_count (it rebalances from it), read back exactly.
    rec = eplb.make_recorder(2, 4, 6, 2, buffer_steps=4)
    rec.record_pass(built, np.arange(12).reshape(2, 6))
    rec.end_step()
    eplb.save_sglang_logical_count(tmp_path / "count.json", rec.logical_loads(4))
    back = eplb.load_sglang_logical_count(tmp_path / "count.json")
    np.testing.assert_array_equal(back.counts, rec.logical_loads(4))
    assert eplb.to_sglang_logical_count_json(np.array([[1, 2]])) == '{"logical_count":[[1,2]]}'


def test_bad_files_and_fields(tmp_path):
    def raises(source, needle, loader=eplb.load_sglang_logical_count):
        with pytest.raises(epx.InvalidArgumentError) as info:
            loader(source)
        assert needle in str(info.value), str(info.value)

    raises(tmp_path, "is a directory, not a file")
    raises(tmp_path / "missing.json", "cannot read")
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "fifo.json"
        os.mkfifo(fifo)
        raises(fifo, "is not a regular file")  # refused before it is opened: no wait for a writer
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(eplb.MAX_INPUT_FILE_BYTES + 1)  # sparse: no disk space used
    raises(big, "more than the 1 GiB an input file may hold")
    raises(tmp_path / "missing.pt", "cannot read")
    if importlib.util.find_spec("torch") is None:
        (tmp_path / "dump.pt").write_bytes(b"not read")
        raises(tmp_path / "dump.pt", "is a torch .pt file, which epx reads only with torch installed")
    else:
        (tmp_path / "junk.pt").write_bytes(b"not a torch file")
        raises(tmp_path / "junk.pt", "is not a torch file of tensors and numbers")
    (tmp_path / "latin1.json").write_bytes(b'{"logical_count": [[1]], "x": "\xe9"}')
    raises(tmp_path / "latin1.json", "is not UTF-8 text")
    raises('{"logical_count": [[1, -2]]}', "logical_count[0][1] = -2 must be an integer")
    raises('{"logical_count": [[[1, 2]], [[3]]]}', "logical_count[1][0] holds 1 experts, the first row holds 2")
    raises({"counts": [[1]]}, "the mapping has no key 'logical_count'")
    raises('{"physical_to_logical_map": [[0, 1], [1]]}', "physical_to_logical_map[1] holds 1 slots",
           eplb.load_sglang_expert_location)
    raises('{"physical_to_logical_map": [[0, 2000000]]}', "physical_to_logical_map[0][1] = 2000000",
           eplb.load_sglang_expert_location)
    with pytest.raises(epx.InvalidArgumentError, match=r"logical_count\[0\]\[1\] = -1 must be >= 0"):
        eplb.save_sglang_logical_count(tmp_path / "neg.json", np.array([[1, -1]]))
    with pytest.raises(epx.InvalidArgumentError, match="expected an integer array"):
        eplb.save_sglang_logical_count(tmp_path / "float.json", np.array([[1.5]]))


def test_pt_dump_is_read_with_torch(tmp_path):
    torch = pytest.importorskip("torch")
    counts = torch.tensor([[[1, 0, 2], [0, 3, 1]], [[2, 1, 0], [1, 1, 1]]])  # [passes, layers, experts]
    torch.save({"logical_count": counts, "rank": 0, "average_utilization_rate_over_window": 0.75},
               tmp_path / "dump.pt")
    got = eplb.load_sglang_logical_count(tmp_path / "dump.pt")
    np.testing.assert_array_equal(np.asarray(got.counts), counts.sum(0).numpy())
    torch.save({"physical_to_logical_map": torch.tensor([[0, 1, 2, 0]])}, tmp_path / "loc.pt")
    loc = eplb.load_sglang_expert_location(str(tmp_path / "loc.pt"))
    np.testing.assert_array_equal(np.asarray(loc.phy2log), [[0, 1, 2, 0]])
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(epx.InvalidArgumentError, match="holds a list, not a dict"):
        eplb.load_sglang_logical_count(tmp_path / "list.pt")

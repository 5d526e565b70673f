"""examples/moe_layer/run.py on the host backend at tiny shapes (hidden 256, 16 experts + 4 redundant slots, top-8 of
8 groups, inter 64; 2 rank threads): every phase runs (EP prefill bf16/fp8 with and without TBO, the TP baseline,
low-latency decode with hooks, EPLB live with a relocation) and its outputs match the single-device reference (the
example asserts that itself; here the JSON is checked too). Needs torch (CPU); skipped without it."""

import importlib
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_layer"


def test_moe_layer_example_on_host_backend(tmp_path):
    sys.path.insert(0, str(EXAMPLE))
    try:
        run = importlib.import_module("run")
        out = tmp_path / "moe.json"
        assert run.main(["--backend", "host", "--ranks", "2", "--iters", "1", "--warmup", "0", "--eplb-steps", "6",
                         "--timeout-ms", "30000", "--json", str(out)]) == 0
    finally:
        sys.path.remove(str(EXAMPLE))
    summary = json.loads(out.read_text())
    assert set(summary["prefill"]) == {"ep", "ep_tbo", "ep_fp8", "ep_fp8_tbo", "tp"}
    assert set(summary["decode"]) == {"ep", "ep_tbo", "ep_fp8", "tp"}
    assert summary["prefill"]["ep_tbo"]["how"] == "two batches"
    assert summary["prefill"]["tp"]["how"] == "SUM_LEN"  # an extend batch over 2 DP ranks
    for name, c in summary["checks"].items():
        assert c["moe_max_abs_err"] <= c["tolerance"] * c["max_abs_ref"], name
        assert c["max_abs_ref"] > 0.1, name  # the outputs are not trivially zero
    assert "decode_ep_after_eplb" in summary["checks"]
    eplb = summary["eplb"]
    assert len(eplb["timeline"]) == 6 and eplb["rebalances"] >= 1
    assert eplb["relocations"] and eplb["relocations"][0]["checked_slots"] == 10  # every slot of rank 0

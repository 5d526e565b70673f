"""The DeepEP shim's choices at Buffer creation that need no torch (python/epx/deep_ep/config.py, loaded from its
file: the epx.deep_ep package itself imports torch): which epx low-latency routing a DeepEP buffer gets, and how much
normal memory, on each backend and above the cuda backend's rank caps (epx.CUDA_*_MAX_RANKS, include/epx/buffer.h).
"""

import importlib.util
import pathlib

import epx

_spec = importlib.util.spec_from_file_location(
    "deep_ep_config", pathlib.Path(epx.__file__).parent / "deep_ep" / "config.py")
config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(config)


def test_rank_caps_are_exported():
    assert (epx.CUDA_FLAT_NORMAL_MAX_RANKS, epx.CUDA_NORMAL_MAX_RANKS) == (8, 64)
    assert (epx.CUDA_FLAT_LOW_LATENCY_MAX_RANKS, epx.CUDA_LOW_LATENCY_MAX_RANKS) == (16, 128)


def test_low_latency_routing_keeps_deepep_flat_where_epx_can():
    assert config.low_latency_routing(None, cuda=False) == "flat"  # the host backend runs flat on any topology
    assert config.low_latency_routing(None, cuda=True) == "auto"  # flat on one node, hierarchical across nodes
    for requested in ("flat", "hierarchical", "auto"):
        assert config.low_latency_routing(requested, cuda=True) == requested
        assert config.low_latency_routing(requested, cuda=False) == requested


def test_normal_bytes_follow_num_nvl_bytes_then_the_hint():
    assert config.normal_buffer_bytes(12345, cuda=True, num_ranks=8, num_sms=24) == 12345
    hint = epx.normal_buffer_size_hint(8192, 8, 24)
    assert config.normal_buffer_bytes(0, cuda=True, num_ranks=8, num_sms=24) == hint
    assert config.normal_buffer_bytes(0, cuda=False, num_ranks=8, num_sms=24) == hint


def test_above_the_normal_cap_a_cuda_buffer_is_low_latency_only():
    cap = epx.CUDA_NORMAL_MAX_RANKS
    assert config.normal_buffer_bytes(0, cuda=True, num_ranks=cap, num_sms=24) > 0
    assert config.normal_buffer_bytes(0, cuda=True, num_ranks=cap + 8, num_sms=24) == 0  # e.g. EP72 decode
    # The host backend has no cap; an explicit size is passed through (the cuda backend then names the cap).
    assert config.normal_buffer_bytes(0, cuda=False, num_ranks=cap + 8, num_sms=24) > 0
    assert config.normal_buffer_bytes(4096, cuda=True, num_ranks=cap + 8, num_sms=24) == 4096


def test_enable_shrink_decides_whether_a_timeout_raises():
    # Without enable_shrink DeepEP traps the GPU on a low-latency timeout: the shim raises instead of masking silently.
    assert config.low_latency_config(None, enable_shrink=False).raise_on_timeout
    assert not config.low_latency_config(None, enable_shrink=True).raise_on_timeout
    assert not epx.LowLatencyConfig().raise_on_timeout  # epx's own default: mask and warn
    mine = epx.LowLatencyConfig()
    mine.expert_side_reduction = True
    mine.combine_send_parts = 4
    mine.token_rows_min_tokens = 0
    mine.programmatic_launch = False
    mine.combine_solo_max_rows = 0
    got = config.low_latency_config(mine, enable_shrink=False)
    assert (got.expert_side_reduction, got.combine_send_parts, got.token_rows_min_tokens,
            got.programmatic_launch, got.combine_solo_max_rows, got.raise_on_timeout) == (True, 4, 0, False, 0, True)
    assert not mine.raise_on_timeout, "the caller's config is copied, not changed"

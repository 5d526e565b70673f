"""DeepEP's classic (V1) Python API on top of epx: ``from epx import deep_ep`` or, with
``python/deep_ep_shim`` on ``PYTHONPATH``, a plain ``import deep_ep``.

What is here: ``Buffer`` (normal dispatch/combine on one node and, on a group of several nodes, DeepEP's
internode mode over epx's hierarchical path; low-latency dispatch/combine, the mask-buffer calls, the static
helpers), ``Config``, ``EventOverlap``, ``EventHandle`` and
``topk_idx_t``; and the expert-parallel part of DeepEP's V2 API, ``ElasticBuffer`` and ``EPHandle``
(dispatch/combine, expand mode, no-CPU-sync mode; not Engram, PP or AGRS). Every call keeps DeepEP's
signature, return tuple and stream semantics; what epx does
with each argument, and what differs, is listed in docs/deepep-migration.md.

Needs PyTorch (DeepEP's API is torch-only); ``import epx`` itself does not.
"""

try:
    import torch
except ImportError as _e:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "epx.deep_ep (the DeepEP-compatible API) needs PyTorch, which is not installed: "
        "`pip install torch`. The native API, `import epx`, works without it.") from _e

from .buffer import Buffer  # noqa: E402
from .config import Config  # noqa: E402
from .events import EventHandle, EventOverlap  # noqa: E402
from .elastic import ElasticBuffer, EPHandle  # noqa: E402
from .handles import InternodeHandle, LowLatencyHandle, NormalHandle  # noqa: E402

from . import utils  # noqa: E402,F401  (deep_ep.utils)

#: dtype of top-k expert indices (DeepEP's ``deep_ep.topk_idx_t``); epx also accepts int32.
topk_idx_t = torch.int64

#: The DeepEP API this shim serves: the classic (V1) one of DeepEP's last V1 release, v1.2.1 (``+epx``: epx
#: underneath), plus V2's ElasticBuffer dispatch/combine. The version stays V1's because V2's other features
#: (Engram, PP, AGRS) are not here: code that checks the version for them keeps its V1 path.
__version__ = "1.2.1+epx"

__all__ = ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap", "InternodeHandle",
           "LowLatencyHandle", "NormalHandle", "topk_idx_t"]

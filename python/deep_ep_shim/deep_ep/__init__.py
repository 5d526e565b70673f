"""`import deep_ep` served by epx: put python/deep_ep_shim on PYTHONPATH (next to an installed or built epx).

Everything comes from epx.deep_ep (DeepEP's classic V1 API over epx); see docs/deepep-migration.md.
"""

from epx.deep_ep import *  # noqa: F401,F403
from epx.deep_ep import Buffer, Config, ElasticBuffer, EPHandle, EventHandle, EventOverlap, topk_idx_t  # noqa: F401
from epx.deep_ep import __all__, __version__, utils  # noqa: F401

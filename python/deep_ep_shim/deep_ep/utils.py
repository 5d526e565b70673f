"""`from deep_ep.utils import EventOverlap` served by epx (python/epx/deep_ep/utils.py)."""

from epx.deep_ep.utils import *  # noqa: F401,F403
from epx.deep_ep.utils import EventHandle, EventOverlap, __all__  # noqa: F401

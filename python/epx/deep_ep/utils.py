"""``deep_ep.utils``: where DeepEP's users import the event helpers from (``from deep_ep.utils import EventHandle,
EventOverlap``); the same classes as ``epx.deep_ep``."""

from .events import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]

"""CUDA events in DeepEP's shape: ``EventHandle`` (one recorded event) and ``EventOverlap`` (what every
call returns: the event, plus tensors kept alive until the caller drops it)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch


class EventHandle:
    """A CUDA event recorded on `stream` (default: torch's current stream) at construction.

    Without CUDA (host-backend buffers) it holds no event and waiting is a no-op.
    """

    def __init__(self, stream: Optional[Any] = None) -> None:
        self.event: Optional[torch.cuda.Event] = None
        if stream is None and not torch.cuda.is_available():
            return
        self.event = torch.cuda.Event()
        self.event.record(stream if stream is not None else torch.cuda.current_stream())

    @classmethod
    def completed(cls) -> "EventHandle":
        """A handle with nothing to wait for (work that already finished, e.g. on the host backend)."""
        handle = cls.__new__(cls)
        handle.event = None
        return handle

    def current_stream_wait(self) -> None:
        """Makes torch's current stream wait for the event (no host wait)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        """Blocks the host until the event has completed."""
        if self.event is not None:
            self.event.synchronize()


class EventOverlap:
    """The completion of a call made with ``async_finish=True`` (``event`` is then set, else None).

    ``extra_tensors``: tensors the call used on another stream, held here so their memory stays
    allocated until the caller waits and drops this object (works under CUDA graphs, unlike
    ``record_stream``). ``with overlap: ...`` runs the block, then makes the current stream wait.
    """

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        #: Called once, right after the next current_stream_wait() (register_hook_after_wait).
        self.hook_after_wait: Optional[Callable[[], Any]] = None
        self._release_on_exit = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Makes torch's current stream wait for the event, then runs the registered hook (once); with
        ``release_handle`` the event is dropped afterwards (a second wait then raises)."""
        if self.event is None:
            raise RuntimeError("EventOverlap has no event: the call was made without async_finish=True")
        self.event.current_stream_wait()
        hook, self.hook_after_wait = self.hook_after_wait, None
        if hook is not None:
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook: Callable[[], Any]) -> None:
        """Runs ``hook`` right after the next current_stream_wait() (on the waiting stream's side, e.g. a sort
        that needs the received data). One hook at a time."""
        if self.hook_after_wait is not None:
            raise RuntimeError("EventOverlap: a hook is already registered (it runs at the next wait)")
        self.hook_after_wait = hook

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """``with overlap(release_handle=True): ...``: the wait at the end of the block also drops the event."""
        self._release_on_exit = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        release, self._release_on_exit = self._release_on_exit, False
        if self.event is not None:
            self.current_stream_wait(release_handle=release)
        return False


def torch_event_of(previous_event: Any) -> Optional[torch.cuda.Event]:
    """The torch.cuda.Event inside an EventOverlap / EventHandle / torch.cuda.Event, or None."""
    ev = previous_event
    for _ in range(2):  # EventOverlap -> EventHandle -> torch.cuda.Event
        if ev is None or isinstance(ev, torch.cuda.Event):
            return ev
        if not hasattr(ev, "event"):
            break
        ev = ev.event
    if ev is None or isinstance(ev, torch.cuda.Event):
        return ev
    raise TypeError(f"previous_event: expected an EventOverlap, EventHandle or torch.cuda.Event, got {type(previous_event)}")

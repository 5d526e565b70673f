"""Tensor traffic between Python frameworks and the native module.

Inputs cross as DLPack/buffer-protocol arrays; bf16 and fp8 travel as (uint16/uint8 array, DType) pairs
when the framework cannot name the type itself. Outputs come back as (array, DType) pairs with bf16 as
uint16 and fp8 as uint8, and are viewed back here:

* torch inputs -> torch outputs. Memory epx allocates during the call comes from torch's caching
  allocator (see ``Allocations``), and the returned tensors are views of those allocations, so
  ``record_stream`` and CUDA-graph memory pools work as for any torch tensor.
* anything else -> numpy outputs (CPU). bf16/fp8 are viewed as ml_dtypes types when ml_dtypes is
  installed, else returned as uint16/uint8.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from . import _epx

try:  # optional: numpy has no bf16/fp8 types of its own
    import ml_dtypes as _ml
except ImportError:  # pragma: no cover - exercised only without ml_dtypes
    _ml = None


def _torch():
    import sys

    return sys.modules.get("torch")


def is_torch(t: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(t, torch.Tensor)


def any_torch(*ts: Any) -> bool:
    return any(is_torch(t) for t in ts)


def bf16(array: Any):
    """Marks a uint16 array (any framework) as bfloat16 bits."""
    return (array, _epx.DType.bfloat16)


def fp8(array: Any):
    """Marks a uint8 array (any framework) as float8 e4m3fn bits."""
    return (array, _epx.DType.float8_e4m3)


def to_arg(t: Any):
    """An input for the native module: None, an array, or (array, DType)."""
    if t is None or isinstance(t, tuple):
        return t
    torch = _torch()
    if torch is not None and isinstance(t, torch.Tensor):
        if t.dtype == torch.float8_e4m3fn:
            return (t.view(torch.uint8), _epx.DType.float8_e4m3)
        if t.dtype == torch.bfloat16:
            return (t.view(torch.int16), _epx.DType.bfloat16)
        return t
    if isinstance(t, np.ndarray) and _ml is not None:
        if t.dtype == _ml.bfloat16:
            return (t.view(np.uint16), _epx.DType.bfloat16)
        if t.dtype == _ml.float8_e4m3fn:
            return (t.view(np.uint8), _epx.DType.float8_e4m3)
    return t


def to_bf16_arg(t: Any):
    """An input that can only be bf16 (combine rows, biases): a plain numpy uint16 array, which is how epx returns bf16
    outputs where ml_dtypes is missing, is taken as bf16 bits, so dispatch's recv_x goes straight into combine."""
    if isinstance(t, np.ndarray) and t.dtype == np.uint16:
        return (t, _epx.DType.bfloat16)
    return to_arg(t)


def cuda_stream_of(stream: Any, *tensors: Any):
    """The stream argument: the given one, else torch's current stream when an input is a CUDA tensor."""
    if stream is not None:
        return stream
    for t in tensors:
        if is_torch(t) and t.is_cuda:
            return _torch().cuda.current_stream(t.device).cuda_stream
    return None


_TORCH_DTYPES = {}


def _torch_dtype(dtype):
    torch = _torch()
    if not _TORCH_DTYPES:
        D = _epx.DType
        _TORCH_DTYPES.update({
            D.bfloat16: torch.bfloat16, D.float8_e4m3: torch.float8_e4m3fn, D.float32: torch.float32,
            D.int32: torch.int32, D.int64: torch.int64, D.bool: torch.bool, D.uint8: torch.uint8})
    return _TORCH_DTYPES[dtype]


def _numpy_view(a: np.ndarray, dtype) -> np.ndarray:
    if _ml is not None:
        if dtype == _epx.DType.bfloat16:
            return a.view(_ml.bfloat16)
        if dtype == _epx.DType.float8_e4m3:
            return a.view(_ml.float8_e4m3fn)
    return a


class Allocations:
    """The Python side of a Buffer's allocator: per thread, either torch allocations or the default.

    While a call with torch inputs runs (``with allocations.torch(cuda, stream, device):``), epx's output
    allocations come from ``torch.empty(nbytes, dtype=uint8)`` with the call's stream current; outputs are then
    returned as views of them. Otherwise the callback returns None and epx uses its default allocator. The
    stream is made current at the first allocation of a call, only when it is not current already, and put
    back when the call ends (calls that allocate nothing pay nothing). The callback hands epx (data pointer,
    bytes, tensor), so no DLPack import happens per allocation.
    """

    def __init__(self):
        self._local = threading.local()
        self._devices = {}
        self._streams = {}  # raw handle -> torch.cuda.ExternalStream (a wrapper of the handle, safe to keep)

    def __call__(self, nbytes: int, device_index: int, stream: int):
        scope = getattr(self._local, "scope", None)
        if scope is None:
            return None
        torch = _torch()
        if scope.cuda:
            device = self._devices.get(device_index)
            if device is None:
                device = self._devices[device_index] = torch.device("cuda", device_index)
            if scope.stream is not None and scope.restore is None:
                current = torch.cuda.current_stream(device_index)
                target = self._torch_stream(scope.stream, device)
                scope.restore = current
                if target is not None and current.cuda_stream != target.cuda_stream:
                    torch.cuda.set_stream(target)
                    scope.switched = True
        else:
            device = "cpu"
        t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        ptr = t.data_ptr()
        scope.made.append((ptr, t.numel(), t))
        return (ptr, t.numel(), t)

    def _torch_stream(self, stream: Any, device: Any):
        """The call's stream (a torch stream or a raw handle) as a torch stream; None when it is neither."""
        torch = _torch()
        if isinstance(stream, torch.cuda.Stream):
            return stream
        if not isinstance(stream, int):
            stream = getattr(stream, "cuda_stream", None)
            if not isinstance(stream, int):
                return None  # not a stream: the native call has rejected it, naming stream
        key = (stream, device.index)
        wrapped = self._streams.get(key)
        if wrapped is None:
            wrapped = torch.cuda.ExternalStream(stream, device=device) if stream else torch.cuda.default_stream(device)
            if len(self._streams) > 4096:  # handles of destroyed streams: start over rather than grow
                self._streams.clear()
            self._streams[key] = wrapped
        return wrapped

    def torch(self, cuda: bool, stream: Any = None):
        return _TorchScope(self, cuda, stream if cuda else None)


class _TorchScope:
    """One native call's torch allocations (see Allocations.torch)."""

    __slots__ = ("allocations", "cuda", "stream", "made", "restore", "switched")

    def __init__(self, allocations: Allocations, cuda: bool, stream: Any):
        self.allocations, self.cuda, self.stream, self.made = allocations, cuda, stream, []
        self.restore, self.switched = None, False

    def __enter__(self):
        self.allocations._local.scope = self
        return self

    def __exit__(self, *exc):
        self.allocations._local.scope = None
        if self.switched:
            _torch().cuda.set_stream(self.restore)
        return False


class Outputs:
    """Converts the native module's (array, DType, data pointer, bytes, shape) outputs into the caller's
    framework. ``made``: the (pointer, bytes, tensor) torch allocations of the call."""

    def __init__(self, use_torch: bool, made=None):
        self.use_torch = use_torch
        self.made = made or []

    def __call__(self, out):
        if out is None:
            return None
        array, dtype, ptr, nbytes, shape = out
        if not self.use_torch:
            return _numpy_view(array, dtype)
        for start, size, base in self.made:  # a view of the torch allocation it lives in: torch owns the memory
            if start <= ptr and ptr + nbytes <= start + size:
                off = ptr - start
                if off or nbytes != size:
                    base = base[off:off + nbytes]
                return base.view(_torch_dtype(dtype)).view(shape)
        t = _torch().from_dlpack(array)  # memory epx owns (the buffer's): CPU: a numpy array; CUDA: a capsule
        if dtype in (_epx.DType.bfloat16, _epx.DType.float8_e4m3):
            return t.view(_torch_dtype(dtype))
        return t

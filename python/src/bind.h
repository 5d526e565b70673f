// Shared pieces of the nanobind bindings: tensor conversion (DLPack in, DLPack out), the allocator
// that calls back into Python, and one registration function per area.
//
// Convention between the native module and the Python package (python/epx/_tensors.py):
//   * an input tensor is None, anything nanobind reads as an ndarray (DLPack or the buffer protocol),
//     or a tuple (array, DType) when the framework's dtype cannot say it (numpy bf16/fp8 travel as
//     uint16/uint8 with the epx dtype beside them);
//   * an output tensor is a tuple (ndarray, DType, data pointer, bytes, shape) with bf16 exported as uint16 and
//     fp8 as uint8, so every framework can import it; the Python package views it back as bf16/fp8, and views
//     torch outputs inside the torch allocation they live in (pointer and bytes) without importing the ndarray.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <memory>

#include "epx/tensor.h"

namespace epx::py {

namespace nb = nanobind;

// None -> absent view. Throws epx::Error(kInvalidArgument) naming `name` for anything else it cannot read.
TensorView to_view(nb::handle obj, const char* name);
// (ndarray, DType, data pointer, bytes, shape), the ndarray owning a copy of the tensor's storage handle; None
// for an undefined tensor.
nb::object from_tensor(const Tensor& tensor);
// A stream argument: None/0 = the default stream, an int handle, or an object with `cuda_stream`.
Stream to_stream(nb::handle obj);

// An Allocator that calls `fn(nbytes, device_index, stream_handle)` (with the GIL) and keeps the returned
// object alive for as long as epx holds the memory (torch's caching allocator plugs in here). The result is
// an array (DLPack), a tuple (data pointer, bytes, owner), or None for "use epx's default allocator".
std::shared_ptr<Allocator> python_allocator(nb::object fn);

void register_errors(nb::module_& m);
void register_core(nb::module_& m);
void register_buffer(nb::module_& m);
void register_eplb(nb::module_& m);
void register_dp(nb::module_& m);
void register_tbo(nb::module_& m);

}  // namespace epx::py

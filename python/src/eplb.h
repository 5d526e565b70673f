// Shared pieces of the EPLB bindings (eplb.cpp, eplb_recorder.cpp, eplb_relocation.cpp): arrays in and out, and
// one registration function per area, called in this order by register_eplb (a class is registered before the
// bindings whose signatures name it).
//
// Arrays cross as nb::ndarray (numpy, torch CPU tensors, anything with __dlpack__ or the buffer protocol) and
// are read once, in C++, into the flat vectors the core takes; results come back as numpy arrays owning the
// core's vectors (no copy) with the shapes of include/epx/eplb/placement.h.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
// NOTE: every EPLB binding file sees the same type casters (the single eplb.cpp had these five).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bind.h"
#include "epx/error.h"

namespace epx::py::eplb_bind {

using RoArray = nb::ndarray<nb::ro>;

[[noreturn]] inline void bad(const std::string& message) { throw Error(ErrorCode::kInvalidArgument, message); }

// ---- arrays in ----------------------------------------------------------------------------------------

// A host array of `ndim` dimensions (any when ndim < 0). Throws kInvalidArgument naming `name`.
inline RoArray host_array(nb::handle obj, const char* name, int ndim) {
  RoArray array;
  if (!nb::try_cast(obj, array)) {
    bad(std::string(name) + ": expected an array (numpy, torch, DLPack), got " +
        nb::cast<std::string>(nb::type_name(obj.type())));
  }
  if (array.device_type() != nb::device::cpu::value) {
    bad(std::string(name) + ": must be in host memory (torch: call .cpu())");
  }
  if (ndim >= 0 && array.ndim() != static_cast<size_t>(ndim)) {
    bad(std::string(name) + ": expected " + std::to_string(ndim) + " dimensions, got " + std::to_string(array.ndim()));
  }
  return array;
}

// Reads every element in row-major order, whatever the strides.
template <typename In, typename Out>
std::vector<Out> gather_values(const RoArray& array, const char* name) {
  const size_t n = array.size(), nd = array.ndim();
  std::vector<Out> out(n);
  const auto* base = static_cast<const In*>(array.data());
  std::vector<size_t> idx(nd, 0);
  for (size_t i = 0; i < n; ++i) {
    int64_t offset = 0;
    for (size_t d = 0; d < nd; ++d) offset += static_cast<int64_t>(idx[d]) * array.stride(d);
    const In v = base[offset];
    if constexpr (std::is_integral_v<Out> && std::is_integral_v<In> && !std::is_same_v<In, bool>) {
      if (!std::in_range<Out>(v)) {
        bad(std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(v) + " does not fit " +
            std::to_string(sizeof(Out) * 8) + "-bit integers");
      }
    }
    out[i] = static_cast<Out>(v);
    for (size_t d = nd; d-- > 0;) {
      if (++idx[d] < array.shape(d)) break;
      idx[d] = 0;
    }
  }
  return out;
}

// Integer arrays of any width (and floating point ones when `allow_float`), converted to Out.
template <typename Out>
std::vector<Out> values_of(const RoArray& array, const char* name, bool allow_float) {
  using Code = nb::dlpack::dtype_code;
  const nb::dlpack::dtype dt = array.dtype();
  const auto code = static_cast<Code>(dt.code);
  if (dt.lanes == 1) {
    if (code == Code::Int) {
      switch (dt.bits) {
        case 8:
          return gather_values<int8_t, Out>(array, name);
        case 16:
          return gather_values<int16_t, Out>(array, name);
        case 32:
          return gather_values<int32_t, Out>(array, name);
        case 64:
          return gather_values<int64_t, Out>(array, name);
      }
    } else if (code == Code::UInt) {
      switch (dt.bits) {
        case 8:
          return gather_values<uint8_t, Out>(array, name);
        case 16:
          return gather_values<uint16_t, Out>(array, name);
        case 32:
          return gather_values<uint32_t, Out>(array, name);
        case 64:
          return gather_values<uint64_t, Out>(array, name);
      }
    } else if (code == Code::Float && allow_float) {
      if (dt.bits == 32) return gather_values<float, Out>(array, name);
      if (dt.bits == 64) return gather_values<double, Out>(array, name);
    }
  }
  bad(std::string(name) + ": expected " + (allow_float ? "a real-valued" : "an integer") +
      " array, got DLPack type code " + std::to_string(dt.code) + " with " + std::to_string(dt.bits) + " bits");
}

template <typename Out>
std::vector<Out> read_ints(nb::handle obj, const char* name, int ndim) {
  return values_of<Out>(host_array(obj, name, ndim), name, false);
}

// weight [num_layers, num_logical] (any real or integer dtype) -> the core's rows.
inline std::vector<std::vector<double>> read_weight(nb::handle obj) {
  const RoArray array = host_array(obj, "weight", 2);
  const std::vector<double> flat = values_of<double>(array, "weight", true);
  const size_t rows = array.shape(0), cols = array.shape(1);
  std::vector<std::vector<double>> weight(rows);
  for (size_t r = 0; r < rows; ++r) weight[r].assign(flat.begin() + r * cols, flat.begin() + (r + 1) * cols);
  return weight;
}

// phy2log [num_layers, num_physical] -> (flat, num_physical).
inline std::pair<std::vector<int32_t>, int> read_phy2log(nb::handle obj, const char* name) {
  const RoArray array = host_array(obj, name, 2);
  return {values_of<int32_t>(array, name, false), static_cast<int>(array.shape(1))};
}

// ---- arrays out ---------------------------------------------------------------------------------------

template <typename T>
using NumpyArray = nb::ndarray<nb::numpy, T>;

// A numpy array owning `values` (moved, not copied).
template <typename T>
NumpyArray<T> to_numpy(std::vector<T> values, std::initializer_list<size_t> shape) {
  auto* held = new std::vector<T>(std::move(values));
  nb::capsule owner(held, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return NumpyArray<T>(held->data(), shape, owner);
}

// A read-only numpy view of shared, immutable storage (kept alive by the array).
template <typename T>
NumpyArray<const T> shared_numpy(std::shared_ptr<const std::vector<T>> values, const T* data,
                                 std::initializer_list<size_t> shape) {
  auto* held = new std::shared_ptr<const std::vector<T>>(std::move(values));
  nb::capsule owner(held, [](void* p) noexcept { delete static_cast<std::shared_ptr<const std::vector<T>>*>(p); });
  return NumpyArray<const T>(data, shape, owner);
}

template <typename T>
NumpyArray<T> to_numpy_shaped(std::vector<T> values, const std::vector<size_t>& shape) {
  auto* held = new std::vector<T>(std::move(values));
  nb::capsule owner(held, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return NumpyArray<T>(held->data(), shape.size(), shape.data(), owner);
}

template <typename T>
NumpyArray<T> span_copy(std::span<const T> values) {
  return to_numpy(std::vector<T>(values.begin(), values.end()), {values.size()});
}

inline size_t sz(int64_t v) { return static_cast<size_t>(v); }

// ---- the areas ----------------------------------------------------------------------------------------

void bind_placement(nb::module_& m);        // policies, placements, balancedness (eplb.cpp)
void bind_location(nb::module_& m);         // ExpertLocation (+ JSON), replica choice (eplb.cpp)
void bind_recorder(nb::module_& m);         // the load recorder (eplb_recorder.cpp)
void bind_manager(nb::module_& m);          // the rebalance manager, its gate and reports (eplb_recorder.cpp)
void bind_dispatch_counts(nb::module_& m);  // dispatch counts and their all-reduce (eplb_relocation.cpp)
void bind_sglang_format(nb::module_& m);    // SGLang's EPLB files (eplb.cpp)
void bind_relocation(nb::module_& m);       // relocation plans and the host-transport executor (eplb_relocation.cpp)
void bind_synthetic(nb::module_& m);        // the synthetic loads (eplb.cpp)

}  // namespace epx::py::eplb_bind

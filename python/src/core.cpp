// Core bindings: errors, dtypes, tensor conversion, the Python allocator, groups, version and logging.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "bind.h"
#include "epx/buffer.h"
#include "epx/error.h"
#include "epx/group.h"
#include "epx/log.h"
#include "epx/quant.h"
#include "epx/version.h"
#ifdef EPX_WITH_CUDA
#include "epx/cuda.h"
#endif

namespace epx::py {
namespace {

std::string py_type_name(nb::handle obj) { return nb::cast<std::string>(nb::type_name(obj.type())); }

DType dtype_of(const nb::dlpack::dtype& dt, const char* name) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(dt.code);
  if (dt.lanes == 1) {
    if (code == Code::Float && dt.bits == 32) return DType::kFloat32;
    if (code == Code::Bfloat && dt.bits == 16) return DType::kBFloat16;
    if (code == Code::Int && dt.bits == 32) return DType::kInt32;
    if (code == Code::Int && dt.bits == 64) return DType::kInt64;
    if (code == Code::Bool && dt.bits == 8) return DType::kBool;
    if (code == Code::UInt && dt.bits == 8) return DType::kUInt8;
  }
  throw Error(ErrorCode::kInvalidArgument, std::string(name) + ": unsupported element type (DLPack code " +
                                               std::to_string(dt.code) + ", " + std::to_string(dt.bits) +
                                               " bits); epx takes bfloat16, float8_e4m3fn, float32, int32, int64, "
                                               "bool and uint8");
}

nb::dlpack::dtype export_dtype(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return nb::dtype<uint16_t>();  // viewed back as bf16 by the package
    case DType::kFloat8E4M3:
      return nb::dtype<uint8_t>();
    case DType::kFloat32:
      return nb::dtype<float>();
    case DType::kInt32:
      return nb::dtype<int32_t>();
    case DType::kInt64:
      return nb::dtype<int64_t>();
    case DType::kBool:
      return nb::dtype<bool>();
    case DType::kUInt8:
      return nb::dtype<uint8_t>();
  }
  throw Error(ErrorCode::kInternal, "export_dtype: unknown dtype");
}

class PythonAllocator final : public Allocator {
 public:
  explicit PythonAllocator(nb::object fn) : fn_(fn.release().ptr()) {}
  ~PythonAllocator() override { release(fn_); }

  std::shared_ptr<void> allocate(size_t bytes, Device device, Stream stream) override {
    nb::gil_scoped_acquire gil;
    try {
      nb::object out = nb::borrow(fn_)(bytes, device.index, reinterpret_cast<uintptr_t>(stream));
      if (out.is_none()) {
        nb::gil_scoped_release release;
        return default_allocator()->allocate(bytes, device, stream);
      }
      void* data = nullptr;
      size_t got = 0;
      if (nb::isinstance<nb::tuple>(out)) {  // (data pointer, bytes, owner): no DLPack round trip per allocation
        auto t = nb::borrow<nb::tuple>(out);
        if (t.size() != 3) throw nb::cast_error();
        data = reinterpret_cast<void*>(nb::cast<uintptr_t>(t[0]));
        got = nb::cast<size_t>(t[1]);
      } else {
        auto array = nb::cast<nb::ndarray<>>(out);
        data = array.data();
        got = array.nbytes();
      }
      if (got < bytes) {
        throw Error(ErrorCode::kOutOfMemory,
                    "allocator returned " + std::to_string(got) + " bytes, " + std::to_string(bytes) + " were asked for");
      }
      PyObject* held = out.release().ptr();
      return {data, [held](void*) { release(held); }};
    } catch (const nb::python_error& e) {
      throw Error(ErrorCode::kOutOfMemory, std::string("allocator callback failed: ") + e.what());
    } catch (const nb::cast_error&) {
      throw Error(ErrorCode::kInvalidArgument,
                  "allocator callback must return an array (DLPack) or a tuple (data pointer, bytes, owner)");
    }
  }

 private:
  // Drops a reference from any thread; a no-op once the interpreter is gone.
  static void release(PyObject* obj) {
    if (!Py_IsInitialized()) return;
    nb::gil_scoped_acquire gil;
    Py_DECREF(obj);
  }
  PyObject* fn_;
};

// One Python class per ErrorCode; invalid argument / timeout / out of memory / unsupported also derive
// from the builtin exception a Python user would catch.
PyObject* g_error_classes[9] = {};

PyObject* make_error_class(nb::module_& m, const char* name, PyObject* base, PyObject* builtin, const char* doc) {
  const std::string qualified = std::string("epx.") + name;
  nb::object bases = builtin ? nb::make_tuple(nb::handle(base), nb::handle(builtin)) : nb::make_tuple(nb::handle(base));
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (!cls) throw nb::python_error();
  m.attr(name) = nb::handle(cls);
  return cls;
}

// Host-only builds bind the CUDA entry points too (same signatures); they raise this.
[[maybe_unused]] Error no_cuda_error() {
  return Error(ErrorCode::kUnsupported, "this epx build has no CUDA backend (built without a CUDA toolkit)");
}

// The range checks of Topology's accessors (the C++ struct trusts its caller).
void check_rank_of(const Topology& t, int rank, const char* name) {
  if (rank < 0 || rank >= t.num_ranks()) {
    throw Error(ErrorCode::kInvalidArgument, std::string(name) + ": " + std::to_string(rank) + " is outside [0, " +
                                                 std::to_string(t.num_ranks()) + ")");
  }
}

// Host-only builds check gpus_per_node as the CUDA group constructors do (the same rule as HostGroupOptions), so
// a bad value reads the same whatever the build.
[[maybe_unused]] void check_gpus_per_node(int gpus_per_node, int num_ranks) {
  if (gpus_per_node < 0 || gpus_per_node > num_ranks) {
    throw Error(ErrorCode::kInvalidArgument, "gpus_per_node must be in [0, num_ranks = " + std::to_string(num_ranks) +
                                                 "] (0: one node), got " + std::to_string(gpus_per_node));
  }
  if (gpus_per_node > 0 && num_ranks % gpus_per_node != 0) {
    throw Error(ErrorCode::kInvalidArgument, "gpus_per_node = " + std::to_string(gpus_per_node) +
                                                 " must divide num_ranks = " + std::to_string(num_ranks));
  }
}

}  // namespace

TensorView to_view(nb::handle obj, const char* name) {
  if (obj.is_none()) return {};
  nb::handle array_obj = obj;
  bool forced = false;
  DType forced_dtype = DType::kFloat32;
  if (nb::isinstance<nb::tuple>(obj)) {
    auto pair = nb::borrow<nb::tuple>(obj);
    if (pair.size() != 2 || !nb::try_cast(pair[1], forced_dtype)) {
      throw Error(ErrorCode::kInvalidArgument, std::string(name) + ": a tuple argument must be (array, epx.DType)");
    }
    array_obj = pair[0];
    forced = true;
  }
  nb::ndarray<> array;
  if (!nb::try_cast(array_obj, array)) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(name) + ": expected an array (DLPack or buffer protocol), got " + py_type_name(array_obj));
  }
  if (array.ndim() > static_cast<size_t>(kMaxDims)) {
    throw Error(ErrorCode::kInvalidArgument, std::string(name) + ": " + std::to_string(array.ndim()) +
                                                 " dimensions, at most " + std::to_string(kMaxDims));
  }
  TensorView view;
  if (forced) {
    if (array.itemsize() != dtype_size(forced_dtype)) {
      throw Error(ErrorCode::kInvalidArgument, std::string(name) + ": " + std::to_string(array.itemsize()) +
                                                   "-byte elements cannot hold " + to_string(forced_dtype));
    }
    view.dtype = forced_dtype;
  } else {
    view.dtype = dtype_of(array.dtype(), name);
  }
  view.data = array.data();
  view.ndim = static_cast<int>(array.ndim());
  for (int d = 0; d < view.ndim; ++d) {
    view.shape[d] = static_cast<int64_t>(array.shape(d));
    view.strides[d] = array.stride(d);
  }
  const int device_type = array.device_type();
  if (device_type == nb::device::cpu::value) {
    view.device = Device::cpu();
  } else if (device_type == nb::device::cuda::value || device_type == nb::device::cuda_managed::value) {
    view.device = Device::cuda(array.device_id());
  } else {
    throw Error(ErrorCode::kInvalidArgument, std::string(name) + ": arrays on DLPack device type " +
                                                 std::to_string(device_type) + " are not supported (CPU and CUDA are)");
  }
  return view;
}

nb::object from_tensor(const Tensor& tensor) {
  if (!tensor.defined()) return nb::none();
  auto* held = new Tensor(tensor);
  nb::capsule owner(held, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  size_t shape[kMaxDims];
  int64_t strides[kMaxDims];
  const TensorView& v = tensor.view();
  for (int d = 0; d < v.ndim; ++d) {
    shape[d] = static_cast<size_t>(v.shape[d]);
    strides[d] = v.strides[d];
  }
  const bool cuda = v.device.is_cuda();
  nb::ndarray<> array(v.data, static_cast<size_t>(v.ndim), shape, owner, strides, export_dtype(v.dtype),
                      cuda ? nb::device::cuda::value : nb::device::cpu::value, cuda ? v.device.index : 0);
  // CPU: a numpy array (no copy); CUDA: a DLPack capsule (torch.from_dlpack and cupy take it).
  nb::object exported = cuda ? nb::cast(array) : nb::cast(nb::ndarray<nb::numpy>(array));
  nb::tuple dims = nb::steal<nb::tuple>(PyTuple_New(v.ndim));
  for (int d = 0; d < v.ndim; ++d) PyTuple_SET_ITEM(dims.ptr(), d, PyLong_FromLongLong(v.shape[d]));
  // The pointer, bytes and shape let the Python side view an output inside the torch allocation it came
  // from without a DLPack import per output.
  return nb::make_tuple(exported, v.dtype, reinterpret_cast<uintptr_t>(v.data), static_cast<size_t>(v.nbytes()),
                        dims);
}

Stream to_stream(nb::handle obj) {
  if (obj.is_none()) return nullptr;
  if (nb::hasattr(obj, "cuda_stream")) return reinterpret_cast<Stream>(nb::cast<uintptr_t>(obj.attr("cuda_stream")));
  uintptr_t handle = 0;
  if (!nb::try_cast(obj, handle)) {
    throw Error(ErrorCode::kInvalidArgument,
                "stream: expected None, an int handle or an object with .cuda_stream, got " + py_type_name(obj));
  }
  return reinterpret_cast<Stream>(handle);
}

std::shared_ptr<Allocator> python_allocator(nb::object fn) {
  if (fn.is_none()) return nullptr;
  return std::make_shared<PythonAllocator>(std::move(fn));
}

void register_errors(nb::module_& m) {
  PyObject* base = make_error_class(m, "Error", PyExc_RuntimeError, nullptr,
                                    "Base of every epx error. `code` is the stable code name, e.g. 'timeout'.");
  auto sub = [&](ErrorCode code, const char* name, PyObject* builtin, const char* doc) {
    g_error_classes[static_cast<int>(code)] = make_error_class(m, name, base, builtin, doc);
  };
  sub(ErrorCode::kInvalidArgument, "InvalidArgumentError", PyExc_ValueError,
      "Bad shape, dtype, range or inconsistent arguments; the message names the argument and the bound.");
  sub(ErrorCode::kOutOfMemory, "OutOfMemoryError", PyExc_MemoryError, "A host or device allocation failed.");
  sub(ErrorCode::kCudaError, "CudaError", nullptr, "A CUDA runtime or driver call failed.");
  sub(ErrorCode::kNcclError, "NcclError", nullptr, "An NCCL call failed.");
  sub(ErrorCode::kTimeout, "TimeoutError", PyExc_TimeoutError,
      "A bounded wait on a peer expired; the message says who was waited for.");
  sub(ErrorCode::kPeerFailure, "PeerFailureError", nullptr, "A peer rank failed or was masked while it was needed.");
  sub(ErrorCode::kInternal, "InternalError", nullptr, "A broken invariant inside epx (a bug: please report it).");
  sub(ErrorCode::kUnsupported, "UnsupportedError", PyExc_NotImplementedError,
      "Valid, but this build, backend or machine cannot do it.");
  g_error_classes[0] = base;

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      const int code = static_cast<int>(e.code());
      PyObject* cls = (code > 0 && code < 9 && g_error_classes[code]) ? g_error_classes[code] : g_error_classes[0];
      nb::object instance = nb::steal(PyObject_CallFunction(cls, "s", e.what()));
      if (!instance.is_valid()) return;  // the constructor raised; that error stands
      nb::setattr(instance, "code", nb::str(to_string(e.code())));
      PyErr_SetObject(cls, instance.ptr());
    }
  });
}

void register_core(nb::module_& m) {
  nb::enum_<DType>(m, "DType", "Element types epx moves (bf16 travels as uint16 and fp8 as uint8 across DLPack).")
      .value("bfloat16", DType::kBFloat16)
      .value("float8_e4m3", DType::kFloat8E4M3)
      .value("float32", DType::kFloat32)
      .value("int32", DType::kInt32)
      .value("int64", DType::kInt64)
      .value("bool", DType::kBool)
      .value("uint8", DType::kUInt8);
  nb::enum_<ScaleFormat>(m, "ScaleFormat", "fp8 scales: float32, or UE8M0 power-of-two exponents (uint8).")
      .value("float32", ScaleFormat::kFloat32)
      .value("ue8m0", ScaleFormat::kUE8M0);
  nb::enum_<ScaleLayout>(m, "ScaleLayout",
                         "Low-latency fp8 scale layout: row_major [E, R * M, S], or column_major [E, S, R * M] "
                         "(DeepGEMM's; S = H / 512 int32 words of four exponents with UE8M0).")
      .value("row_major", ScaleLayout::kRowMajor)
      .value("column_major", ScaleLayout::kColumnMajor);

  m.def("version", &version, "The epx version, e.g. '0.1.0'.");
  m.def("built_with_cuda", &built_with_cuda, "True when this build contains the CUDA backend.");
  m.def(
      "set_log_level",
      [](const std::string& level) {
        static const std::pair<const char*, LogLevel> kLevels[] = {
            {"trace", LogLevel::kTrace}, {"debug", LogLevel::kDebug}, {"info", LogLevel::kInfo},
            {"warn", LogLevel::kWarn},   {"error", LogLevel::kError}, {"off", LogLevel::kOff}};
        for (const auto& [name, value] : kLevels) {
          if (level == name) return set_log_level(value);
        }
        throw Error(ErrorCode::kInvalidArgument,
                    "level: '" + level + "' is not one of trace, debug, info, warn, error, off");
      },
      nb::arg("level"), "Sets the library's log level (also EPX_LOG_LEVEL).");

  nb::class_<Topology>(m, "Topology",
                       "Where a group's ranks sit: num_nodes nodes of gpus_per_node ranks each, numbered node-major "
                       "(rank = node * gpus_per_node + local_rank). See include/epx/group.h.")
      .def(nb::init<>())
      .def_ro("num_nodes", &Topology::num_nodes)
      .def_ro("gpus_per_node", &Topology::gpus_per_node)
      .def_prop_ro("num_ranks", &Topology::num_ranks)
      .def(
          "node_of",
          [](const Topology& t, int rank) {
            check_rank_of(t, rank, "rank");
            return t.node_of(rank);
          },
          nb::arg("rank"), "The node of `rank` (rank // gpus_per_node).")
      .def(
          "local_rank_of",
          [](const Topology& t, int rank) {
            check_rank_of(t, rank, "rank");
            return t.local_rank_of(rank);
          },
          nb::arg("rank"), "The index of `rank` inside its node (rank % gpus_per_node).")
      .def(
          "rank_of",
          [](const Topology& t, int node, int local_rank) {
            if (node < 0 || node >= t.num_nodes) {
              throw Error(ErrorCode::kInvalidArgument,
                          "node: " + std::to_string(node) + " is outside [0, " + std::to_string(t.num_nodes) + ")");
            }
            if (local_rank < 0 || local_rank >= t.gpus_per_node) {
              throw Error(ErrorCode::kInvalidArgument, "local_rank: " + std::to_string(local_rank) +
                                                           " is outside [0, " + std::to_string(t.gpus_per_node) + ")");
            }
            return t.rank_of(node, local_rank);
          },
          nb::arg("node"), nb::arg("local_rank"), "node * gpus_per_node + local_rank.")
      .def("__eq__", [](const Topology& a,
                        const Topology& b) { return a.num_nodes == b.num_nodes && a.gpus_per_node == b.gpus_per_node; })
      .def("__repr__", [](const Topology& t) {
        return "epx.Topology(num_nodes=" + std::to_string(t.num_nodes) +
               ", gpus_per_node=" + std::to_string(t.gpus_per_node) + ")";
      });

  nb::class_<Group>(m, "Group",
                    "One rank's membership in a set of ranks that run expert parallelism together.\n"
                    "Collective calls must be made by every rank of the group in the same order.")
      .def_prop_ro("rank", &Group::rank)
      .def_prop_ro("num_ranks", &Group::num_ranks)
      .def_prop_ro("backend", [](const Group& g) { return std::string(to_string(g.backend())); })
      .def_prop_ro("device", [](const Group& g) { return to_string(g.device()); })
      .def_prop_ro("timeout_ms", &Group::timeout_ms)
      .def_prop_ro("topology", &Group::topology,
                   "The ranks' placement on nodes (epx.Topology); one node holding every rank unless the group was "
                   "made with gpus_per_node.")
      .def("barrier", &Group::barrier, nb::call_guard<nb::gil_scoped_release>(),
           "Blocks until every rank arrived; raises epx.TimeoutError naming the ranks that did not.")
      .def(
          "all_gather_bytes",
          [](Group& g, nb::bytes data) {
            const size_t n = data.size();
            std::string send(data.c_str(), n), recv(n * g.num_ranks(), '\0');
            {
              nb::gil_scoped_release release;
              g.all_gather_bytes(send.data(), recv.data(), n);
            }
            nb::list out;
            for (int r = 0; r < g.num_ranks(); ++r) out.append(nb::bytes(recv.data() + r * n, n));
            return out;
          },
          nb::arg("data"), "Every rank contributes the same number of bytes; returns them in rank order.")
      .def("__repr__", [](const Group& g) {
        const Topology t = g.topology();
        return "epx.Group(rank=" + std::to_string(g.rank()) + ", num_ranks=" + std::to_string(g.num_ranks()) +
               ", backend=" + to_string(g.backend()) + ", device=" + to_string(g.device()) +
               ", num_nodes=" + std::to_string(t.num_nodes) + ")";
      });

  m.def(
      "host_groups",
      [](int num_ranks, int64_t timeout_ms, int gpus_per_node) {
        HostGroupOptions options;
        options.timeout_ms = timeout_ms;
        options.gpus_per_node = gpus_per_node;
        return create_host_groups(num_ranks, options);
      },
      nb::arg("num_ranks"), nb::arg("timeout_ms") = 60'000, nb::arg("gpus_per_node") = 0,
      "The groups of `num_ranks` thread ranks of the host backend; hand groups[r] to the thread of rank r.\n"
      "gpus_per_node: ranks per node of the groups' topology (0: one node; else a divisor of num_ranks). The threads "
      "still share memory; with more than one node the normal dispatch/combine route hierarchically.");

  // The same signatures in every build, so the stubs and help() do not depend on how epx was built.
  m.def(
      "cuda_groups",
      [](const std::vector<int>& devices, int64_t timeout_ms,
         int gpus_per_node) -> std::vector<std::shared_ptr<Group>> {
#ifdef EPX_WITH_CUDA
        CudaGroupOptions options;
        options.timeout_ms = timeout_ms;
        options.gpus_per_node = gpus_per_node;
        return create_cuda_groups(devices, options);
#else
        check_gpus_per_node(gpus_per_node, static_cast<int>(devices.size()));
        throw no_cuda_error();
#endif
      },
      nb::arg("devices"), nb::arg("timeout_ms") = 60'000, nb::arg("gpus_per_node") = 0,
      "One CUDA group per entry of `devices` (one process, one thread per rank). gpus_per_node: as host_groups.");
  m.def(
      "cuda_group_from_nccl_comm",
      [](uintptr_t comm, int64_t timeout_ms, int gpus_per_node) -> std::shared_ptr<Group> {
#ifdef EPX_WITH_CUDA
        CudaGroupOptions options;
        options.timeout_ms = timeout_ms;
        options.gpus_per_node = gpus_per_node;
        return create_cuda_group(reinterpret_cast<ncclComm_t>(comm), options);
#else
        throw no_cuda_error();
#endif
      },
      nb::arg("comm"), nb::arg("timeout_ms") = 60'000, nb::arg("gpus_per_node") = 0,
      "A group over an existing NCCL communicator (its ncclComm_t as an int); the communicator must outlive it. "
      "gpus_per_node: ranks per node (0: one node; else a divisor of the communicator's size).");
  m.def(
      "nccl_unique_id",
      []() -> nb::bytes {
#ifdef EPX_WITH_CUDA
        std::vector<uint8_t> id = nccl_unique_id();
        return nb::bytes(reinterpret_cast<const char*>(id.data()), id.size());
#else
        throw no_cuda_error();
#endif
      },
      "NCCL's unique id as bytes (loads NCCL on first use).");
  m.def(
      "cuda_group_from_nccl_id",
      [](nb::bytes unique_id, int rank, int num_ranks, int device, int64_t timeout_ms,
         int gpus_per_node) -> std::shared_ptr<Group> {
#ifdef EPX_WITH_CUDA
        std::vector<uint8_t> id(unique_id.size());
        std::memcpy(id.data(), unique_id.c_str(), id.size());
        CudaGroupOptions options;
        options.timeout_ms = timeout_ms;
        options.gpus_per_node = gpus_per_node;
        nb::gil_scoped_release release;
        return create_cuda_group(id, rank, num_ranks, device, options);
#else
        check_gpus_per_node(gpus_per_node, num_ranks);
        throw no_cuda_error();
#endif
      },
      nb::arg("unique_id"), nb::arg("rank"), nb::arg("num_ranks"), nb::arg("device"), nb::arg("timeout_ms") = 60'000,
      nb::arg("gpus_per_node") = 0,
      "A group that creates and owns an NCCL communicator from a unique id shared by all ranks (collective). "
      "gpus_per_node: as host_groups.");
}

}  // namespace epx::py

NB_MODULE(_epx, m) {
  m.doc() = "epx native module: the C++ API of epx. Use the `epx` package, which wraps it for numpy and torch.";
  epx::py::register_errors(m);
  epx::py::register_core(m);
  epx::py::register_buffer(m);
  epx::py::register_eplb(m);
  epx::py::register_dp(m);
  epx::py::register_tbo(m);
}

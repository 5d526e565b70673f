// EPLB bindings: placement, balancedness, ExpertLocation (+ JSON), replica choice, the load recorder, the
// rebalance manager (+ its gate and per-rebalance report), dispatch counts and their all-reduce, relocation plans
// (+ the host-transport executor), SGLang's EPLB files and the synthetic loads.
//
// Arrays cross as nb::ndarray (numpy, torch CPU tensors, anything with __dlpack__ or the buffer protocol) and
// are read once, in C++, into the flat vectors the core takes; results come back as numpy arrays owning the
// core's vectors (no copy) with the shapes of include/epx/eplb/placement.h.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bind.h"
#include "collective.h"
#include "epx/eplb/device_replicas.h"
#include "epx/eplb/dispatch_counts.h"
#include "epx/eplb/expert_location.h"
#include "epx/eplb/manager.h"
#include "epx/eplb/placement.h"
#include "epx/eplb/recorder.h"
#include "epx/eplb/relocation.h"
#include "epx/eplb/sglang_format.h"
#include "epx/eplb/synthetic.h"
#include "epx/error.h"
#include "epx/forward_mode.h"
#include "epx/group.h"

namespace epx::py {
namespace {

using namespace epx::eplb;
using RoArray = nb::ndarray<nb::ro>;

[[noreturn]] void bad(const std::string& message) { throw Error(ErrorCode::kInvalidArgument, message); }

// ---- arrays in ----------------------------------------------------------------------------------------

// A host array of `ndim` dimensions (any when ndim < 0). Throws kInvalidArgument naming `name`.
RoArray host_array(nb::handle obj, const char* name, int ndim) {
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
std::vector<std::vector<double>> read_weight(nb::handle obj) {
  const RoArray array = host_array(obj, "weight", 2);
  const std::vector<double> flat = values_of<double>(array, "weight", true);
  const size_t rows = array.shape(0), cols = array.shape(1);
  std::vector<std::vector<double>> weight(rows);
  for (size_t r = 0; r < rows; ++r) weight[r].assign(flat.begin() + r * cols, flat.begin() + (r + 1) * cols);
  return weight;
}

// phy2log [num_layers, num_physical] -> (flat, num_physical).
std::pair<std::vector<int32_t>, int> read_phy2log(nb::handle obj, const char* name) {
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

size_t sz(int64_t v) { return static_cast<size_t>(v); }

// ---- placement ----------------------------------------------------------------------------------------

void bind_placement(nb::module_& m) {
  nb::enum_<Policy>(m, "Policy", "EPLB placement policy (include/epx/eplb/placement.h).")
      .value("deepseek", Policy::kDeepSeek, "DeepSeek's published EPLB, reproduced exactly.")
      .value("default", Policy::kDefault, "kDeepSeek improved by swaps and moves; never less balanced.");
  m.def("policy_from_string", &policy_from_string, nb::arg("name"),
        "'deepseek' or 'default' -> Policy; raises InvalidArgumentError otherwise.");

  nb::class_<Placement>(m, "Placement",
                        "Which logical expert each physical slot holds, per layer. Arrays are copies (numpy, int32).")
      .def_ro("num_layers", &Placement::num_layers)
      .def_ro("num_logical", &Placement::num_logical)
      .def_ro("num_physical", &Placement::num_physical)
      .def_ro("max_replicas", &Placement::max_replicas, "The largest replica count over all layers and experts.")
      .def_ro("hierarchical", &Placement::hierarchical, "Groups were packed onto nodes (num_groups % num_nodes == 0).")
      .def_prop_ro(
          "phy2log",
          [](const Placement& p) {
            return to_numpy(p.phy2log, {sz(p.num_layers), sz(p.num_physical)});
          },
          nb::rv_policy::automatic, "int32 [num_layers, num_physical]: the logical expert of each physical slot.")
      .def_prop_ro(
          "log2phy",
          [](const Placement& p) {
            return to_numpy(p.log2phy, {sz(p.num_layers), sz(p.num_logical), sz(p.max_replicas)});
          },
          nb::rv_policy::automatic,
          "int32 [num_layers, num_logical, max_replicas]: the slots of each logical expert, -1 padded.")
      .def_prop_ro(
          "logcnt",
          [](const Placement& p) {
            return to_numpy(p.logcnt, {sz(p.num_layers), sz(p.num_logical)});
          },
          nb::rv_policy::automatic, "int32 [num_layers, num_logical]: replica count of each logical expert (>= 1).")
      .def("__repr__", [](const Placement& p) {
        return "epx.eplb.Placement(num_layers=" + std::to_string(p.num_layers) +
               ", num_logical=" + std::to_string(p.num_logical) + ", num_physical=" + std::to_string(p.num_physical) +
               ", max_replicas=" + std::to_string(p.max_replicas) +
               ", hierarchical=" + (p.hierarchical ? "True" : "False") + ")";
      });

  m.def(
      "rebalance",
      [](nb::handle weight, int num_physical, int num_gpus, int num_groups, int num_nodes, Policy policy) {
        auto rows = read_weight(weight);
        const PlacementShape shape{num_physical, num_groups, num_nodes, num_gpus};
        nb::gil_scoped_release release;
        return rebalance(rows, shape, policy);
      },
      nb::arg("weight"), nb::arg("num_physical"), nb::arg("num_gpus"), nb::arg("num_groups") = 1,
      nb::arg("num_nodes") = 1, nb::arg("policy") = Policy::kDefault,
      "A fresh placement for weight [num_layers, num_logical] (loads >= 0). Hierarchical when num_groups % "
      "num_nodes == 0. Raises InvalidArgumentError naming the broken bound.");

  nb::class_<MigrationResult>(m, "MigrationResult", "A migration-aware placement and what it moved.")
      .def_ro("placement", &MigrationResult::placement)
      .def_ro("moved_experts", &MigrationResult::moved_experts,
              "Slots whose expert changes w.r.t. current, all layers.")
      .def_ro("fresh_moved_experts", &MigrationResult::fresh_moved_experts,
              "The same count for the fresh 'default' placement.")
      .def_ro("fresh_balancedness", &MigrationResult::fresh_balancedness,
              "Balancedness of the fresh placement under weight.");
  m.def(
      "rebalance_migration_aware",
      [](nb::handle weight, nb::handle current_phy2log, int num_physical, int num_gpus, int num_groups, int num_nodes,
         double max_balance_loss) {
        auto rows = read_weight(weight);
        auto [current, current_physical] = read_phy2log(current_phy2log, "current_phy2log");
        if (current_physical != num_physical) {
          bad("current_phy2log: " + std::to_string(current_physical) + " slots per layer, num_physical is " +
              std::to_string(num_physical));
        }
        const PlacementShape shape{num_physical, num_groups, num_nodes, num_gpus};
        nb::gil_scoped_release release;
        return rebalance_migration_aware(rows, shape, current, MigrationOptions{max_balance_loss});
      },
      nb::arg("weight"), nb::arg("current_phy2log"), nb::arg("num_physical"), nb::arg("num_gpus"),
      nb::arg("num_groups") = 1, nb::arg("num_nodes") = 1, nb::arg("max_balance_loss") = 0.01,
      "Like rebalance(policy='default') but keeps experts of current_phy2log [num_layers, num_physical] in place "
      "unless moving buys more than max_balance_loss of balancedness per layer.");

  m.def(
      "placement_from_phy2log",
      [](nb::handle phy2log, int num_logical) {
        auto [flat, num_physical] = read_phy2log(phy2log, "phy2log");
        const int num_layers = num_physical > 0 ? static_cast<int>(flat.size() / num_physical) : 0;
        return placement_from_phy2log(flat, num_layers, num_logical, num_physical);
      },
      nb::arg("phy2log"), nb::arg("num_logical"),
      "Derives log2phy (slot order), logcnt and max_replicas from phy2log [num_layers, num_physical].");

  m.def(
      "balancedness_per_layer",
      [](nb::handle weight, nb::handle phy2log, int num_gpus) {
        auto rows = read_weight(weight);
        auto [flat, num_physical] = read_phy2log(phy2log, "phy2log");
        auto out = balancedness_per_layer(rows, flat, num_physical, num_gpus);
        return to_numpy(std::move(out), {rows.size()});
      },
      nb::arg("weight"), nb::arg("phy2log"), nb::arg("num_gpus"),
      "float64 [num_layers]: mean GPU load / max GPU load of each layer (1 for a layer without load).");
  m.def(
      "balancedness",
      [](nb::handle weight, nb::handle phy2log, int num_gpus) {
        auto rows = read_weight(weight);
        auto [flat, num_physical] = read_phy2log(phy2log, "phy2log");
        return balancedness(rows, flat, num_physical, num_gpus);
      },
      nb::arg("weight"), nb::arg("phy2log"), nb::arg("num_gpus"), "The mean of balancedness_per_layer.");
  m.def(
      "count_moved_experts",
      [](nb::handle old_phy2log, nb::handle new_phy2log) {
        return count_moved_experts(read_ints<int32_t>(old_phy2log, "old_phy2log", -1),
                                   read_ints<int32_t>(new_phy2log, "new_phy2log", -1));
      },
      nb::arg("old_phy2log"), nb::arg("new_phy2log"),
      "Slots whose logical expert differs between two placements of equal shape, all layers.");
  m.def(
      "trivial_phy2log",
      [](int num_layers, int num_logical, int num_physical) {
        return to_numpy(trivial_phy2log(num_layers, num_logical, num_physical), {sz(num_layers), sz(num_physical)});
      },
      nb::arg("num_layers"), nb::arg("num_logical"), nb::arg("num_physical"),
      "int32 [num_layers, num_physical]: slot i holds logical expert i % num_logical.");
}

// ---- expert location ----------------------------------------------------------------------------------

void bind_location(nb::module_& m) {
  nb::class_<ExpertLocation>(
      m, "ExpertLocation",
      "Where each layer's experts live at run time (include/epx/eplb/expert_location.h). Slot s lives on GPU\n"
      "s // slots_per_gpu, GPU g on node g // gpus_per_node. A value: copies are independent.")
      .def(
          "__init__",
          [](ExpertLocation* self, int num_gpus, int num_nodes, nb::handle phy2log, int num_logical) {
            auto [flat, num_physical] = read_phy2log(phy2log, "phy2log");
            const int num_layers = num_physical > 0 ? static_cast<int>(flat.size() / num_physical) : 0;
            new (self) ExpertLocation(num_layers, num_logical, num_physical, num_gpus, num_nodes, std::move(flat));
          },
          nb::arg("num_gpus"), nb::arg("num_nodes"), nb::arg("phy2log"), nb::arg("num_logical"),
          "From phy2log [num_layers, num_physical]. Raises InvalidArgumentError when an expert has no replica, "
          "slots do not divide over GPUs or GPUs over nodes.")
      .def_static("trivial", &ExpertLocation::trivial, nb::arg("num_layers"), nb::arg("num_logical"),
                  nb::arg("num_physical"), nb::arg("num_gpus"), nb::arg("num_nodes") = 1,
                  "Slot i holds logical expert i % num_logical in every layer.")
      .def_static("from_placement", &ExpertLocation::from_placement, nb::arg("placement"), nb::arg("num_gpus"),
                  nb::arg("num_nodes"))
      .def_static("from_json", &ExpertLocation::from_json, nb::arg("text"),
                  "Parses to_json()'s text; raises InvalidArgumentError naming the bad field.")
      .def("to_json", &ExpertLocation::to_json,
           "JSON {num_layers, num_logical, num_physical, num_gpus, num_nodes, phy2log: [[...] per layer]}.")
      .def_prop_ro("num_layers", &ExpertLocation::num_layers)
      .def_prop_ro("num_logical", &ExpertLocation::num_logical)
      .def_prop_ro("num_physical", &ExpertLocation::num_physical)
      .def_prop_ro("num_gpus", &ExpertLocation::num_gpus)
      .def_prop_ro("num_nodes", &ExpertLocation::num_nodes)
      .def_prop_ro("slots_per_gpu", &ExpertLocation::slots_per_gpu)
      .def_prop_ro("gpus_per_node", &ExpertLocation::gpus_per_node)
      .def_prop_ro("max_replicas", &ExpertLocation::max_replicas,
                   "The largest replica count over all layers and experts.")
      .def("gpu_of_slot", &ExpertLocation::gpu_of_slot, nb::arg("slot"))
      .def_prop_ro(
          "phy2log_table",
          [](const ExpertLocation& loc) {
            auto table = loc.phy2log_table();
            const int32_t* data = table->data();
            return shared_numpy(std::move(table), data, {sz(loc.num_layers()), sz(loc.num_physical())});
          },
          nb::rv_policy::automatic,
          "int32 [num_layers, num_physical], read-only; unchanged by later set_layer() calls.")
      .def(
          "phy2log", [](const ExpertLocation& loc, int layer) { return span_copy(loc.phy2log(layer)); },
          nb::arg("layer"), "int32 [num_physical]: the logical expert of each slot of `layer`.")
      .def(
          "replicas",
          [](const ExpertLocation& loc, int layer, int expert) { return span_copy(loc.replicas(layer, expert)); },
          nb::arg("layer"), nb::arg("expert"), "int32 [replica_count]: the slots holding `expert`, ascending.")
      .def("replica_count", &ExpertLocation::replica_count, nb::arg("layer"), nb::arg("expert"))
      .def(
          "set_layer",
          [](ExpertLocation& loc, int layer, nb::handle phy2log) {
            const auto flat = read_ints<int32_t>(phy2log, "phy2log", 1);
            loc.set_layer(layer, flat);
          },
          nb::arg("layer"), nb::arg("phy2log"), "Replaces one layer's placement (int [num_physical]); validated.")
      .def("__eq__", [](const ExpertLocation& a, const ExpertLocation& b) { return a == b; })
      .def("__copy__", [](const ExpertLocation& loc) { return ExpertLocation(loc); })
      .def(
          "__deepcopy__", [](const ExpertLocation& loc, nb::handle) { return ExpertLocation(loc); }, nb::arg("memo"))
      .def("__repr__", [](const ExpertLocation& loc) {
        return "epx.eplb.ExpertLocation(num_layers=" + std::to_string(loc.num_layers()) +
               ", num_logical=" + std::to_string(loc.num_logical()) +
               ", num_physical=" + std::to_string(loc.num_physical()) + ", num_gpus=" + std::to_string(loc.num_gpus()) +
               ", num_nodes=" + std::to_string(loc.num_nodes()) + ")";
      });

  nb::enum_<ReplicaChoice>(m, "ReplicaChoice", "How a token picks one replica of each of its logical experts.")
      .value("static", ReplicaChoice::kStatic, "A local replica if any, else one fixed per (source GPU, expert).")
      .value("dynamic", ReplicaChoice::kDynamic, "Uniform among the replicas, hashed per (seed, layer, token, k).");
  m.def(
      "choose_replicas",
      [](const ExpertLocation& location, int layer, nb::handle topk_logical, int gpu, ReplicaChoice mode, uint64_t seed,
         bool rank_invariant, int64_t first_token) {
        const RoArray array = host_array(topk_logical, "topk_logical", 2);
        const int num_topk = static_cast<int>(array.shape(1));
        const auto logical = values_of<int64_t>(array, "topk_logical", false);
        std::vector<int64_t> physical(logical.size());
        choose_replicas(location, layer, logical, num_topk, physical, gpu, {mode, seed, rank_invariant}, first_token);
        return to_numpy(std::move(physical), {array.shape(0), array.shape(1)});
      },
      nb::arg("location"), nb::arg("layer"), nb::arg("topk_logical"), nb::arg("gpu"),
      nb::arg("mode") = ReplicaChoice::kStatic, nb::arg("seed") = 0, nb::arg("rank_invariant") = false,
      nb::arg("first_token") = 0,
      "int64 [num_tokens, num_topk]: the physical slot of each logical id of topk_logical [num_tokens, num_topk] "
      "(-1 stays -1) for a token on `gpu`.");

  nb::class_<DeviceReplicaTable>(m, "DeviceReplicaTable",
                                 "An ExpertLocation's replica lists on one CUDA device, for choose_replicas on device "
                                 "tensors. Immutable: upload a new one after a rebalance.")
      .def_static(
          "upload",
          [](const ExpertLocation& location, int device, nb::handle stream) {
            nb::gil_scoped_release release;  // the upload waits for its copy
            return std::const_pointer_cast<DeviceReplicaTable>(
                DeviceReplicaTable::upload(location, Device::cuda(device), to_stream(stream)));
          },
          nb::arg("location"), nb::arg("device"), nb::arg("stream") = nb::none())
      .def_prop_ro("num_layers", &DeviceReplicaTable::num_layers)
      .def_prop_ro("num_logical", &DeviceReplicaTable::num_logical)
      .def_prop_ro("num_physical", &DeviceReplicaTable::num_physical)
      .def_prop_ro("num_gpus", &DeviceReplicaTable::num_gpus)
      .def_prop_ro("device", [](const DeviceReplicaTable& t) { return t.device().index; });
  m.def(
      "choose_replicas_device",
      [](const DeviceReplicaTable& table, int layer, nb::handle topk_logical, nb::handle topk_physical, int gpu,
         ReplicaChoice mode, uint64_t seed, bool rank_invariant, int64_t first_token, nb::handle stream) {
        choose_replicas(table, layer, to_view(topk_logical, "topk_logical"), to_view(topk_physical, "topk_physical"),
                        gpu, {mode, seed, rank_invariant}, first_token, to_stream(stream));
      },
      nb::arg("table"), nb::arg("layer"), nb::arg("topk_logical"), nb::arg("topk_physical"), nb::arg("gpu"),
      nb::arg("mode") = ReplicaChoice::kStatic, nb::arg("seed") = 0, nb::arg("rank_invariant") = false,
      nb::arg("first_token") = 0, nb::arg("stream") = nb::none(),
      "Writes topk_physical (the dtype and shape of topk_logical, int32 or int64, on the table's device; may be "
      "topk_logical itself) on `stream`, choosing as choose_replicas does; ids outside [-1, num_logical) give -1.");
}

// ---- recorder and manager -----------------------------------------------------------------------------

// NOTE: LoadRecorder has no shape accessors; utilization_per_layer over the whole buffer returns one value per
// layer and costs O(layers * slots), the same order as the loads it shapes.
size_t num_layers_of(const LoadRecorder& r) {
  return std::max<size_t>(r.utilization_per_layer(std::numeric_limits<int>::max()).size(), 1);
}

void bind_recorder(nb::module_& m) {
  nb::enum_<RecordMode>(m, "RecordMode", "What the load recorder keeps besides per-step counts.")
      .value("stat", RecordMode::kStat, "Per-step counts only.")
      .value("stat_approx", RecordMode::kStatApprox,
             "As stat, for normal-dispatch receive counts rounded up to expert_alignment (SGLang's stat_approx).")
      .value("per_pass", RecordMode::kPerPass, "Also one record per forward pass: id, rank, counts (records()).")
      .value("per_token", RecordMode::kPerToken,
             "Also one record per forward pass with every token's top-k slots per layer (records()).");

  nb::class_<LoadRecorder>(m, "LoadRecorder",
                           "Per-step, per-layer, per-slot expert counts in a ring of buffer_steps steps. Not "
                           "thread-safe: one per rank.")
      .def(
          "__init__",
          [](LoadRecorder* self, int num_layers, int num_logical, int num_physical, int num_gpus, int buffer_steps,
             RecordMode mode, int rank, int64_t max_record_bytes) {
            new (self) LoadRecorder(num_layers, num_logical, num_physical, num_gpus,
                                    {buffer_steps, mode, rank, max_record_bytes});
          },
          nb::arg("num_layers"), nb::arg("num_logical"), nb::arg("num_physical"), nb::arg("num_gpus"),
          nb::arg("buffer_steps") = 1000, nb::arg("mode") = RecordMode::kStat, nb::arg("rank") = 0,
          nb::arg("max_record_bytes") = RecorderOptions{}.max_record_bytes)
      .def(
          "record_pass",
          [](LoadRecorder& r, const ExpertLocation& location, nb::handle physical_counts, int64_t forward_pass_id,
             std::optional<ForwardMode> forward_mode) {
            PassInfo info;
            info.forward_pass_id = forward_pass_id;
            info.forward_mode = forward_mode;
            r.record_pass(location, read_ints<int64_t>(physical_counts, "physical_counts", -1), info);
          },
          nb::arg("location"), nb::arg("physical_counts"), nb::arg("forward_pass_id") = -1,
          nb::arg("forward_mode").none() = nb::none(),
          "Adds one forward pass's counts [num_layers, num_physical] (mapped to experts by location); per_pass mode "
          "also keeps its record (forward_pass_id -1: the previous id + 1, from 1).")
      .def(
          "record_token_pass",
          [](LoadRecorder& r, const ExpertLocation& location, nb::handle topk_ids, int64_t forward_pass_id,
             std::optional<ForwardMode> forward_mode, std::optional<std::vector<int64_t>> input_ids,
             std::optional<std::vector<int64_t>> positions, std::optional<std::vector<int64_t>> extend_seq_lens) {
            const RoArray array = host_array(topk_ids, "topk_ids", 3);
            const auto ids = values_of<int64_t>(array, "topk_ids", false);
            PassInfo info;
            info.forward_pass_id = forward_pass_id;
            info.forward_mode = forward_mode;
            if (input_ids) info.input_ids = std::move(*input_ids);
            if (positions) info.positions = std::move(*positions);
            if (extend_seq_lens) info.extend_seq_lens = std::move(*extend_seq_lens);
            r.record_token_pass(location, ids, static_cast<int64_t>(array.shape(1)), static_cast<int>(array.shape(2)),
                                info);
          },
          nb::arg("location"), nb::arg("topk_ids"), nb::arg("forward_pass_id") = -1,
          nb::arg("forward_mode").none() = nb::none(), nb::arg("input_ids").none() = nb::none(),
          nb::arg("positions").none() = nb::none(), nb::arg("extend_seq_lens").none() = nb::none(),
          "per_token mode: one pass's top-k physical slots of every layer, topk_ids [num_layers, num_tokens, "
          "num_topk] (-1: none); the counts are derived from them. input_ids / positions [num_tokens] and "
          "extend_seq_lens are optional metadata kept in the record.")
      .def("end_step", &LoadRecorder::end_step, "Closes the step; it enters the ring (evicting the oldest).")
      .def_prop_ro("num_steps", &LoadRecorder::num_steps, "Steps closed so far.")
      .def_prop_ro("buffer_steps", &LoadRecorder::buffer_steps)
      .def_prop_ro("steps_in_buffer", &LoadRecorder::steps_in_buffer)
      .def_prop_ro("mode", &LoadRecorder::mode)
      .def(
          "physical_loads",
          [](const LoadRecorder& r, int window) {
            auto v = r.physical_loads(window);
            const size_t num_layers = num_layers_of(r);
            return to_numpy(std::move(v), {num_layers, v.size() / num_layers});
          },
          nb::arg("window"), "int64 [num_layers, num_physical] over the last `window` steps.")
      .def(
          "logical_loads",
          [](const LoadRecorder& r, int window) {
            auto v = r.logical_loads(window);
            const size_t num_layers = num_layers_of(r);
            return to_numpy(std::move(v), {num_layers, v.size() / num_layers});
          },
          nb::arg("window"), "int64 [num_layers, num_logical] over the last `window` steps.")
      .def(
          "utilization_per_layer",
          [](const LoadRecorder& r, int window) {
            auto v = r.utilization_per_layer(window);
            return to_numpy(std::move(v), {v.size()});
          },
          nb::arg("window"), "float64 [num_layers]: (mean GPU load + 1e-5) / (max GPU load + 1e-5).")
      .def("utilization", &LoadRecorder::utilization, nb::arg("window"), "utilization_per_layer averaged over layers.")
      .def(
          "step_utilizations",
          [](const LoadRecorder& r, int window) {
            auto v = r.step_utilizations(window);
            return to_numpy(std::move(v), {v.size()});
          },
          nb::arg("window"),
          "float64 [min(window, available)]: each of the last closed steps' own utilization, oldest first "
          "(SGLang's per-pass balancedness; kept for the last max(1000, buffer_steps) steps).")
      .def("mean_step_utilization", &LoadRecorder::mean_step_utilization, nb::arg("window"),
           "The mean of step_utilizations(window) (SGLang's last_<window>_average_balancedness); 1 before any step.")
      .def_prop_ro("last_step_count_sum", &LoadRecorder::last_step_count_sum,
                   "The last closed step's counts summed (SGLang's gpu_physical_count_sum).")
      .def(
          "records",
          [](const LoadRecorder& r) {
            nb::list out;
            const size_t num_layers = num_layers_of(r);
            for (const PassRecord& p : r.records()) {
              nb::dict d;
              d["forward_pass_id"] = p.forward_pass_id;
              d["rank"] = p.rank;
              d["step"] = p.step;
              d["forward_mode"] = p.forward_mode ? nb::cast(*p.forward_mode) : nb::none();
              const size_t n = p.global_physical_count.size();
              d["global_physical_count"] = to_numpy(p.global_physical_count, {num_layers, n / num_layers});
              if (r.mode() == RecordMode::kPerToken) {
                d["topk_ids_of_layer"] =
                    to_numpy(p.topk_ids, {num_layers, sz(p.num_tokens), static_cast<size_t>(p.num_topk)});
                d["input_ids"] = to_numpy(p.input_ids, {p.input_ids.size()});
                d["positions"] = to_numpy(p.positions, {p.positions.size()});
                d["extend_seq_lens"] = to_numpy(p.extend_seq_lens, {p.extend_seq_lens.size()});
              }
              out.append(d);
            }
            return out;
          },
          "per_pass / per_token mode: the records since construction or clear(), oldest first, as dicts with "
          "SGLang's keys (forward_pass_id, rank, global_physical_count int32 [num_layers, num_physical]; per_token "
          "also topk_ids_of_layer int32 [num_layers, num_tokens, num_topk], input_ids, positions, extend_seq_lens) "
          "plus step and forward_mode (a ForwardMode or None).")
      .def_prop_ro("dropped_passes", &LoadRecorder::dropped_passes,
                   "Passes whose record did not fit in max_record_bytes (their counts still count).")
      .def_prop_ro("record_bytes", &LoadRecorder::record_bytes, "Memory the records take, as max_record_bytes counts.")
      .def("records_json", &LoadRecorder::records_json, nb::arg("last_location"),
           "The records as SGLang's per_pass / per_token dump, in JSON (include/epx/eplb/recorder.h).")
      .def("clear", &LoadRecorder::clear, "Drops everything recorded (num_steps keeps counting).");
}

void bind_manager(nb::module_& m) {
  nb::enum_<GateStatistic>(m, "GateStatistic", "What a due rebalance compares with utilization_threshold.")
      .value("mean_step", GateStatistic::kMeanStepUtilization,
             "SGLang's: the mean of per-step utilizations since the last due rebalance (at most 1000 steps).")
      .value("buffer", GateStatistic::kBufferUtilization,
             "One ratio of the buffer's summed counts (epx's earlier gate; higher on noisy loads).");
  m.def("gate_statistic_from_string", &gate_statistic_from_string, nb::arg("name"),
        "'mean_step' or 'buffer' -> GateStatistic; raises InvalidArgumentError otherwise.");

  nb::class_<RebalanceReport>(m, "RebalanceReport",
                              "What a due rebalance saw and decided (SGLang's [Expert Balancedness] numbers and its "
                              "skip message). Balancedness of counts = (mean GPU load + 1e-5) / (max GPU load + 1e-5) "
                              "per layer, averaged over layers.")
      .def_ro("step", &RebalanceReport::step, "Index of the step at which the rebalance was due.")
      .def_ro("current_step_balancedness", &RebalanceReport::current_step_balancedness,
              "SGLang's current_pass_balancedness: this step's utilization.")
      .def_ro("last_10_average_balancedness", &RebalanceReport::last_10_average_balancedness)
      .def_ro("last_100_average_balancedness", &RebalanceReport::last_100_average_balancedness)
      .def_ro("last_1000_average_balancedness", &RebalanceReport::last_1000_average_balancedness,
              "Means of the last 10/100/1000 steps' utilizations (fewer when fewer were recorded).")
      .def_ro("gpu_physical_count_sum", &RebalanceReport::gpu_physical_count_sum, "This step's counts summed.")
      .def_ro("gate_statistic", &RebalanceReport::gate_statistic)
      .def_ro("gate_window_steps", &RebalanceReport::gate_window_steps, "Steps the gate statistic covered.")
      .def_ro("gate_utilization", &RebalanceReport::gate_utilization, "The gate statistic.")
      .def_ro("threshold", &RebalanceReport::threshold, "utilization_threshold of the manager.")
      .def_ro("skipped", &RebalanceReport::skipped, "gate_utilization > threshold: nothing was computed.")
      .def_ro("placement_balancedness_before", &RebalanceReport::placement_balancedness_before,
              "Balancedness of the placement in force on the buffer's logical loads.")
      .def_ro("placement_balancedness_after", &RebalanceReport::placement_balancedness_after,
              "The same for the new placement (= before when skipped).")
      .def_ro("moved_experts", &RebalanceReport::moved_experts, "Slots the new placement changes (0 when skipped).")
      .def_ro("num_changed_layers", &RebalanceReport::num_changed_layers, "Layers the new placement changes.")
      .def(
          "to_json", [](const RebalanceReport& r) { return to_json(r); },
          "A JSON object with the fields by name (gate_statistic as its name).")
      .def(
          "to_log_line", [](const RebalanceReport& r) { return to_log_line(r); },
          "SGLang's wording in one line: '[Expert Balancedness] forward_pass_id=... [EPLBManager] ...' (the line the "
          "manager logs at info level).")
      .def("__repr__", [](const RebalanceReport& r) {
        return "epx.eplb.RebalanceReport(step=" + std::to_string(r.step) +
               ", gate_utilization=" + std::to_string(r.gate_utilization) +
               ", threshold=" + std::to_string(r.threshold) + ", skipped=" + (r.skipped ? "True" : "False") +
               ", moved_experts=" + std::to_string(r.moved_experts) + ")";
      });

  nb::class_<LayerUpdate>(m, "LayerUpdate", "One layer switched to a new placement: relocate old -> new.")
      .def_ro("layer", &LayerUpdate::layer)
      .def_prop_ro(
          "old_phy2log", [](const LayerUpdate& u) { return to_numpy(u.old_phy2log, {u.old_phy2log.size()}); },
          nb::rv_policy::automatic, "int32 [num_physical]")
      .def_prop_ro(
          "new_phy2log", [](const LayerUpdate& u) { return to_numpy(u.new_phy2log, {u.new_phy2log.size()}); },
          nb::rv_policy::automatic, "int32 [num_physical]");
  nb::class_<StepReport>(m, "StepReport", "What one RebalanceManager.step() did.")
      .def_ro("step", &StepReport::step, "Index of the step just recorded.")
      .def_ro("utilization", &StepReport::utilization,
              "Over the whole buffer (one ratio of summed counts), at this step.")
      .def_ro("step_utilization", &StepReport::step_utilization, "Utilization of this step's own counts.")
      .def_ro("rebalance_computed", &StepReport::rebalance_computed)
      .def_ro("rebalance_due", &StepReport::rebalance_due,
              "A rebalance was considered in this step (computed or skipped): `rebalance` is filled.")
      .def_ro("rebalance", &StepReport::rebalance, "When rebalance_due: what the rebalance saw and decided.")
      .def_ro("rebalance_skipped", &StepReport::rebalance_skipped,
              "A rebalance was due but the gate statistic (SGLang's: mean per-step utilization since the last due "
              "rebalance) was strictly above the threshold.")
      .def_ro("updates", &StepReport::updates, "Layers switched to the new placement in this step.")
      .def_ro("moved_experts", &StepReport::moved_experts, "Slots that changed in `updates`.");

  nb::class_<RebalanceManager>(m, "RebalanceManager",
                               "Records load every forward pass, periodically computes a new placement and applies "
                               "it layers_per_step layers per step. Not thread-safe.")
      .def(
          "__init__",
          [](RebalanceManager* self, const ExpertLocation& initial, int buffer_steps, RecordMode record_mode,
             int num_groups, int rebalance_every_steps, double utilization_threshold, int layers_per_step,
             Policy policy, bool migration_aware, double max_balance_loss, GateStatistic gate_statistic) {
            ManagerOptions options;
            options.num_groups = num_groups;
            options.rebalance_every_steps = rebalance_every_steps;
            options.utilization_threshold = utilization_threshold;
            options.gate_statistic = gate_statistic;
            options.layers_per_step = layers_per_step;
            options.policy = policy;
            options.migration_aware = migration_aware;
            options.migration.max_balance_loss = max_balance_loss;
            new (self) RebalanceManager(initial, {buffer_steps, record_mode}, options);
          },
          nb::arg("initial"), nb::arg("buffer_steps") = 1000, nb::arg("record_mode") = RecordMode::kStat,
          nb::arg("num_groups") = 1, nb::arg("rebalance_every_steps") = 1000, nb::arg("utilization_threshold") = 1.0,
          nb::arg("layers_per_step") = 0, nb::arg("policy") = Policy::kDefault, nb::arg("migration_aware") = true,
          nb::arg("max_balance_loss") = 0.01, nb::arg("gate_statistic") = GateStatistic::kMeanStepUtilization,
          "A due rebalance is skipped only when the gate statistic is strictly above utilization_threshold "
          "(in [0, 1]; 1 = never skip, SGLang's default).")
      .def(
          "step",
          [](RebalanceManager& mgr, nb::handle physical_counts) {
            const auto counts = read_ints<int64_t>(physical_counts, "physical_counts", -1);
            nb::gil_scoped_release release;
            return mgr.step(counts);
          },
          nb::arg("physical_counts"),
          "Once per forward pass: records counts [num_layers, num_physical] under location, closes the step, and "
          "rebalances every rebalance_every_steps steps (unless the gate statistic is strictly above the threshold).")
      .def_prop_ro(
          "location", [](const RebalanceManager& mgr) { return mgr.location(); },
          "A copy of the placement in force (pending layers applied so far).")
      .def_prop_ro(
          "recorder", [](RebalanceManager& mgr) -> LoadRecorder& { return mgr.recorder(); },
          nb::rv_policy::reference_internal, "The manager's own LoadRecorder (lives as long as the manager).")
      .def_prop_ro("num_pending_layers", &RebalanceManager::num_pending_layers)
      .def_prop_ro("num_rebalances", &RebalanceManager::num_rebalances)
      .def_prop_ro("total_moved_experts", &RebalanceManager::total_moved_experts);
}

// ---- dispatch counts ----------------------------------------------------------------------------------

// DispatchCounts plus the shape it was made with (the core class has no accessors for it).
struct PyDispatchCounts : DispatchCounts {
  PyDispatchCounts(int num_layers, int num_physical, int num_gpus, int rank, RecordMode mode)
      : DispatchCounts(num_layers, num_physical, num_gpus, rank, mode),
        num_layers(num_layers),
        num_physical(num_physical),
        num_gpus(num_gpus) {}
  int num_layers, num_physical, num_gpus;
};

// A host copy of int32 cumulative counters: int32 values as they are, uint32 ones (or wider ints in
// [2^31, 2^32)) as the same 32 bits, since only the increase modulo 2^32 counts.
std::vector<int32_t> read_counters(nb::handle obj, const char* name) {
  const auto wide = read_ints<int64_t>(obj, name, 1);
  std::vector<int32_t> out(wide.size());
  for (size_t i = 0; i < wide.size(); ++i) {
    if (wide[i] < std::numeric_limits<int32_t>::min() || wide[i] > std::numeric_limits<uint32_t>::max()) {
      bad(std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(wide[i]) +
          " is not a 32-bit counter value");
    }
    out[i] = static_cast<int32_t>(static_cast<uint32_t>(wide[i]));
  }
  return out;
}

void bind_dispatch_counts(nb::module_& m) {
  nb::class_<PyDispatchCounts>(
      m, "DispatchCounts",
      "One rank's expert counts of a forward pass from what the dispatch reports, in global slot order "
      "[num_layers, num_physical] (include/epx/eplb/dispatch_counts.h). Per pass: add_normal_dispatch or "
      "add_low_latency_cumulative (what this rank received) or add_topk (what its tokens chose; never mixed with "
      "the other two in one pass), then take(), all_reduce_counts over the EP group, RebalanceManager.step. Not "
      "thread-safe; one per rank.")
      .def(nb::init<int, int, int, int, RecordMode>(), nb::arg("num_layers"), nb::arg("num_physical"),
           nb::arg("num_gpus"), nb::arg("rank"), nb::arg("mode") = RecordMode::kStat,
           "Raises InvalidArgumentError for counts < 1, num_physical % num_gpus != 0, rank outside [0, num_gpus) "
           "or mode per_token.")
      .def(
          "add_normal_dispatch",
          [](PyDispatchCounts& c, int layer, nb::handle num_recv_tokens_per_expert, int expert_alignment) {
            const auto counts = read_ints<int32_t>(num_recv_tokens_per_expert, "num_recv_tokens_per_expert", 1);
            c.add_normal_dispatch(layer, counts, expert_alignment);
          },
          nb::arg("layer"), nb::arg("num_recv_tokens_per_expert"), nb::arg("expert_alignment") = 1,
          "The normal dispatch's per-local-expert receive counts [num_physical // num_gpus] of `layer`. With "
          "expert_alignment > 1 (rounded-up counts) only mode stat_approx accepts them, as in SGLang.")
      .def(
          "add_low_latency_cumulative",
          [](PyDispatchCounts& c, int layer, nb::handle cumulative_recv_counts) {
            const auto counts = read_counters(cumulative_recv_counts, "cumulative_recv_counts");
            c.add_low_latency_cumulative(layer, counts);
          },
          nb::arg("layer"), nb::arg("cumulative_recv_counts"),
          "A host copy of the low-latency dispatch's int32 cumulative receive counters [num_physical // num_gpus] "
          "of `layer`: adds the increase since the last call for the layer, modulo 2^32.")
      .def(
          "reset_low_latency_baseline", [](PyDispatchCounts& c, int layer) { c.reset_low_latency_baseline(layer); },
          nb::arg("layer"), "After zeroing a layer's counters: the next call adds the values themselves.")
      .def(
          "add_topk",
          [](PyDispatchCounts& c, int layer, nb::handle topk_physical) {
            c.add_topk(layer, read_ints<int64_t>(topk_physical, "topk_physical", -1));
          },
          nb::arg("layer"), nb::arg("topk_physical"),
          "The physical slots this rank's tokens chose in `layer` ([num_tokens, num_topk], -1 ignored).")
      .def(
          "take",
          [](PyDispatchCounts& c) {
            return to_numpy(c.take(), {sz(c.num_layers), sz(c.num_physical)});
          },
          "int64 [num_layers, num_physical]: this rank's counts of the pass; starts the next pass.")
      .def_prop_ro("rank", [](const PyDispatchCounts& c) { return c.rank(); })
      .def_prop_ro("mode", [](const PyDispatchCounts& c) { return c.mode(); })
      .def_ro("num_layers", &PyDispatchCounts::num_layers)
      .def_ro("num_physical", &PyDispatchCounts::num_physical)
      .def_ro("num_gpus", &PyDispatchCounts::num_gpus);

  m.def(
      "all_reduce_counts",
      [](std::shared_ptr<Group> group, nb::handle counts) {
        struct Args {
          std::vector<int64_t> values;
          std::vector<size_t> shape;
        };
        // NOTE: converted inside `collective`: a rank whose counts do not convert still joins with none, which
        // every rank rejects as a size mismatch (so no peer pairs this call with the rank's next one).
        Args out = collective<Args>(
            [&](Args& a) {
              const RoArray array = host_array(counts, "counts", -1);
              a.values = values_of<int64_t>(array, "counts", false);
              for (size_t d = 0; d < array.ndim(); ++d) a.shape.push_back(array.shape(d));
            },
            [&](Args a) {
              all_reduce_counts(*group, a.values);
              return a;
            });
        return to_numpy_shaped(std::move(out.values), out.shape);
      },
      nb::arg("group"), nb::arg("counts"),
      "Collective over `group` (host or cuda): int64 counts of the same shape, summed element-wise over the ranks "
      "in rank order, on every rank (the input is not modified). Every rank raises InvalidArgumentError for "
      "counts of different sizes on different ranks, a negative count or a sum above INT64_MAX; a wrong-typed "
      "`counts` raises on this rank after it joined with no counts (its peers then see the size mismatch). GIL "
      "released.");
}

// ---- SGLang's EPLB files ------------------------------------------------------------------------------

void bind_sglang_format(nb::module_& m) {
  nb::class_<SglangLogicalCount>(m, "SglangLogicalCount",
                                 "SGLang's logical_count summed over its passes (include/epx/eplb/sglang_format.h).")
      .def_ro("num_passes", &SglangLogicalCount::num_passes, "First dimension of a 3-D logical_count; 1 for 2-D.")
      .def_ro("num_layers", &SglangLogicalCount::num_layers)
      .def_ro("num_logical", &SglangLogicalCount::num_logical)
      .def_prop_ro(
          "counts",
          [](const SglangLogicalCount& c) {
            return to_numpy(c.counts, {sz(c.num_layers), sz(c.num_logical)});
          },
          nb::rv_policy::automatic, "int64 [num_layers, num_logical]: the sum over passes (a copy).")
      .def_ro("rank", &SglangLogicalCount::rank, "The dump's 'rank', or None.")
      .def_ro("average_utilization_rate_over_window", &SglangLogicalCount::average_utilization_rate_over_window,
              "The dump's value, or None (SGLang writes None unless its metrics and a threshold below 1 are on).");
  m.def("parse_sglang_logical_count", &parse_sglang_logical_count, nb::arg("json_text"),
        "Parses SGLang's {\"logical_count\": 2-D or 3-D, ...}; raises InvalidArgumentError naming the field.");
  m.def(
      "to_sglang_logical_count_json",
      [](nb::handle logical_count) {
        const RoArray array = host_array(logical_count, "logical_count", 2);
        return to_sglang_logical_count_json(values_of<int64_t>(array, "logical_count", false),
                                            static_cast<int>(array.shape(0)));
      },
      nb::arg("logical_count"),
      "{\"logical_count\": [[...] per layer]} of integer counts [num_layers, num_logical] (>= 0): a file SGLang's "
      "--init-expert-location accepts.");

  nb::class_<SglangExpertLocation>(m, "SglangExpertLocation", "SGLang's physical_to_logical_map.")
      .def_ro("num_layers", &SglangExpertLocation::num_layers)
      .def_ro("num_physical", &SglangExpertLocation::num_physical)
      .def_ro("num_logical_seen", &SglangExpertLocation::num_logical_seen,
              "The largest id + 1 (the file does not say num_logical).")
      .def_prop_ro(
          "phy2log",
          [](const SglangExpertLocation& l) {
            return to_numpy(l.phy2log, {sz(l.num_layers), sz(l.num_physical)});
          },
          nb::rv_policy::automatic, "int32 [num_layers, num_physical] (a copy).");
  m.def("parse_sglang_expert_location", &parse_sglang_expert_location, nb::arg("json_text"),
        "Parses SGLang's {\"physical_to_logical_map\": [[...]]}; raises InvalidArgumentError naming the field.");
  m.def(
      "to_sglang_expert_location_json",
      [](nb::handle phy2log) {
        auto [flat, num_physical] = read_phy2log(phy2log, "phy2log");
        const int num_layers = num_physical > 0 ? static_cast<int>(flat.size() / num_physical) : 0;
        return to_sglang_expert_location_json(flat, num_layers);
      },
      nb::arg("phy2log"),
      "{\"physical_to_logical_map\": [[...] per layer]} of phy2log [num_layers, num_physical], the only key (as "
      "SGLang's --init-expert-location needs).");
}

// ---- relocation ---------------------------------------------------------------------------------------

// One weight tensor of a rank: a C-contiguous host array [num_slots, ...] of any dtype.
struct SlotArray {
  void* data = nullptr;
  size_t bytes_per_slot = 0;
};

SlotArray slot_array(nb::handle obj, const std::string& name, int num_slots, bool cuda) {
  void* data = nullptr;
  size_t nbytes = 0, slots = 0;
  bool ok = false;
  if (cuda) {
    nb::ndarray<nb::device::cuda, nb::c_contig> array;
    ok = nb::try_cast(obj, array, /*convert=*/false) && array.ndim() >= 1;  // no silent copy of an output
    if (ok) data = array.data(), nbytes = array.nbytes(), slots = array.shape(0);
  } else {
    nb::ndarray<nb::device::cpu, nb::c_contig> array;
    ok = nb::try_cast(obj, array, /*convert=*/false) && array.ndim() >= 1;
    if (ok) data = array.data(), nbytes = array.nbytes(), slots = array.shape(0);
  }
  if (!ok) {
    bad(name + ": expected a writable, C-contiguous " + (cuda ? "CUDA" : "host") + " array [slots, ...], got " +
        nb::cast<std::string>(nb::type_name(obj.type())));
  }
  if (slots != static_cast<size_t>(num_slots)) {
    bad(name + ": " + std::to_string(slots) + " slots, the plan has " + std::to_string(num_slots));
  }
  return {data, num_slots > 0 ? nbytes / static_cast<size_t>(num_slots) : 0};
}

void bind_relocation(nb::module_& m) {
  nb::enum_<SlotAction>(m, "SlotAction", "How a destination slot gets its weights.")
      .value("unchanged", SlotAction::kUnchanged)
      .value("local_copy", SlotAction::kLocalCopy)
      .value("same_round_copy", SlotAction::kSameRoundCopy)
      .value("peer_intra_node", SlotAction::kPeerIntraNode)
      .value("peer_inter_node", SlotAction::kPeerInterNode)
      .value("lost", SlotAction::kLost, "Every old replica sat on a failed rank: the caller must reload it.")
      .value("dead_rank", SlotAction::kDeadRank, "The destination rank failed: nothing is done for it.");

  nb::class_<SlotPlan>(m, "SlotPlan", "The plan of one destination slot.")
      .def_ro("action", &SlotPlan::action)
      .def_ro("expert", &SlotPlan::expert, "Logical expert the slot must hold.")
      .def_ro("src_rank", &SlotPlan::src_rank)
      .def_ro("src_slot", &SlotPlan::src_slot, "Local slot index on src_rank (an old slot, or a new one).")
      .def("__repr__", [](const SlotPlan& s) {
        return std::string("SlotPlan(") + to_string(s.action) + ", expert=" + std::to_string(s.expert) +
               ", src_rank=" + std::to_string(s.src_rank) + ", src_slot=" + std::to_string(s.src_slot) + ")";
      });

  nb::class_<RelocationPlan>(m, "RelocationPlan", "How every destination slot of one layer gets its weights.")
      .def_ro("num_ranks", &RelocationPlan::num_ranks)
      .def_ro("num_nodes", &RelocationPlan::num_nodes)
      .def_ro("old_slots_per_rank", &RelocationPlan::old_slots_per_rank)
      .def_ro("new_slots_per_rank", &RelocationPlan::new_slots_per_rank)
      .def_ro("slots", &RelocationPlan::slots, "[num_ranks * new_slots_per_rank] SlotPlan, by destination slot.")
      .def_prop_ro(
          "lost_experts", [](const RelocationPlan& p) { return to_numpy(p.lost_experts, {p.lost_experts.size()}); },
          nb::rv_policy::automatic, "int32, ascending: experts whose every old replica sat on a failed rank.")
      .def("count", &RelocationPlan::count, nb::arg("action"))
      .def_prop_ro("num_transfers", &RelocationPlan::num_transfers, "Destination slots whose weights cross ranks.");

  m.def(
      "plan_relocation",
      [](nb::handle old_phy2log, nb::handle new_phy2log, int num_ranks, int num_nodes,
         const std::vector<bool>& failed_ranks) {
        const auto old_flat = read_ints<int32_t>(old_phy2log, "old_phy2log", 1);
        const auto new_flat = read_ints<int32_t>(new_phy2log, "new_phy2log", 1);
        return plan_relocation(old_flat, new_flat, num_ranks, num_nodes, failed_ranks);
      },
      nb::arg("old_phy2log"), nb::arg("new_phy2log"), nb::arg("num_ranks"), nb::arg("num_nodes") = 1,
      nb::arg("failed_ranks") = std::vector<bool>{},
      "Plans one layer: old_phy2log [num_ranks * old_slots_per_rank] -> new_phy2log [num_ranks * "
      "new_slots_per_rank]. failed_ranks: empty or one bool per rank.");

  nb::class_<RelocationStats>(m, "RelocationStats", "What relocate_weights() moved on this rank.")
      .def_ro("num_rounds", &RelocationStats::num_rounds)
      .def_ro("slots_received", &RelocationStats::slots_received)
      .def_ro("slots_sent", &RelocationStats::slots_sent)
      .def_ro("local_copies", &RelocationStats::local_copies)
      .def_ro("bytes_received", &RelocationStats::bytes_received)
      .def_ro("bytes_sent", &RelocationStats::bytes_sent);

  m.def(
      "relocate_weights",
      [](const RelocationPlan& plan, std::shared_ptr<Group> group, const std::vector<nb::handle>& old_slots,
         const std::vector<nb::handle>& new_slots, int max_slots_per_round, const std::vector<bool>& failed_ranks,
         size_t staging_bytes, const std::string& transport) {
        const TransportKind kind = transport_kind_from_string(transport);
        if (old_slots.size() != new_slots.size()) {
          bad("old_slots and new_slots: " + std::to_string(old_slots.size()) + " and " +
              std::to_string(new_slots.size()) + " tensors, must be equal");
        }
        const bool cuda = group->backend() == Backend::kCuda;
        if (cuda && !failed_ranks.empty())
          bad("failed_ranks: the cuda transports have no failed-rank mode (host only)");
        if (cuda && kind == TransportKind::kHost) bad("transport: 'host' needs a host group, got a cuda group");
        if (!cuda && kind != TransportKind::kAuto && kind != TransportKind::kHost) {
          bad("transport: '" + transport + "' needs a cuda group, got a host group (use 'auto' or 'host')");
        }
        ExpertWeights weights;
        for (size_t i = 0; i < old_slots.size(); ++i) {
          const std::string old_name = "old_slots[" + std::to_string(i) + "]";
          const std::string new_name = "new_slots[" + std::to_string(i) + "]";
          const SlotArray old_array = slot_array(old_slots[i], old_name, plan.old_slots_per_rank, cuda);
          const SlotArray new_array = slot_array(new_slots[i], new_name, plan.new_slots_per_rank, cuda);
          if (old_array.bytes_per_slot != new_array.bytes_per_slot) {
            bad(new_name + ": " + std::to_string(new_array.bytes_per_slot) + " bytes per slot, " + old_name + " has " +
                std::to_string(old_array.bytes_per_slot));
          }
          weights.old_slots.push_back(old_array.data);
          weights.new_slots.push_back(new_array.data);
          weights.bytes_per_slot.push_back(old_array.bytes_per_slot);
        }
        nb::gil_scoped_release release;
        auto mover = cuda ? make_transport_for(*group, kind, staging_bytes) : make_host_transport(*group, failed_ranks);
        RelocationOptions options;
        options.max_slots_per_round = max_slots_per_round;
        return relocate_weights(plan, weights, *mover, options);
      },
      nb::arg("plan"), nb::arg("group"), nb::arg("old_slots"), nb::arg("new_slots"), nb::arg("max_slots_per_round") = 8,
      nb::arg("failed_ranks") = std::vector<bool>{}, nb::arg("staging_bytes") = size_t{64} << 20,
      nb::arg("transport") = "auto",
      "Executes `plan` for group.rank: host groups over the host transport (host arrays; collective over live "
      "ranks), cuda groups (CUDA arrays of the rank's GPU) over transport 'cuda' (copy engines through a staging "
      "region of staging_bytes per rank; GPUs with peer access), 'nccl' (send/recv on the group's communicator; one "
      "process per GPU, any hosts) or 'auto' (choose_transport). old_slots[i] [old_slots_per_rank, ...] and "
      "new_slots[i] [new_slots_per_rank, ...]: contiguous, disjoint or identical (in place). GIL released.");

  m.def(
      "choose_transport",
      [](std::shared_ptr<Group> group) {
        nb::gil_scoped_release release;
        return std::string(to_string(choose_transport(*group)));
      },
      nb::arg("group"),
      "'host', 'cuda' or 'nccl': the transport relocate_weights(transport='auto') uses for `group` (collective for "
      "a cuda group of one process per GPU). GIL released.");
}

// ---- synthetic loads ----------------------------------------------------------------------------------

void bind_synthetic(nb::module_& m) {
  m.def(
      "zipf_loads",
      [](int num_layers, int num_logical, double exponent, double total_per_layer, uint64_t seed) {
        const auto rows = zipf_loads(num_layers, num_logical, exponent, total_per_layer, seed);
        std::vector<double> flat;
        flat.reserve(sz(num_layers) * sz(num_logical));
        for (const auto& row : rows) flat.insert(flat.end(), row.begin(), row.end());
        return to_numpy(std::move(flat), {sz(num_layers), sz(num_logical)});
      },
      nb::arg("num_layers"), nb::arg("num_logical"), nb::arg("exponent"), nb::arg("total_per_layer"), nb::arg("seed"),
      "float64 [num_layers, num_logical]: Zipf(exponent) popularity over a random expert order per layer.");

  nb::class_<DriftingZipf>(m, "DriftingZipf",
                           "A Zipf load whose popularity order drifts (adjacent swaps with probability `drift` per "
                           "advance()). Deterministic for a seed.")
      .def(nb::init<int, int, double, double, double, uint64_t>(), nb::arg("num_layers"), nb::arg("num_logical"),
           nb::arg("exponent"), nb::arg("tokens_per_step"), nb::arg("drift"), nb::arg("seed"))
      .def(
          "expected",
          [](const DriftingZipf& z) {
            const auto rows = z.expected();
            std::vector<double> flat;
            for (const auto& row : rows) flat.insert(flat.end(), row.begin(), row.end());
            const size_t cols = rows.empty() ? 0 : rows[0].size();
            return to_numpy(std::move(flat), {rows.size(), cols});
          },
          "float64 [num_layers, num_logical]: expected load at the current step.")
      .def(
          "sample",
          [](DriftingZipf& z) {
            const size_t num_layers = z.expected().size();  // NOTE: no accessor; O(layers * experts), like sample()
            auto v = z.sample();
            return to_numpy(std::move(v), {num_layers, v.size() / num_layers});
          },
          "int64 [num_layers, num_logical]: one step's counts (expected + noise).")
      .def("advance", &DriftingZipf::advance);
}

}  // namespace

void register_eplb(nb::module_& parent) {
  nb::module_ m = parent.def_submodule("eplb", "Expert-parallel load balancing (include/epx/eplb/*.h).");
  bind_placement(m);
  bind_location(m);
  bind_recorder(m);
  bind_manager(m);
  bind_dispatch_counts(m);
  bind_sglang_format(m);
  bind_relocation(m);
  bind_synthetic(m);
}

}  // namespace epx::py

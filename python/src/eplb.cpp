// EPLB bindings: placement, balancedness, ExpertLocation (+ JSON), replica choice, SGLang's EPLB files and the
// synthetic loads here; the load recorder and the rebalance manager (+ its gate and per-rebalance report) in
// eplb_recorder.cpp; dispatch counts and their all-reduce, relocation plans (+ the host-transport executor) in
// eplb_relocation.cpp. Arrays in and out: eplb.h.
#include "eplb.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bind.h"
#include "epx/eplb/device_replicas.h"
#include "epx/eplb/expert_location.h"
#include "epx/eplb/placement.h"
#include "epx/eplb/sglang_format.h"
#include "epx/eplb/synthetic.h"
#include "epx/error.h"

namespace epx::py {
namespace eplb_bind {

using namespace epx::eplb;

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
            const Stream s = to_stream(stream);  // Python (a torch stream's .cuda_stream): with the GIL
            nb::gil_scoped_release release;      // the upload waits for its copy
            return std::const_pointer_cast<DeviceReplicaTable>(
                DeviceReplicaTable::upload(location, Device::cuda(device), s));
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

}  // namespace eplb_bind

void register_eplb(nb::module_& parent) {
  using namespace eplb_bind;
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

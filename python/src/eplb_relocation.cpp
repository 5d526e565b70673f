// EPLB bindings of the dispatch counts and their all-reduce, and of relocation plans (+ the host-transport
// executor). Arrays in and out: eplb.h; collective arguments: collective.h.
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "bind.h"
#include "collective.h"
#include "eplb.h"
#include "epx/eplb/dispatch_counts.h"
#include "epx/eplb/expert_location.h"
#include "epx/eplb/recorder.h"
#include "epx/eplb/relocation.h"
#include "epx/error.h"
#include "epx/group.h"

namespace epx::py::eplb_bind {

using namespace epx::eplb;

namespace {

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

}  // namespace

// ---- dispatch counts ----------------------------------------------------------------------------------

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

}  // namespace epx::py::eplb_bind

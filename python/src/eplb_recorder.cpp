// EPLB bindings of the load recorder and the rebalance manager (+ its gate and per-rebalance report). Arrays in
// and out: eplb.h.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "bind.h"
#include "eplb.h"
#include "epx/eplb/expert_location.h"
#include "epx/eplb/manager.h"
#include "epx/eplb/placement.h"
#include "epx/eplb/recorder.h"
#include "epx/error.h"
#include "epx/forward_mode.h"

namespace epx::py::eplb_bind {

using namespace epx::eplb;

namespace {

// NOTE: LoadRecorder has no shape accessors; utilization_per_layer over the whole buffer returns one value per
// layer and costs O(layers * slots), the same order as the loads it shapes.
size_t num_layers_of(const LoadRecorder& r) {
  return std::max<size_t>(r.utilization_per_layer(std::numeric_limits<int>::max()).size(), 1);
}

}  // namespace

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

}  // namespace epx::py::eplb_bind

// Buffer bindings: normal and low-latency dispatch/combine, the rank mask, size hints.
// Every call that may wait on a peer or the device releases the GIL, so rank threads run in parallel.
#include "epx/buffer.h"

#include <nanobind/stl/function.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <limits>
#include <string>

#include "bind.h"
#include "collective.h"
#include "epx/error.h"

namespace epx::py {
namespace {

// The receive hook as a Python callable. It keeps alive what its kernel still uses when it runs: the Buffer (the C++
// hook refers to its engine) and the call's arguments and outputs in `keep` (the receive reads the routing and the
// weights, writes the output and adds into the statistics tensors; a caller that dropped one before calling the hook
// would let its memory be reused under the kernel).
nb::object hook_of(std::function<void()> hook, Buffer& buffer, std::vector<nb::object> keep) {
  if (!hook) return nb::none();
  auto shared = std::make_shared<std::function<void()>>(std::move(hook));
  keep.push_back(nb::find(&buffer));
  return nb::cpp_function([shared, keep = std::move(keep)]() {
    nb::gil_scoped_release release;
    (*shared)();
  });
}

nb::object kept(nb::handle h) { return nb::borrow<nb::object>(h); }

// Destroying a buffer waits for its peers (on the cuda backend a device sync and a barrier of the group): it must not
// hold the GIL, or the other rank threads of this process could not reach their own destruction (each would wait out
// the timeout). nanobind drops its reference with the GIL held; other last owners may not hold it.
std::shared_ptr<Buffer> released_on_destroy(std::unique_ptr<Buffer> buffer) {
  return std::shared_ptr<Buffer>(buffer.release(), [](Buffer* b) {
    if (PyGILState_Check() != 0) {
      nb::gil_scoped_release release;
      delete b;
    } else {
      delete b;
    }
  });
}

Tensor as_tensor(nb::handle obj, const char* name) { return Tensor::wrap(to_view(obj, name), nullptr); }

nb::dict dispatch(Buffer& buffer, nb::handle x, nb::handle x_scales, nb::handle topk_idx, nb::handle topk_weights,
                  nb::handle num_experts, nb::handle layout, nb::handle handle, nb::handle expert_alignment,
                  nb::handle num_worst_tokens, nb::handle num_sms, nb::handle stream) {
  Layout given;
  DispatchResult r = collective<DispatchArgs>(
      [&](DispatchArgs& a) {
        a.x = to_view(x, "x");
        a.x_scales = to_view(x_scales, "x_scales");
        a.topk_idx = to_view(topk_idx, "topk_idx");
        a.topk_weights = to_view(topk_weights, "topk_weights");
        a.num_experts = to_int<int64_t>(num_experts, "num_experts");
        if (!layout.is_none()) {
          if (!nb::isinstance<nb::tuple>(layout)) {
            wrong_type("layout", "an epx.Layout (natively: the tuple of its 3 or 4 tensors) or None", layout);
          }
          auto parts = nb::borrow<nb::tuple>(layout);
          if (parts.size() != 3 && parts.size() != 4) {
            throw Error(ErrorCode::kInvalidArgument,
                        "layout: expected (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank[, "
                        "num_tokens_per_node])");
          }
          given.num_tokens_per_rank = as_tensor(parts[0], "layout.num_tokens_per_rank");
          given.num_tokens_per_expert = as_tensor(parts[1], "layout.num_tokens_per_expert");
          given.is_token_in_rank = as_tensor(parts[2], "layout.is_token_in_rank");
          if (parts.size() == 4 && !parts[3].is_none()) {
            given.num_tokens_per_node = as_tensor(parts[3], "layout.num_tokens_per_node");
          }
          a.layout = &given;
        }
        a.handle = to_handle<DispatchHandle>(handle, "handle", "an epx.DispatchHandle or None");
        a.expert_alignment = to_int<int>(expert_alignment, "expert_alignment");
        a.num_worst_tokens = to_int<int64_t>(num_worst_tokens, "num_worst_tokens");
        a.num_sms = to_int<int>(num_sms, "num_sms");
        a.stream = to_stream(stream);
      },
      [&](const DispatchArgs& a) { return buffer.dispatch(a); });
  nb::dict out;
  out["recv_x"] = from_tensor(r.recv_x);
  out["recv_x_scales"] = from_tensor(r.recv_x_scales);
  out["recv_topk_idx"] = from_tensor(r.recv_topk_idx);
  out["recv_topk_weights"] = from_tensor(r.recv_topk_weights);
  out["recv_src_idx"] = from_tensor(r.recv_src_idx);
  out["num_recv_tokens_per_expert"] = nb::cast(r.num_recv_tokens_per_expert);
  out["recv_expert_counts"] = from_tensor(r.recv_expert_counts);
  out["rank_prefix_matrix"] = from_tensor(r.rank_prefix_matrix);
  out["handle"] = nb::cast(std::shared_ptr<const DispatchHandle>(r.handle));
  return out;
}

nb::dict combine(Buffer& buffer, nb::handle x, nb::handle topk_weights, nb::handle bias_0, nb::handle bias_1,
                 nb::handle handle, nb::handle num_sms, nb::handle stream, nb::handle order_topk_idx) {
  CombineResult r = collective<CombineArgs>(
      [&](CombineArgs& a) {
        a.x = to_view(x, "x");
        a.topk_weights = to_view(topk_weights, "topk_weights");
        a.bias_0 = to_view(bias_0, "bias_0");
        a.bias_1 = to_view(bias_1, "bias_1");
        a.order_topk_idx = to_view(order_topk_idx, "order_topk_idx");
        a.handle = to_handle<DispatchHandle>(handle, "handle", "an epx.DispatchHandle");
        a.num_sms = to_int<int>(num_sms, "num_sms");
        a.stream = to_stream(stream);
      },
      [&](const CombineArgs& a) { return buffer.combine(a); });
  nb::dict out;
  out["x"] = from_tensor(r.x);
  out["topk_weights"] = from_tensor(r.topk_weights);
  return out;
}

nb::dict low_latency_dispatch(Buffer& buffer, nb::handle x, nb::handle topk_idx, nb::handle max_tokens_per_rank,
                              nb::handle num_experts, nb::handle use_fp8, nb::handle scale_format,
                              nb::handle round_scale, nb::handle scale_layout, nb::handle return_recv_hook,
                              nb::handle cumulative_recv_counts, nb::handle wait_recv_cost_ns, nb::handle stream) {
  LowLatencyDispatchResult r = collective<LowLatencyDispatchArgs>(
      [&](LowLatencyDispatchArgs& a) {
        a.x = to_view(x, "x");
        a.topk_idx = to_view(topk_idx, "topk_idx");
        a.max_tokens_per_rank = to_int<int64_t>(max_tokens_per_rank, "max_tokens_per_rank");
        a.num_experts = to_int<int64_t>(num_experts, "num_experts");
        a.use_fp8 = to_bool(use_fp8, "use_fp8");
        a.scale_format = to_enum<ScaleFormat>(scale_format, "scale_format", "an epx.ScaleFormat");
        a.round_scale = to_bool(round_scale, "round_scale");
        a.scale_layout = to_enum<ScaleLayout>(scale_layout, "scale_layout", "an epx.ScaleLayout");
        a.return_recv_hook = to_bool(return_recv_hook, "return_recv_hook");
        a.cumulative_recv_counts = to_view(cumulative_recv_counts, "cumulative_recv_counts");
        a.wait_recv_cost_ns = to_view(wait_recv_cost_ns, "wait_recv_cost_ns");
        a.stream = to_stream(stream);
      },
      [&](const LowLatencyDispatchArgs& a) { return buffer.low_latency_dispatch(a); });
  nb::dict out;
  out["recv_x"] = from_tensor(r.recv_x);
  out["recv_x_scales"] = from_tensor(r.recv_x_scales);
  out["recv_count"] = from_tensor(r.recv_count);
  out["recv_src_info"] = from_tensor(r.recv_src_info);
  out["recv_layout_range"] = from_tensor(r.recv_layout_range);
  out["handle"] = nb::cast(std::shared_ptr<const LowLatencyHandle>(r.handle));
  out["recv_hook"] =
      hook_of(std::move(r.recv_hook), buffer,
              {kept(x), kept(topk_idx), kept(cumulative_recv_counts), kept(wait_recv_cost_ns), out["recv_x"],
               out["recv_x_scales"], out["recv_count"], out["recv_src_info"], out["recv_layout_range"], out["handle"]});
  return out;
}

nb::dict low_latency_combine(Buffer& buffer, nb::handle x, nb::handle topk_idx, nb::handle topk_weights,
                             nb::handle handle, nb::handle return_recv_hook, nb::handle out_arg,
                             nb::handle wait_recv_cost_ns, nb::handle stream) {
  LowLatencyCombineResult r = collective<LowLatencyCombineArgs>(
      [&](LowLatencyCombineArgs& a) {
        a.x = to_view(x, "x");
        a.topk_idx = to_view(topk_idx, "topk_idx");
        a.topk_weights = to_view(topk_weights, "topk_weights");
        a.handle = to_handle<LowLatencyHandle>(handle, "handle", "an epx.LowLatencyHandle");
        a.return_recv_hook = to_bool(return_recv_hook, "return_recv_hook");
        a.out = to_view(out_arg, "out");
        a.wait_recv_cost_ns = to_view(wait_recv_cost_ns, "wait_recv_cost_ns");
        a.stream = to_stream(stream);
      },
      [&](const LowLatencyCombineArgs& a) { return buffer.low_latency_combine(a); });
  nb::dict out;
  out["x"] = from_tensor(r.x);
  out["recv_hook"] = hook_of(
      std::move(r.recv_hook), buffer,
      {kept(x), kept(topk_idx), kept(topk_weights), kept(handle), kept(out_arg), kept(wait_recv_cost_ns), out["x"]});
  return out;
}

}  // namespace

void register_buffer(nb::module_& m) {
  nb::class_<DispatchHandle>(m, "DispatchHandle",
                             "Opaque record of one normal dispatch: pass it to combine, or to dispatch (cached mode).")
      .def_prop_ro("num_tokens", &DispatchHandle::num_tokens, "T of the dispatching rank.")
      .def_prop_ro("num_recv_tokens", &DispatchHandle::num_recv_tokens,
                   "Rows received; -1 in worst-token mode on the cuda backend.")
      .def_prop_ro(
          "rank_prefix_matrix", [](const DispatchHandle& h) { return from_tensor(h.rank_prefix_matrix()); },
          "(array, DType): int32 [R, R], [i][j] = tokens that ranks 0..i send to rank j (DeepEP's meaning).");
  nb::class_<LowLatencyHandle>(m, "LowLatencyHandle", "Opaque record of one low-latency dispatch (for its combine).");

  // The cuda backend's rank caps (epx/buffer.h): flat / hierarchical routing, normal / low-latency path.
  m.attr("CUDA_FLAT_NORMAL_MAX_RANKS") = kCudaFlatNormalMaxRanks;
  m.attr("CUDA_NORMAL_MAX_RANKS") = kCudaNormalMaxRanks;
  m.attr("CUDA_FLAT_LOW_LATENCY_MAX_RANKS") = kCudaFlatLowLatencyMaxRanks;
  m.attr("CUDA_LOW_LATENCY_MAX_RANKS") = kCudaLowLatencyMaxRanks;
  m.def("low_latency_buffer_size_hint", &low_latency_buffer_size_hint, nb::arg("max_tokens_per_rank"),
        nb::arg("hidden"), nb::arg("num_ranks"), nb::arg("num_experts"),
        "Bytes of peer memory the low-latency path needs for two buffer sets with these limits.");
  m.def("normal_buffer_size_hint", &normal_buffer_size_hint, nb::arg("hidden"), nb::arg("num_ranks"),
        nb::arg("num_sms"), nb::arg("max_tokens_per_rank") = 0,
        "Bytes of peer memory the normal path needs (copy-engine path up to max_tokens_per_rank when > 0).");

  // NOTE: the collective calls take every argument as nb::handle, and arg() lets None through too (see
  // `collective`), so nanobind rejects nothing but a wrong number or name of arguments before the binding
  // runs; nb::sig keeps the types a caller should pass in help() and the stubs.
  const auto arg = [](const char* name) { return nb::arg(name).none(); };
  nb::enum_<EarlyCopies>(m, "EarlyCopies",
                         "When a fresh two-rank dispatch starts copying its whole x to the peer "
                         "(NormalConfig.early_copies, docs/normal-kernels.md): auto (before notify when x fits the "
                         "staging and the peer is expected to need >= 15/16 of the tokens), always (whenever x fits), "
                         "never (after notify). Results are the same in every mode.")
      .value("auto", EarlyCopies::kAuto)
      .value("always", EarlyCopies::kAlways)
      .value("never", EarlyCopies::kNever);
  nb::class_<NormalConfig>(
      m, "NormalConfig",
      "Tuning of the cuda backend's normal kernels (BufferOptions::normal in include/epx/buffer.h); "
      "the same on every rank except stage_timeline and early_copies.")
      .def(nb::init<>())
      .def_rw("copy_engines", &NormalConfig::copy_engines)
      .def_rw("whole_copies", &NormalConfig::whole_copies)
      .def_rw("stream_signals", &NormalConfig::stream_signals)
      .def_rw("max_copy_chunks", &NormalConfig::max_copy_chunks)
      .def_rw("stage_timeline", &NormalConfig::stage_timeline)
      .def_rw("early_copies", &NormalConfig::early_copies);
  nb::class_<LowLatencyConfig>(m, "LowLatencyConfig",
                               "Tuning of the cuda backend's low-latency kernels (BufferOptions::low_latency); the "
                               "same on every rank.")
      .def(nb::init<>())
      .def_rw("combine_send_parts", &LowLatencyConfig::combine_send_parts)
      .def_rw("combine_solo_max_rows", &LowLatencyConfig::combine_solo_max_rows)
      .def_rw("token_rows_min_tokens", &LowLatencyConfig::token_rows_min_tokens)
      .def_rw("programmatic_launch", &LowLatencyConfig::programmatic_launch)
      .def_rw("expert_side_reduction", &LowLatencyConfig::expert_side_reduction)
      .def_rw("raise_on_timeout", &LowLatencyConfig::raise_on_timeout,
              "A rank that does not come within the timeout is masked either way; True: the round's combine (cuda: "
              "that round's or the next) also raises epx.TimeoutError naming it, once enqueued. Per rank.");
  nb::enum_<NormalRouting>(m, "NormalRouting",
                           "Which way normal dispatch/combine move tokens (BufferOptions::normal_routing, "
                           "docs/internode.md): auto (hierarchical when the group's topology has more than one "
                           "node), flat, or hierarchical. The same on every rank.")
      .value("auto", NormalRouting::kAuto)
      .value("flat", NormalRouting::kFlat)
      .value("hierarchical", NormalRouting::kHierarchical);
  nb::enum_<LowLatencyRouting>(m, "LowLatencyRouting",
                               "Which way low-latency dispatch/combine move (token, expert) pairs "
                               "(BufferOptions::low_latency_routing, docs/internode.md): auto (hierarchical when the "
                               "group's topology has more than one node), flat, or hierarchical (both backends). The "
                               "same on every rank.")
      .value("auto", LowLatencyRouting::kAuto)
      .value("flat", LowLatencyRouting::kFlat)
      .value("hierarchical", LowLatencyRouting::kHierarchical);
  nb::enum_<NodePartials>(m, "NodePartials",
                          "How the hierarchical routings' combine carries a node's partial sum over the network leg "
                          "(BufferOptions::node_partials, docs/internode.md): fp32 (the default; one rounding) or "
                          "bf16 (each node's partial rounded first: half the bytes, DeepEP's internode choice). The "
                          "same on every rank.")
      .value("fp32", NodePartials::kFloat32)
      .value("bf16", NodePartials::kBFloat16);
  nb::class_<Buffer>(m, "Buffer", "One rank's expert-parallel communication buffer (see include/epx/buffer.h).")
      .def_static(
          "create",
          [](std::shared_ptr<Group> group, int64_t num_normal_bytes, int64_t num_low_latency_bytes, int num_sms,
             nb::object allocator, const NormalConfig& normal, const LowLatencyConfig& low_latency,
             NormalRouting normal_routing, LowLatencyRouting low_latency_routing, NodePartials node_partials) {
            BufferOptions options;
            options.num_normal_bytes = num_normal_bytes;
            options.num_low_latency_bytes = num_low_latency_bytes;
            options.num_sms = num_sms;
            options.normal = normal;
            options.low_latency = low_latency;
            options.normal_routing = normal_routing;
            options.low_latency_routing = low_latency_routing;
            options.node_partials = node_partials;
            options.allocator = python_allocator(std::move(allocator));
            nb::gil_scoped_release release;
            return released_on_destroy(Buffer::create(std::move(group), options));
          },
          nb::arg("group"), nb::arg("num_normal_bytes") = 0, nb::arg("num_low_latency_bytes") = 0,
          nb::arg("num_sms") = 24, nb::arg("allocator") = nb::none(), nb::arg("normal") = NormalConfig(),
          nb::arg("low_latency") = LowLatencyConfig(), nb::arg("normal_routing") = NormalRouting::kAuto,
          nb::arg("low_latency_routing") = LowLatencyRouting::kAuto, nb::arg("node_partials") = NodePartials::kFloat32)
      .def_prop_ro("rank", &Buffer::rank)
      .def_prop_ro("num_ranks", &Buffer::num_ranks)
      .def(
          "get_dispatch_layout",
          [](Buffer& b, nb::handle topk_idx, int64_t num_experts, nb::handle stream) {
            TensorView idx = to_view(topk_idx, "topk_idx");
            Stream s = to_stream(stream);
            Layout layout;
            {
              nb::gil_scoped_release release;
              layout = b.get_dispatch_layout(idx, num_experts, s);
            }
            return nb::make_tuple(from_tensor(layout.num_tokens_per_rank), from_tensor(layout.num_tokens_per_expert),
                                  from_tensor(layout.is_token_in_rank), from_tensor(layout.num_tokens_per_node));
          },
          nb::arg("topk_idx"), nb::arg("num_experts"), nb::arg("stream") = nb::none(),
          "(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, num_tokens_per_node); the last is None "
          "where the backend leaves it undefined (cuda, flat routing).")
      .def("dispatch", &dispatch, arg("x"), arg("x_scales") = nb::none(), arg("topk_idx") = nb::none(),
           arg("topk_weights") = nb::none(), arg("num_experts") = 0, arg("layout") = nb::none(),
           arg("handle") = nb::none(), arg("expert_alignment") = 1, arg("num_worst_tokens") = 0, arg("num_sms") = 0,
           arg("stream") = nb::none(),
           nb::sig("def dispatch(self, x: object, x_scales: object | None = None, topk_idx: object | None = None, "
                   "topk_weights: object | None = None, num_experts: int = 0, layout: object | None = None, "
                   "handle: epx._epx.DispatchHandle | None = None, expert_alignment: int = 1, "
                   "num_worst_tokens: int = 0, num_sms: int = 0, stream: object | None = None) -> dict"))
      .def("combine", &combine, arg("x"), arg("topk_weights") = nb::none(), arg("bias_0") = nb::none(),
           arg("bias_1") = nb::none(), arg("handle") = nb::none(), arg("num_sms") = 0, arg("stream") = nb::none(),
           arg("order_topk_idx") = nb::none(),
           nb::sig("def combine(self, x: object, topk_weights: object | None = None, bias_0: object | None = None, "
                   "bias_1: object | None = None, handle: epx._epx.DispatchHandle | None = None, num_sms: int = 0, "
                   "stream: object | None = None, order_topk_idx: object | None = None) -> dict"))
      .def("low_latency_dispatch", &low_latency_dispatch, arg("x"), arg("topk_idx"), arg("max_tokens_per_rank"),
           arg("num_experts"), arg("use_fp8") = false, arg("scale_format") = ScaleFormat::kFloat32,
           arg("round_scale") = false, arg("scale_layout") = ScaleLayout::kRowMajor, arg("return_recv_hook") = false,
           arg("cumulative_recv_counts") = nb::none(), arg("wait_recv_cost_ns") = nb::none(),
           arg("stream") = nb::none(),
           nb::sig(
               "def low_latency_dispatch(self, x: object, topk_idx: object, max_tokens_per_rank: int, "
               "num_experts: int, use_fp8: bool = False, "
               "scale_format: epx._epx.ScaleFormat = epx._epx.ScaleFormat.float32, round_scale: bool = False, "
               "scale_layout: epx._epx.ScaleLayout = epx._epx.ScaleLayout.row_major, return_recv_hook: bool = False, "
               "cumulative_recv_counts: object | None = None, wait_recv_cost_ns: object | None = None, "
               "stream: object | None = None) -> dict"))
      .def("low_latency_combine", &low_latency_combine, arg("x"), arg("topk_idx"), arg("topk_weights"), arg("handle"),
           arg("return_recv_hook") = false, arg("out") = nb::none(), arg("wait_recv_cost_ns") = nb::none(),
           arg("stream") = nb::none(),
           nb::sig("def low_latency_combine(self, x: object, topk_idx: object, topk_weights: object, "
                   "handle: epx._epx.LowLatencyHandle, return_recv_hook: bool = False, out: object | None = None, "
                   "wait_recv_cost_ns: object | None = None, stream: object | None = None) -> dict"))
      .def("mask_rank", &Buffer::mask_rank, nb::arg("rank"))
      .def("unmask_rank", &Buffer::unmask_rank, nb::arg("rank"))
      .def("clear_rank_mask", &Buffer::clear_rank_mask)
      .def("rank_mask", &Buffer::rank_mask)
      .def_prop_ro("normal_routing", &Buffer::normal_routing,
                   "BufferOptions::normal_routing with auto resolved: the routing normal calls take")
      .def_prop_ro("low_latency_routing", &Buffer::low_latency_routing,
                   "BufferOptions::low_latency_routing with auto resolved: the routing low-latency calls take")
      .def("clean_low_latency_buffer", &Buffer::clean_low_latency_buffer, nb::call_guard<nb::gil_scoped_release>());
}

}  // namespace epx::py

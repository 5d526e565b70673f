// Buffer bindings: normal and low-latency dispatch/combine, the rank mask, size hints.
// Every call that may wait on a peer or the device releases the GIL, so rank threads run in parallel.
#include "epx/buffer.h"

#include <nanobind/stl/function.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "bind.h"
#include "epx/error.h"

namespace epx::py {
namespace {

nb::object hook_of(std::function<void()> hook) {
  if (!hook) return nb::none();
  auto shared = std::make_shared<std::function<void()>>(std::move(hook));
  return nb::cpp_function([shared]() {
    nb::gil_scoped_release release;
    (*shared)();
  });
}

Tensor as_tensor(nb::handle obj, const char* name) { return Tensor::wrap(to_view(obj, name), nullptr); }

// Fills a collective call's arguments with convert(args). If that throws (e.g. a float64 array), this rank
// still makes the call, with empty arguments, which the backend rejects like any invalid input (the host
// backend takes part in the rendezvous with an error flag, so the peers raise kPeerFailure at once); then
// it raises the conversion error.
// NOTE: without this the rank skipped the call, and its peers paired their call with its next one (the same
// collective number): silently wrong data, or a timeout (docs/reliability.md, Soak).
template <typename Args, typename Convert, typename Call>
void convert_or_fail(Args& args, Convert&& convert, Call&& call) {
  try {
    convert(args);
  } catch (...) {
    {
      nb::gil_scoped_release release;
      try {
        call(Args{});
      } catch (...) {  // the expected rejection; this rank's error is the conversion error
      }
    }
    throw;
  }
}

nb::dict dispatch(Buffer& buffer, nb::handle x, nb::handle x_scales, nb::handle topk_idx, nb::handle topk_weights,
                  int64_t num_experts, nb::handle layout, std::shared_ptr<const DispatchHandle> handle,
                  int expert_alignment, int64_t num_worst_tokens, int num_sms, nb::handle stream) {
  DispatchArgs args;
  Layout given;
  convert_or_fail(
      args,
      [&](DispatchArgs& a) {
        a.x = to_view(x, "x");
        a.x_scales = to_view(x_scales, "x_scales");
        a.topk_idx = to_view(topk_idx, "topk_idx");
        a.topk_weights = to_view(topk_weights, "topk_weights");
        if (!layout.is_none()) {
          auto parts = nb::cast<nb::tuple>(layout);
          if (parts.size() != 3) {
            throw Error(ErrorCode::kInvalidArgument,
                        "layout: expected (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)");
          }
          given.num_tokens_per_rank = as_tensor(parts[0], "layout.num_tokens_per_rank");
          given.num_tokens_per_expert = as_tensor(parts[1], "layout.num_tokens_per_expert");
          given.is_token_in_rank = as_tensor(parts[2], "layout.is_token_in_rank");
          a.layout = &given;
        }
        a.stream = to_stream(stream);
      },
      [&](const DispatchArgs& a) { buffer.dispatch(a); });
  args.num_experts = num_experts;
  args.handle = std::move(handle);
  args.expert_alignment = expert_alignment;
  args.num_worst_tokens = num_worst_tokens;
  args.num_sms = num_sms;
  DispatchResult r;
  {
    nb::gil_scoped_release release;
    r = buffer.dispatch(args);
  }
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
                 std::shared_ptr<const DispatchHandle> handle, int num_sms, nb::handle stream) {
  CombineArgs args;
  convert_or_fail(
      args,
      [&](CombineArgs& a) {
        a.x = to_view(x, "x");
        a.topk_weights = to_view(topk_weights, "topk_weights");
        a.bias_0 = to_view(bias_0, "bias_0");
        a.bias_1 = to_view(bias_1, "bias_1");
        a.stream = to_stream(stream);
      },
      [&](const CombineArgs& a) { buffer.combine(a); });
  args.handle = std::move(handle);
  args.num_sms = num_sms;
  CombineResult r;
  {
    nb::gil_scoped_release release;
    r = buffer.combine(args);
  }
  nb::dict out;
  out["x"] = from_tensor(r.x);
  out["topk_weights"] = from_tensor(r.topk_weights);
  return out;
}

nb::dict low_latency_dispatch(Buffer& buffer, nb::handle x, nb::handle topk_idx, int64_t max_tokens_per_rank,
                              int64_t num_experts, bool use_fp8, ScaleFormat scale_format, bool return_recv_hook,
                              nb::handle cumulative_recv_counts, nb::handle stream) {
  LowLatencyDispatchArgs args;
  convert_or_fail(
      args,
      [&](LowLatencyDispatchArgs& a) {
        a.x = to_view(x, "x");
        a.topk_idx = to_view(topk_idx, "topk_idx");
        a.cumulative_recv_counts = to_view(cumulative_recv_counts, "cumulative_recv_counts");
        a.stream = to_stream(stream);
      },
      [&](const LowLatencyDispatchArgs& a) { buffer.low_latency_dispatch(a); });
  args.max_tokens_per_rank = max_tokens_per_rank;
  args.num_experts = num_experts;
  args.use_fp8 = use_fp8;
  args.scale_format = scale_format;
  args.return_recv_hook = return_recv_hook;
  LowLatencyDispatchResult r;
  {
    nb::gil_scoped_release release;
    r = buffer.low_latency_dispatch(args);
  }
  nb::dict out;
  out["recv_x"] = from_tensor(r.recv_x);
  out["recv_x_scales"] = from_tensor(r.recv_x_scales);
  out["recv_count"] = from_tensor(r.recv_count);
  out["recv_src_info"] = from_tensor(r.recv_src_info);
  out["recv_layout_range"] = from_tensor(r.recv_layout_range);
  out["handle"] = nb::cast(std::shared_ptr<const LowLatencyHandle>(r.handle));
  out["recv_hook"] = hook_of(std::move(r.recv_hook));
  return out;
}

nb::dict low_latency_combine(Buffer& buffer, nb::handle x, nb::handle topk_idx, nb::handle topk_weights,
                             std::shared_ptr<const LowLatencyHandle> handle, bool return_recv_hook, nb::handle out_arg,
                             nb::handle stream) {
  LowLatencyCombineArgs args;
  convert_or_fail(
      args,
      [&](LowLatencyCombineArgs& a) {
        a.x = to_view(x, "x");
        a.topk_idx = to_view(topk_idx, "topk_idx");
        a.topk_weights = to_view(topk_weights, "topk_weights");
        a.out = to_view(out_arg, "out");
        a.stream = to_stream(stream);
      },
      [&](const LowLatencyCombineArgs& a) { buffer.low_latency_combine(a); });
  args.handle = std::move(handle);
  args.return_recv_hook = return_recv_hook;
  LowLatencyCombineResult r;
  {
    nb::gil_scoped_release release;
    r = buffer.low_latency_combine(args);
  }
  nb::dict out;
  out["x"] = from_tensor(r.x);
  out["recv_hook"] = hook_of(std::move(r.recv_hook));
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

  m.def("low_latency_buffer_size_hint", &low_latency_buffer_size_hint, nb::arg("max_tokens_per_rank"),
        nb::arg("hidden"), nb::arg("num_ranks"), nb::arg("num_experts"),
        "Bytes of peer memory the low-latency path needs for two buffer sets with these limits.");
  m.def("normal_buffer_size_hint", &normal_buffer_size_hint, nb::arg("hidden"), nb::arg("num_ranks"),
        nb::arg("num_sms"), nb::arg("max_tokens_per_rank") = 0,
        "Bytes of peer memory the normal path needs (copy-engine path up to max_tokens_per_rank when > 0).");

  nb::class_<Buffer>(m, "Buffer", "One rank's expert-parallel communication buffer (see include/epx/buffer.h).")
      .def_static(
          "create",
          [](std::shared_ptr<Group> group, int64_t num_normal_bytes, int64_t num_low_latency_bytes, int num_sms,
             nb::object allocator) {
            BufferOptions options;
            options.num_normal_bytes = num_normal_bytes;
            options.num_low_latency_bytes = num_low_latency_bytes;
            options.num_sms = num_sms;
            options.allocator = python_allocator(std::move(allocator));
            nb::gil_scoped_release release;
            return Buffer::create(std::move(group), options);
          },
          nb::arg("group"), nb::arg("num_normal_bytes") = 0, nb::arg("num_low_latency_bytes") = 0,
          nb::arg("num_sms") = 24, nb::arg("allocator") = nb::none())
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
                                  from_tensor(layout.is_token_in_rank));
          },
          nb::arg("topk_idx"), nb::arg("num_experts"), nb::arg("stream") = nb::none())
      .def("dispatch", &dispatch, nb::arg("x"), nb::arg("x_scales") = nb::none(), nb::arg("topk_idx") = nb::none(),
           nb::arg("topk_weights") = nb::none(), nb::arg("num_experts") = 0, nb::arg("layout") = nb::none(),
           nb::arg("handle") = nb::none(), nb::arg("expert_alignment") = 1, nb::arg("num_worst_tokens") = 0,
           nb::arg("num_sms") = 0, nb::arg("stream") = nb::none())
      .def("combine", &combine, nb::arg("x"), nb::arg("topk_weights") = nb::none(), nb::arg("bias_0") = nb::none(),
           nb::arg("bias_1") = nb::none(), nb::arg("handle") = nb::none(), nb::arg("num_sms") = 0,
           nb::arg("stream") = nb::none())
      .def("low_latency_dispatch", &low_latency_dispatch, nb::arg("x"), nb::arg("topk_idx"),
           nb::arg("max_tokens_per_rank"), nb::arg("num_experts"), nb::arg("use_fp8") = false,
           nb::arg("scale_format") = ScaleFormat::kFloat32, nb::arg("return_recv_hook") = false,
           nb::arg("cumulative_recv_counts") = nb::none(), nb::arg("stream") = nb::none())
      .def("low_latency_combine", &low_latency_combine, nb::arg("x"), nb::arg("topk_idx"), nb::arg("topk_weights"),
           nb::arg("handle"), nb::arg("return_recv_hook") = false, nb::arg("out") = nb::none(),
           nb::arg("stream") = nb::none())
      .def("mask_rank", &Buffer::mask_rank, nb::arg("rank"))
      .def("unmask_rank", &Buffer::unmask_rank, nb::arg("rank"))
      .def("clear_rank_mask", &Buffer::clear_rank_mask)
      .def("rank_mask", &Buffer::rank_mask)
      .def("clean_low_latency_buffer", &Buffer::clean_low_latency_buffer, nb::call_guard<nb::gil_scoped_release>());
}

}  // namespace epx::py

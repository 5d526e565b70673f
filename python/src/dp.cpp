// DP-attention bindings (include/epx/dp.h): rank arithmetic, padding mode, gather plan, dp_gather / dp_scatter
// on DLPack tensors (GIL released), batch metadata and its per-step sync.
#include "epx/dp.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bind.h"
#include "collective.h"
#include "epx/error.h"
#include "epx/group.h"

namespace epx::py {
namespace {

std::string str(int64_t v) { return std::to_string(v); }
std::string py_bool(bool v) { return v ? "True" : "False"; }

std::string list_repr(const std::vector<int64_t>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

void bind_layout(nb::module_& m) {
  nb::class_<ParallelSizes>(m, "ParallelSizes",
                            "Parallel sizes of attention (dp x cp x tp) and MoE (dp x ep x tp) over the same "
                            "world_size ranks; 0 = derived by ParallelLayout.")
      .def(
          "__init__",
          [](ParallelSizes* self, int world_size, int attn_dp_size, int attn_cp_size, int attn_tp_size, int moe_ep_size,
             int moe_dp_size, int moe_tp_size) {
            new (self) ParallelSizes{world_size,  attn_dp_size, attn_cp_size, attn_tp_size,
                                     moe_ep_size, moe_dp_size,  moe_tp_size};
          },
          nb::arg("world_size") = 1, nb::arg("attn_dp_size") = 1, nb::arg("attn_cp_size") = 1,
          nb::arg("attn_tp_size") = 0, nb::arg("moe_ep_size") = 0, nb::arg("moe_dp_size") = 1,
          nb::arg("moe_tp_size") = 0)
      .def_rw("world_size", &ParallelSizes::world_size)
      .def_rw("attn_dp_size", &ParallelSizes::attn_dp_size)
      .def_rw("attn_cp_size", &ParallelSizes::attn_cp_size)
      .def_rw("attn_tp_size", &ParallelSizes::attn_tp_size, "0: world_size / (attn_dp_size * attn_cp_size).")
      .def_rw("moe_ep_size", &ParallelSizes::moe_ep_size, "0: world_size / (moe_dp_size * moe_tp_size).")
      .def_rw("moe_dp_size", &ParallelSizes::moe_dp_size)
      .def_rw("moe_tp_size", &ParallelSizes::moe_tp_size,
              "0: world_size / (moe_ep_size * moe_dp_size); 1 when moe_ep_size is 0 too.")
      .def("__repr__", [](const ParallelSizes& s) {
        return "ParallelSizes(world_size=" + str(s.world_size) + ", attn_dp_size=" + str(s.attn_dp_size) +
               ", attn_cp_size=" + str(s.attn_cp_size) + ", attn_tp_size=" + str(s.attn_tp_size) +
               ", moe_ep_size=" + str(s.moe_ep_size) + ", moe_dp_size=" + str(s.moe_dp_size) +
               ", moe_tp_size=" + str(s.moe_tp_size) + ")";
      });

  nb::class_<RankCoords>(m, "RankCoords", "A rank's coordinates in the attention and MoE layouts.")
      .def_ro("attn_tp_rank", &RankCoords::attn_tp_rank)
      .def_ro("attn_cp_rank", &RankCoords::attn_cp_rank)
      .def_ro("attn_dp_rank", &RankCoords::attn_dp_rank)
      .def_ro("moe_tp_rank", &RankCoords::moe_tp_rank)
      .def_ro("moe_ep_rank", &RankCoords::moe_ep_rank)
      .def_ro("moe_dp_rank", &RankCoords::moe_dp_rank)
      .def("__repr__", [](const RankCoords& c) {
        return "RankCoords(attn_tp_rank=" + str(c.attn_tp_rank) + ", attn_cp_rank=" + str(c.attn_cp_rank) +
               ", attn_dp_rank=" + str(c.attn_dp_rank) + ", moe_tp_rank=" + str(c.moe_tp_rank) +
               ", moe_ep_rank=" + str(c.moe_ep_rank) + ", moe_dp_rank=" + str(c.moe_dp_rank) + ")";
      });

  nb::enum_<ParallelGroupKind>(m, "ParallelGroupKind", "Which sub-groups ParallelLayout.groups() lists.")
      .value("attn_tp", ParallelGroupKind::kAttnTp)
      .value("attn_cp", ParallelGroupKind::kAttnCp)
      .value("attn_dp", ParallelGroupKind::kAttnDp)
      .value("moe_tp", ParallelGroupKind::kMoeTp)
      .value("moe_ep", ParallelGroupKind::kMoeEp)
      .value("moe_dp", ParallelGroupKind::kMoeDp);

  nb::class_<ParallelLayout>(m, "ParallelLayout",
                             "Rank arithmetic of DP attention (include/epx/dp.h):\n"
                             "  attention rank = (attn_dp_rank * attn_cp + attn_cp_rank) * attn_tp + attn_tp_rank\n"
                             "  MoE rank       = (moe_dp_rank * moe_ep + moe_ep_rank) * moe_tp + moe_tp_rank")
      .def(
          "__init__",
          [](ParallelLayout* self, int world_size, int attn_dp_size, int attn_cp_size, int attn_tp_size,
             int moe_ep_size, int moe_dp_size, int moe_tp_size) {
            new (self) ParallelLayout(ParallelLayout::create(
                {world_size, attn_dp_size, attn_cp_size, attn_tp_size, moe_ep_size, moe_dp_size, moe_tp_size}));
          },
          nb::arg("world_size"), nb::arg("attn_dp_size") = 1, nb::arg("attn_cp_size") = 1, nb::arg("attn_tp_size") = 0,
          nb::arg("moe_ep_size") = 0, nb::arg("moe_dp_size") = 1, nb::arg("moe_tp_size") = 0,
          "Derives the 0 sizes and checks every product equals world_size (1 to 1024); raises InvalidArgumentError "
          "naming the size and the product it broke.")
      .def_static("create", &ParallelLayout::create, nb::arg("sizes"))
      .def_static("pure_dp", &ParallelLayout::pure_dp, nb::arg("world_size"),
                  "Every rank its own DP rank: attn_dp = world, attn_tp = attn_cp = 1, moe_ep = world.")
      .def_prop_ro("sizes", &ParallelLayout::sizes, "The sizes with every 0 derived.")
      .def_prop_ro("world_size", &ParallelLayout::world_size)
      .def_prop_ro("attn_dp_size", &ParallelLayout::attn_dp_size)
      .def_prop_ro("attn_tp_size", &ParallelLayout::attn_tp_size)
      .def_prop_ro("attn_cp_size", &ParallelLayout::attn_cp_size)
      .def("coords", &ParallelLayout::coords, nb::arg("rank"))
      .def("attn_rank", &ParallelLayout::attn_rank, nb::arg("attn_dp_rank"), nb::arg("attn_cp_rank"),
           nb::arg("attn_tp_rank"))
      .def("dp_leader", &ParallelLayout::dp_leader, nb::arg("attn_dp_rank"),
           "The rank that contributes DP rank attn_dp_rank's data (attn_tp_rank 0, attn_cp_rank 0).")
      .def("is_dp_leader", &ParallelLayout::is_dp_leader, nb::arg("rank"))
      .def("groups", &ParallelLayout::groups, nb::arg("kind"),
           "All groups of one kind, each an ascending list of ranks, ordered by their first rank.")
      .def("group_of", &ParallelLayout::group_of, nb::arg("kind"), nb::arg("rank"))
      .def("__repr__", [](const ParallelLayout& l) {
        const ParallelSizes& s = l.sizes();
        return "ParallelLayout(world_size=" + str(s.world_size) + ", attn_dp_size=" + str(s.attn_dp_size) +
               ", attn_cp_size=" + str(s.attn_cp_size) + ", attn_tp_size=" + str(s.attn_tp_size) +
               ", moe_ep_size=" + str(s.moe_ep_size) + ", moe_dp_size=" + str(s.moe_dp_size) +
               ", moe_tp_size=" + str(s.moe_tp_size) + ")";
      });
}

// A bound object of type T (not None).
template <typename T>
const T* to_object(nb::handle obj, const char* name, const char* expected) {
  T* ptr = nullptr;
  if (obj.is_none() || !nb::try_cast(obj, ptr) || ptr == nullptr) wrong_type(name, expected, obj);
  return ptr;
}

// None (empty) or a sequence of ints (list, tuple, numpy or torch integers).
template <typename Int>
std::vector<Int> to_int_list(nb::handle obj, const char* name) {
  std::vector<Int> values;
  if (obj.is_none()) return values;
  if (PyUnicode_Check(obj.ptr()) || PyBytes_Check(obj.ptr()) || !PySequence_Check(obj.ptr())) {
    wrong_type(name, "None or a sequence of ints", obj);
  }
  const Py_ssize_t n = PySequence_Size(obj.ptr());
  if (n < 0) throw nb::python_error();
  for (Py_ssize_t i = 0; i < n; ++i) {
    nb::object item = nb::steal(PySequence_GetItem(obj.ptr(), i));
    if (!item.is_valid()) throw nb::python_error();
    const std::string item_name = std::string(name) + "[" + std::to_string(i) + "]";
    values.push_back(to_int<Int>(item, item_name.c_str()));
  }
  return values;
}

// dp_gather / dp_scatter: every argument converted inside the collective (collective_or_fail), so an argument
// rejected on one rank still makes that rank take part in the call (dp_gather_fail / dp_scatter_fail) instead of
// leaving its peers paired with its next call. What the cuda backend needs to join the peers' collective (layout,
// plan, global, source / kind, stream) is converted first.
struct GatherArgs {
  const ParallelLayout* layout = nullptr;
  const DpGatherPlan* plan = nullptr;
  TensorView local;
  TensorView global;
  Stream stream = nullptr;
  std::optional<DpGatherSource> source;
  std::optional<DpScatterKind> kind;
  std::vector<int64_t> cp_shard_counts;

  DpFailedCall failed_call() const { return {layout, plan, global, stream, source, kind}; }
};

void convert_shape(GatherArgs& a, nb::handle layout, nb::handle plan, nb::handle global, nb::handle stream) {
  a.layout = to_object<ParallelLayout>(layout, "layout", "an epx.dp.ParallelLayout");
  a.plan = to_object<DpGatherPlan>(plan, "plan", "an epx.dp.DpGatherPlan");
  a.global = to_view(global, "global_buffer");
  a.stream = to_stream(stream);
}

void gather(Group& group, nb::handle layout, nb::handle plan, nb::handle local, nb::handle global_buffer,
            nb::handle stream, nb::handle source, nb::handle cp_shard_counts) {
  collective_or_fail<GatherArgs>(
      [&](GatherArgs& a) {
        a.source = to_enum<DpGatherSource>(source, "source", "an epx.dp.DpGatherSource");
        convert_shape(a, layout, plan, global_buffer, stream);
        a.local = to_view(local, "local");
        a.cp_shard_counts = to_int_list<int64_t>(cp_shard_counts, "cp_shard_counts");
      },
      [&](const GatherArgs& a) {
        dp_gather(group, *a.layout, *a.plan, a.local, a.global, a.stream, *a.source, a.cp_shard_counts);
      },
      [&](const std::string& reason, const GatherArgs& a) { dp_gather_fail(group, reason, a.failed_call()); });
}

void scatter(Group& group, nb::handle layout, nb::handle plan, nb::handle global_buffer, nb::handle local,
             nb::handle kind, nb::handle stream, nb::handle cp_shard_counts) {
  collective_or_fail<GatherArgs>(
      [&](GatherArgs& a) {
        // NOTE: the kind first: it says whether there is a collective to take part in at all.
        a.kind = to_enum<DpScatterKind>(kind, "kind", "an epx.dp.DpScatterKind");
        convert_shape(a, layout, plan, global_buffer, stream);
        a.local = to_view(local, "local");
        a.cp_shard_counts = to_int_list<int64_t>(cp_shard_counts, "cp_shard_counts");
      },
      [&](const GatherArgs& a) {
        dp_scatter(group, *a.layout, *a.plan, a.global, a.local, *a.kind, a.stream, a.cp_shard_counts);
      },
      [&](const std::string& reason, const GatherArgs& a) { dp_scatter_fail(group, reason, a.failed_call()); });
}

void bind_gather(nb::module_& m) {
  nb::enum_<DpPaddingMode>(m, "DpPaddingMode", "How DP ranks' tokens sit in the global buffer.")
      .value("MAX_LEN", DpPaddingMode::kMaxLen, "Each DP rank padded to the max count; all-gather.")
      .value("SUM_LEN", DpPaddingMode::kSumLen, "Each DP rank at its prefix offset in a zeroed buffer; all-reduce.");

  m.def(
      "choose_padding_mode",
      [](const std::vector<int64_t>& num_tokens_per_dp_rank, bool is_extend_in_batch, bool in_cuda_graph,
         bool symmetric_a2a) {
        return choose_padding_mode(num_tokens_per_dp_rank, {is_extend_in_batch, in_cuda_graph, symmetric_a2a});
      },
      nb::arg("num_tokens_per_dp_rank"), nb::arg("is_extend_in_batch") = false, nb::arg("in_cuda_graph") = false,
      nb::arg("symmetric_a2a") = false,
      "The mode of one step. First match wins: symmetric_a2a -> MAX_LEN; in_cuda_graph -> MAX_LEN; extend with "
      "more than one DP rank -> SUM_LEN; MAX_LEN iff 2 * sum >= max * num_dp_ranks; else SUM_LEN.");

  nb::class_<DpGatherPlan>(m, "DpGatherPlan", "Where every DP rank's tokens sit in the global buffer [buffer_len, H].")
      .def_ro("mode", &DpGatherPlan::mode)
      .def_ro("buffer_len", &DpGatherPlan::buffer_len, "Rows of the global buffer.")
      .def_ro("slot_len", &DpGatherPlan::slot_len, "MAX_LEN: rows per DP rank; SUM_LEN: 0.")
      .def_ro("num_tokens", &DpGatherPlan::num_tokens, "[num_dp_ranks] rows each DP rank contributes.")
      .def_ro("offsets", &DpGatherPlan::offsets, "[num_dp_ranks] first row of each DP rank's tokens.")
      .def("__repr__", [](const DpGatherPlan& p) {
        return std::string("DpGatherPlan(mode=") + to_string(p.mode) + ", buffer_len=" + str(p.buffer_len) +
               ", slot_len=" + str(p.slot_len) + ", num_tokens=" + list_repr(p.num_tokens) +
               ", offsets=" + list_repr(p.offsets) + ")";
      });

  m.def(
      "plan_dp_gather",
      [](const std::vector<int64_t>& num_tokens_per_dp_rank, DpPaddingMode mode, int attn_tp_size) {
        return plan_dp_gather(num_tokens_per_dp_rank, mode, attn_tp_size);
      },
      nb::arg("num_tokens_per_dp_rank"), nb::arg("mode"), nb::arg("attn_tp_size") = 1,
      "MAX_LEN: slot_len = max count rounded up to attn_tp_size, offsets[d] = d * slot_len. SUM_LEN: offsets are "
      "the exclusive prefix sums. Raises InvalidArgumentError for negative counts or sizes out of range.");

  nb::enum_<DpGatherSource>(m, "DpGatherSource", "What dp_gather takes from a DP rank's attention-TP ranks.")
      .value("leader", DpGatherSource::kLeader, "The leader's rows (every TP rank holds the same batch).")
      .value("partial_sums", DpGatherSource::kPartialSums,
             "The sum of the TP ranks' rows (partial sums, e.g. before the o_proj all-reduce); either padding mode.");

  m.def("dp_gather", &gather, nb::arg("group"), nb::arg("layout").none(), nb::arg("plan").none(),
        nb::arg("local").none(), nb::arg("global_buffer").none(), nb::arg("stream").none() = nb::none(),
        nb::arg("source").none() = DpGatherSource::kLeader, nb::arg("cp_shard_counts").none() = nb::none(),
        // NOTE: every argument but the group is an nb::handle, converted inside the collective (see gather()).
        nb::sig("def dp_gather(group: epx._epx.Group, layout: ParallelLayout, plan: DpGatherPlan, local: object, "
                "global_buffer: object, stream: object | None = None, source: DpGatherSource = DpGatherSource.leader, "
                "cp_shard_counts: collections.abc.Sequence[int] | None = None) -> None"),
        "Collective: global_buffer [plan.buffer_len, H] on every rank receives each DP rank's first num_tokens[d] "
        "rows of its leader's local (source leader) or of the sum over its attention-TP ranks' locals (source "
        "partial_sums, either padding mode) at offsets[d]; other rows are zeroed. With attention CP and "
        "cp_shard_counts ([attn_cp_size], this DP rank's) each CP rank's first cp_shard_counts[c] rows land back to "
        "back in CP rank order. Contiguous. An argument rejected on this rank (TypeError or InvalidArgumentError "
        "naming it) is raised after this rank took part in the call (host backend: every peer raises "
        "PeerFailureError naming it in the same call). GIL released.");

  nb::enum_<DpScatterKind>(m, "DpScatterKind", "What dp_scatter's global buffer holds.")
      .value("slice", DpScatterKind::kSlice, "The same buffer on every rank: take this DP rank's rows.")
      .value("reduce_scatter", DpScatterKind::kReduceScatter, "Partial buffers: sum over ranks (fp32, rank order).");

  m.def("dp_scatter", &scatter, nb::arg("group"), nb::arg("layout").none(), nb::arg("plan").none(),
        nb::arg("global_buffer").none(), nb::arg("local").none(), nb::arg("kind").none() = DpScatterKind::kSlice,
        nb::arg("stream").none() = nb::none(), nb::arg("cp_shard_counts").none() = nb::none(),
        nb::sig("def dp_scatter(group: epx._epx.Group, layout: ParallelLayout, plan: DpGatherPlan, global_buffer: "
                "object, local: object, kind: DpScatterKind = DpScatterKind.slice, stream: object | None = None, "
                "cp_shard_counts: collections.abc.Sequence[int] | None = None) -> None"),
        "Collective: local [>= num_tokens[my DP rank], H] receives this DP rank's rows of global_buffer (slice) or "
        "of the sum of every rank's global_buffer (reduce_scatter); rows past the count are zeroed. slice with "
        "cp_shard_counts: only this CP rank's shard. Rejected arguments as for dp_gather (slice has no collective; "
        "a kind that does not convert joins none). GIL released.");

  nb::class_<ZigzagSplit>(m, "ZigzagSplit",
                          "SGLang's zigzag split of a prefill batch over the attention-CP ranks (plan_zigzag_split).")
      .def_ro("cp_size", &ZigzagSplit::cp_size)
      .def_ro("seq_lens", &ZigzagSplit::seq_lens, "[num_seqs] extend lengths as split (padding joins the last).")
      .def_ro("seq_offsets", &ZigzagSplit::seq_offsets, "[num_seqs] first batch row of each sequence.")
      .def_ro("block_lens", &ZigzagSplit::block_lens, "[num_seqs * 2 * cp_size] block lengths, sequence-major.")
      .def_ro("num_tokens", &ZigzagSplit::num_tokens, "[cp_size] rows each CP rank holds.")
      .def_ro("max_rank_len", &ZigzagSplit::max_rank_len)
      .def_ro("padded_rank_len", &ZigzagSplit::padded_rank_len, "max_rank_len rounded up to 2 * cp_size.")
      .def("__repr__", [](const ZigzagSplit& z) {
        return "ZigzagSplit(cp_size=" + std::to_string(z.cp_size) + ", seq_lens=" + list_repr(z.seq_lens) +
               ", block_lens=" + list_repr(z.block_lens) + ", num_tokens=" + list_repr(z.num_tokens) +
               ", padded_rank_len=" + str(z.padded_rank_len) + ")";
      });
  m.def(
      "can_zigzag_split",
      [](const std::vector<int64_t>& extend_seq_lens, int cp_size, ForwardMode mode, int64_t num_tokens) {
        return can_zigzag_split(extend_seq_lens, cp_size, mode, num_tokens);
      },
      nb::arg("extend_seq_lens"), nb::arg("cp_size"), nb::arg("mode"), nb::arg("num_tokens"),
      "SGLang's ZigzagCPStrategy.can_apply: cp_size > 1, EXTEND or MIXED, num_tokens >= 2 * cp_size and every "
      "extend length >= 2 * cp_size.");
  m.def(
      "plan_zigzag_split",
      [](const std::vector<int64_t>& extend_seq_lens, int cp_size, int64_t num_tokens) {
        return plan_zigzag_split(extend_seq_lens, cp_size, num_tokens);
      },
      nb::arg("extend_seq_lens"), nb::arg("cp_size"), nb::arg("num_tokens") = -1,
      "Each sequence cut into 2 * cp_size blocks (the first L % (2 cp) one row longer); CP rank c holds blocks c "
      "and 2 cp - 1 - c. num_tokens (-1: the sum) adds its padding rows to the last sequence.");
  m.def("zigzag_local_rows", &zigzag_local_rows, nb::arg("split"), nb::arg("cp_rank"),
        "[num_tokens[cp_rank]] the batch row of each of the CP rank's rows (early blocks of every sequence, then "
        "late blocks).");
  m.def("zigzag_gathered_rows", &zigzag_gathered_rows, nb::arg("split"),
        "[total rows] each batch row's row once the CP ranks' rows lie back to back in CP rank order (its row "
        "relative to the DP rank's offset after dp_gather with cp_shard_counts = split.num_tokens).");

  nb::enum_<CpStrategy>(m, "CpStrategy", "SGLang's --cp-strategy: how the attention-CP ranks split a prefill batch.")
      .value("zigzag", CpStrategy::kZigzag, "2 * cp blocks per sequence; rank c holds blocks c and 2 cp - 1 - c.")
      .value("interleave", CpStrategy::kInterleave, "Round-robin: batch row i on rank i % cp.");
  m.def(
      "parse_cp_strategy", [](const std::string& cp_strategy) { return parse_cp_strategy(cp_strategy); },
      nb::arg("cp_strategy"), "\"zigzag\" or \"interleave\" (SGLang's ContextParallelStrategyKind.from_string).");
  m.def(
      "can_cp_split",
      [](CpStrategy strategy, const std::vector<int64_t>& extend_seq_lens, int cp_size, ForwardMode mode,
         int64_t num_tokens) { return can_cp_split(strategy, extend_seq_lens, cp_size, mode, num_tokens); },
      nb::arg("strategy"), nb::arg("extend_seq_lens"), nb::arg("cp_size"), nb::arg("mode"), nb::arg("num_tokens"),
      "The strategy's can_apply: can_zigzag_split or can_interleave_split.");

  nb::class_<InterleaveSplit>(
      m, "InterleaveSplit",
      "SGLang's interleave (round-robin) split of a prefill batch over the attention-CP ranks (plan_interleave_split).")
      .def_ro("cp_size", &InterleaveSplit::cp_size)
      .def_ro("seq_lens", &InterleaveSplit::seq_lens, "[num_seqs] extend lengths (padding rows join none).")
      .def_ro("seq_offsets", &InterleaveSplit::seq_offsets, "[num_seqs] first batch row of each sequence.")
      .def_ro("num_batch_tokens", &InterleaveSplit::num_batch_tokens, "Rows dealt out, padding included.")
      .def_ro("num_real_batch_tokens", &InterleaveSplit::num_real_batch_tokens,
              "Sum of seq_lens; rows past are padding.")
      .def_ro("num_tokens", &InterleaveSplit::num_tokens, "[cp_size] rows each CP rank holds (the cp_shard_counts).")
      .def_ro("num_real_tokens", &InterleaveSplit::num_real_tokens, "[cp_size] how many of them are real rows.")
      .def_ro("max_rank_len", &InterleaveSplit::max_rank_len)
      .def_ro("padded_rank_len", &InterleaveSplit::padded_rank_len, "max_rank_len rounded up to cp_size.")
      .def("__repr__", [](const InterleaveSplit& z) {
        return "InterleaveSplit(cp_size=" + std::to_string(z.cp_size) + ", seq_lens=" + list_repr(z.seq_lens) +
               ", num_batch_tokens=" + str(z.num_batch_tokens) + ", num_tokens=" + list_repr(z.num_tokens) +
               ", num_real_tokens=" + list_repr(z.num_real_tokens) + ", padded_rank_len=" + str(z.padded_rank_len) +
               ")";
      });
  nb::class_<InterleaveQueries>(m, "InterleaveQueries",
                                "Attention metadata of a CP rank's real rows (interleave_local_queries).")
      .def_ro("seq_idx", &InterleaveQueries::seq_idx, "[num_real_tokens[cp_rank]] the sequence of each real row.")
      .def_ro("kv_lens", &InterleaveQueries::kv_lens,
              "[num_real_tokens[cp_rank]] its causal KV length: prefix_lens[s] + (row - seq_offsets[s]) + 1.");
  m.def(
      "can_interleave_split",
      [](int cp_size, ForwardMode mode, int64_t num_tokens) { return can_interleave_split(cp_size, mode, num_tokens); },
      nb::arg("cp_size"), nb::arg("mode"), nb::arg("num_tokens"),
      "SGLang's InterleaveCPStrategy.can_apply: cp_size > 1, EXTEND or MIXED and num_tokens >= cp_size.");
  m.def(
      "plan_interleave_split",
      [](const std::vector<int64_t>& extend_seq_lens, int cp_size, int64_t num_tokens) {
        return plan_interleave_split(extend_seq_lens, cp_size, num_tokens);
      },
      nb::arg("extend_seq_lens"), nb::arg("cp_size"), nb::arg("num_tokens") = -1,
      "Batch row i on CP rank i % cp_size as its local row i // cp_size. num_tokens (-1: the sum) adds padding rows "
      "at the end, dealt out like the others.");
  m.def("interleave_local_rows", &interleave_local_rows, nb::arg("split"), nb::arg("cp_rank"),
        "[num_tokens[cp_rank]] the batch rows of the CP rank: cp_rank, cp_rank + cp_size, ... (ascending).");
  m.def("interleave_gathered_rows", &interleave_gathered_rows, nb::arg("split"), nb::arg("real_rows_only") = false,
        "[num_batch_tokens] each batch row's row once the CP ranks' rows lie back to back in CP rank order (SGLang's "
        "restore_indices; relative to the DP rank's offset after dp_gather with cp_shard_counts = split.num_tokens). "
        "real_rows_only: [num_real_batch_tokens] over the real rows (restore_real_indices).");
  m.def(
      "interleave_local_queries",
      [](const InterleaveSplit& split, int cp_rank, const std::vector<int64_t>& prefix_lens) {
        return interleave_local_queries(split, cp_rank, prefix_lens);
      },
      nb::arg("split"), nb::arg("cp_rank"), nb::arg("prefix_lens") = std::vector<int64_t>{},
      "The sequence and causal KV length of each of the CP rank's real rows (SGLang's query_request_indices / "
      "query_cache_lengths); prefix_lens [num_seqs] (empty: 0).");
}

// The group ranks of `obj`: None (none) or a sequence of ints (list, tuple, numpy or torch integers).
std::vector<int> to_rank_list(nb::handle obj, const char* name) { return to_int_list<int>(obj, name); }

// BatchMetadataSync.sync: every argument converted inside the collective (collective_or_fail), so a wrong-typed
// argument on one rank still takes part in the step (with an error flag) instead of leaving its peers paired
// with its next sync.
BatchSyncResult sync_batch_metadata(BatchMetadataSync& sync, nb::handle local, nb::handle inactive_ranks) {
  struct Args {
    std::optional<BatchMetadata> local;
    std::vector<int> inactive_ranks;
  };
  return collective_or_fail<Args>(
      [&](Args& a) {
        // NOTE: the list first: fail() then skips the ranks it names even when `local` is what failed.
        a.inactive_ranks = to_rank_list(inactive_ranks, "inactive_ranks");
        if (!local.is_none()) {
          BatchMetadata record;
          if (!nb::try_cast(local, record)) wrong_type("local", "an epx.dp.BatchMetadata or None", local);
          a.local = record;
        }
      },
      [&](const Args& a) { return sync.sync(a.local, a.inactive_ranks); },
      [&](const std::string& reason, const Args& a) { sync.fail(reason, a.inactive_ranks); });
}

void bind_metadata(nb::module_& m) {
  nb::enum_<ForwardMode>(m, "ForwardMode", "The kind of batch a DP rank runs in a step.")
      .value("IDLE", ForwardMode::kIdle)
      .value("EXTEND", ForwardMode::kExtend)
      .value("DECODE", ForwardMode::kDecode)
      .value("MIXED", ForwardMode::kMixed)
      .value("TARGET_VERIFY", ForwardMode::kTargetVerify)
      .value("DRAFT_EXTEND", ForwardMode::kDraftExtend)
      .value("PREBUILT", ForwardMode::kPrebuilt);
  m.attr("BATCH_METADATA_FIELDS") = kBatchMetadataFields;

  nb::class_<BatchMetadata>(m, "BatchMetadata",
                            "One DP rank's record for a step (11 fields, exchanged as 11 int64 per rank). The "
                            "constructor's defaults are an IDLE record with every vote 1; idle() is the record of a "
                            "rank with no batch, which votes can_run_prefill_graph = 0 as SGLang's does.")
      .def(
          "__init__",
          [](BatchMetadata* self, int64_t num_tokens, int64_t num_tokens_for_logprob, bool can_run_decode_graph,
             bool is_extend_in_batch, bool can_run_tbo, ForwardMode forward_mode, bool can_run_prefill_graph,
             int64_t prefill_graph_max_prefix_len, bool can_run_draft_graph, bool is_health_check,
             int64_t attention_pairs) {
            new (self) BatchMetadata{
                num_tokens,          num_tokens_for_logprob, can_run_decode_graph,  is_extend_in_batch,
                can_run_tbo,         forward_mode,           can_run_prefill_graph, prefill_graph_max_prefix_len,
                can_run_draft_graph, is_health_check,        attention_pairs};
          },
          nb::kw_only(), nb::arg("num_tokens") = 0, nb::arg("num_tokens_for_logprob") = 0,
          nb::arg("can_run_decode_graph") = true, nb::arg("is_extend_in_batch") = false, nb::arg("can_run_tbo") = true,
          nb::arg("forward_mode") = ForwardMode::kIdle, nb::arg("can_run_prefill_graph") = true,
          nb::arg("prefill_graph_max_prefix_len") = 0, nb::arg("can_run_draft_graph") = true,
          nb::arg("is_health_check") = false, nb::arg("attention_pairs") = 0)
      .def_static("idle", &BatchMetadata::idle,
                  "IDLE, 0 tokens; decode-graph, draft-graph and TBO votes 1, prefill-graph vote 0 (one idle DP "
                  "rank turns the prefill graph off for the step, as in SGLang).")
      .def_static("prebuilt", &BatchMetadata::prebuilt,
                  "PREBUILT (disaggregated decode), 0 tokens: see include/epx/dp.h.")
      .def_rw("num_tokens", &BatchMetadata::num_tokens)
      .def_rw("num_tokens_for_logprob", &BatchMetadata::num_tokens_for_logprob)
      .def_rw("can_run_decode_graph", &BatchMetadata::can_run_decode_graph)
      .def_rw("is_extend_in_batch", &BatchMetadata::is_extend_in_batch)
      .def_rw("can_run_tbo", &BatchMetadata::can_run_tbo)
      .def_rw("forward_mode", &BatchMetadata::forward_mode)
      .def_rw("can_run_prefill_graph", &BatchMetadata::can_run_prefill_graph)
      .def_rw("prefill_graph_max_prefix_len", &BatchMetadata::prefill_graph_max_prefix_len)
      .def_rw("can_run_draft_graph", &BatchMetadata::can_run_draft_graph)
      .def_rw("is_health_check", &BatchMetadata::is_health_check)
      .def_rw("attention_pairs", &BatchMetadata::attention_pairs)
      .def("__repr__", [](const BatchMetadata& b) {
        return std::string("BatchMetadata(num_tokens=") + str(b.num_tokens) +
               ", forward_mode=" + to_string(b.forward_mode) + ", is_extend_in_batch=" + py_bool(b.is_extend_in_batch) +
               ", can_run_tbo=" + py_bool(b.can_run_tbo) + ", ...)";
      });

  nb::class_<GlobalBatchInfo>(m, "GlobalBatchInfo", "The agreed view of one step, identical on every rank.")
      .def_ro("num_tokens", &GlobalBatchInfo::num_tokens, "[num_dp_ranks]")
      .def_ro("num_tokens_for_logprob", &GlobalBatchInfo::num_tokens_for_logprob, "[num_dp_ranks]")
      .def_ro("attention_pairs", &GlobalBatchInfo::attention_pairs, "[num_dp_ranks]")
      .def_ro("can_run_decode_graph", &GlobalBatchInfo::can_run_decode_graph, "min over DP ranks")
      .def_ro("can_run_prefill_graph", &GlobalBatchInfo::can_run_prefill_graph, "min")
      .def_ro("can_run_draft_graph", &GlobalBatchInfo::can_run_draft_graph, "min")
      .def_ro("is_extend_in_batch", &GlobalBatchInfo::is_extend_in_batch, "max")
      .def_ro("is_health_check", &GlobalBatchInfo::is_health_check, "max")
      .def_ro("prefill_graph_max_prefix_len", &GlobalBatchInfo::prefill_graph_max_prefix_len, "max")
      .def_ro("forward_mode", &GlobalBatchInfo::forward_mode,
              "The common mode of the non-idle DP ranks; IDLE when all are idle; None when they disagree.")
      .def_ro("can_run_tbo", &GlobalBatchInfo::can_run_tbo,
              "min of the votes, the non-idle ranks agree on a mode, and some rank is not idle.")
      .def_ro("any_tokens", &GlobalBatchInfo::any_tokens, "Some DP rank has tokens: every rank runs a batch.")
      .def("__repr__", [](const GlobalBatchInfo& g) {
        return std::string("GlobalBatchInfo(num_tokens=") + list_repr(g.num_tokens) +
               ", forward_mode=" + (g.forward_mode ? to_string(*g.forward_mode) : "None") +
               ", can_run_tbo=" + py_bool(g.can_run_tbo) + ", any_tokens=" + py_bool(g.any_tokens) + ", ...)";
      });

  nb::class_<BatchSyncResult>(m, "BatchSyncResult", "The local result of one BatchMetadataSync.sync().")
      .def_ro("global_info", &BatchSyncResult::global)
      .def_ro("run_idle_batch", &BatchSyncResult::run_idle_batch,
              "This rank has no batch but must run an idle one (global_info.any_tokens).")
      .def_ro("runs_batch", &BatchSyncResult::runs_batch, "This rank runs a batch (its own or an idle one).")
      .def_ro("step_wait_s", &BatchSyncResult::step_wait_s, "Seconds this sync waited for the slowest rank.")
      .def_ro("wait_s", &BatchSyncResult::wait_s,
              "This sync's wait plus the carried waits of earlier syncs in which this rank ran no batch.");

  nb::class_<BatchMetadataSync>(m, "BatchMetadataSync",
                                "Per-rank, stateful batch-metadata sync: one all-gather of the records per step "
                                "(skipped when attn_dp_size == 1). Not thread-safe; one per rank.")
      .def(nb::init<Group&, const ParallelLayout&>(), nb::arg("group"), nb::arg("layout"), nb::keep_alive<1, 2>(),
           "Raises InvalidArgumentError unless layout.world_size == group.num_ranks. Keeps the group alive.")
      .def("sync", &sync_batch_metadata, nb::arg("local").none(), nb::arg("inactive_ranks").none() = nb::none(),
           // NOTE: the arguments are nb::handle so that nanobind rejects none before the collective (see
           // collective.h); the signature keeps the types a caller should pass.
           nb::sig("def sync(self, local: BatchMetadata | None, inactive_ranks: collections.abc.Sequence[int] | None "
                   "= None) -> BatchSyncResult"),
           "Collective. local: this rank's record, or None for a rank with no batch. inactive_ranks: None or the "
           "group ranks (ints) that are dead or absent this step, the same list on every calling rank: they are not "
           "waited for and each DP rank whose leader is listed counts as BatchMetadata.idle() (SGLang's fallback "
           "record; host backend only, UnsupportedError on cuda). Raises InvalidArgumentError for a bad record or "
           "list (before communicating; a list that differs between ranks on every rank that compares them), "
           "TimeoutError from the group. A wrong-typed argument raises TypeError naming it after this rank took "
           "part with an error flag (host backend: every peer's sync raises PeerFailureError at once). GIL "
           "released.")
      .def_prop_ro("carried_wait_s", &BatchMetadataSync::carried_wait_s);

  m.def(
      "reduce_batch_metadata", [](const std::vector<BatchMetadata>& records) { return reduce_batch_metadata(records); },
      nb::arg("records"),
      "The reductions of sync() alone: one record per DP rank -> GlobalBatchInfo. Raises InvalidArgumentError "
      "for an empty list.");
}

}  // namespace

void register_dp(nb::module_& parent) {
  nb::module_ m = parent.def_submodule("dp", "DP attention: rank layout, gather/scatter, batch metadata (epx/dp.h).");
  bind_layout(m);
  bind_gather(m);
  bind_metadata(m);
}

}  // namespace epx::py

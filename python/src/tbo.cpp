// Two-batch-overlap bindings (include/epx/tbo.h): split rules, child batches, and the stage executor running
// Python callables.
//
// Operations cross as a list of (name, fn) pairs, fn None for a yield point. The executor runs with the GIL
// released and takes it for each Python call, so other Python threads (e.g. communication) run between them.
#include "epx/tbo.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bind.h"
#include "epx/error.h"

namespace epx::py {
namespace {

using PyOp = std::pair<std::string, nb::object>;  // (name, callable or None)

// The std::function of one Python operation: a shared reference to the callable (copied GIL-free by the
// executor, released under the GIL) and the operation's index in its list.
struct PythonCall {
  std::shared_ptr<nb::object> fn;
  size_t index = 0;

  void operator()(int batch_idx) const {
    nb::gil_scoped_acquire gil;
    (*fn)(batch_idx);  // a Python exception becomes nb::python_error and propagates through the executor
  }
};

std::shared_ptr<nb::object> share(nb::object fn) {
  return std::shared_ptr<nb::object>(new nb::object(std::move(fn)), [](nb::object* p) {
    nb::gil_scoped_acquire gil;
    delete p;
  });
}

std::vector<TboOperation> to_operations(const std::vector<PyOp>& ops, const char* name) {
  std::vector<TboOperation> out;
  out.reserve(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    const auto& [op_name, fn] = ops[i];
    if (fn.is_none()) {
      out.push_back({op_name, nullptr});
      continue;
    }
    if (!PyCallable_Check(fn.ptr())) {
      throw Error(ErrorCode::kInvalidArgument, std::string(name) + "[" + std::to_string(i) + "] ('" + op_name +
                                                   "'): expected a callable fn(batch_idx) or None (a yield point)");
    }
    out.push_back({op_name, PythonCall{share(fn), i}});
  }
  return out;
}

std::string str(int64_t v) { return std::to_string(v); }

std::string list_repr(const std::vector<int64_t>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

void bind_split(nb::module_& m) {
  m.attr("DEFAULT_THRESHOLD") = kDefaultTboThreshold;

  nb::class_<TboSplit>(m, "TboSplit", "Where a batch is cut into micro-batches A and B.")
      .def(
          "__init__",
          [](TboSplit* self, int64_t split_seq_index, int64_t split_token_index, bool two_chunk) {
            new (self) TboSplit{split_seq_index, split_token_index, two_chunk};
          },
          nb::arg("split_seq_index") = 0, nb::arg("split_token_index") = 0, nb::arg("two_chunk") = false)
      .def_rw("split_seq_index", &TboSplit::split_seq_index,
              "A holds sequences [0, split_seq_index) (and the cut one if two_chunk).")
      .def_rw("split_token_index", &TboSplit::split_token_index, "A holds tokens [0, split_token_index).")
      .def_rw("two_chunk", &TboSplit::two_chunk, "Sequence split_seq_index is cut in two at split_token_index.")
      .def("__eq__",
           [](const TboSplit& a, const TboSplit& b) {
             return a.split_seq_index == b.split_seq_index && a.split_token_index == b.split_token_index &&
                    a.two_chunk == b.two_chunk;
           })
      .def("__repr__", [](const TboSplit& s) {
        return "TboSplit(split_seq_index=" + str(s.split_seq_index) +
               ", split_token_index=" + str(s.split_token_index) + ", two_chunk=" + (s.two_chunk ? "True" : "False") +
               ")";
      });

  m.def(
      "compute_tbo_split_extend",
      [](const std::vector<int64_t>& extend_lens, double threshold) {
        return compute_tbo_split_extend(extend_lens, threshold);
      },
      nb::arg("extend_lens"), nb::arg("threshold") = kDefaultTboThreshold,
      "Extend (prefill) batch: the balanced sequence boundary, or a cut sequence (two_chunk) when the balanced "
      "left part is outside [threshold, 1 - threshold] of the tokens. threshold in [0, 0.5] (0: never cut).");
  m.def("compute_tbo_split_decode", &compute_tbo_split_decode, nb::arg("num_tokens"), nb::arg("tokens_per_seq") = 1,
        "Decode / target-verify batch of num_tokens = num_seqs * tokens_per_seq: splits at num_seqs // 2.");
  m.def(
      "compute_tbo_split",
      [](ForwardMode mode, int64_t num_tokens, const std::vector<int64_t>& extend_lens, int64_t tokens_per_seq,
         double threshold) { return compute_tbo_split(mode, num_tokens, extend_lens, tokens_per_seq, threshold); },
      nb::arg("mode"), nb::arg("num_tokens"), nb::arg("extend_lens") = std::vector<int64_t>{},
      nb::arg("tokens_per_seq") = 1, nb::arg("threshold") = kDefaultTboThreshold,
      "By forward mode: EXTEND and MIXED -> the extend rule; DECODE / TARGET_VERIFY -> the decode rule; IDLE and "
      "PREBUILT -> (0, 0); DRAFT_EXTEND -> None (TBO off).");

  nb::class_<TboSeqFields>(m, "TboSeqFields", "Per-sequence fields of a batch: seq_lens = prefix_lens + extend_lens.")
      .def(
          "__init__",
          [](TboSeqFields* self, std::vector<int64_t> extend_lens, std::vector<int64_t> prefix_lens,
             std::vector<int64_t> seq_lens) {
            new (self) TboSeqFields{std::move(extend_lens), std::move(prefix_lens), std::move(seq_lens)};
          },
          nb::arg("extend_lens"), nb::arg("prefix_lens"), nb::arg("seq_lens"))
      .def_rw("extend_lens", &TboSeqFields::extend_lens, "New tokens of each sequence in this batch.")
      .def_rw("prefix_lens", &TboSeqFields::prefix_lens, "Tokens already in the KV cache before this batch.")
      .def_rw("seq_lens", &TboSeqFields::seq_lens, "Total length after this batch.")
      .def_prop_ro("num_seqs", &TboSeqFields::num_seqs)
      .def("__repr__", [](const TboSeqFields& f) {
        return "TboSeqFields(extend_lens=" + list_repr(f.extend_lens) + ", prefix_lens=" + list_repr(f.prefix_lens) +
               ", seq_lens=" + list_repr(f.seq_lens) + ")";
      });

  nb::class_<TboChildren>(m, "TboChildren", "The two micro-batches of a split.")
      .def_ro("a", &TboChildren::a)
      .def_ro("b", &TboChildren::b)
      .def_ro("num_tokens_a", &TboChildren::num_tokens_a)
      .def_ro("num_tokens_b", &TboChildren::num_tokens_b)
      .def_ro("seq_begin_b", &TboChildren::seq_begin_b,
              "Parent index of B's first sequence (the cut sequence when two_chunk).");
  m.def("split_tbo_children", &split_tbo_children, nb::arg("parent"), nb::arg("split"),
        "The children's per-sequence fields. Raises InvalidArgumentError when the fields are inconsistent or the "
        "split does not fit the batch.");
}

void bind_executor(nb::module_& m) {
  m.def(
      "split_tbo_stages",
      [](const std::vector<PyOp>& ops) {
        const auto stages = split_tbo_stages(to_operations(ops, "ops"));
        std::vector<std::vector<size_t>> out;
        for (const auto& stage : stages) {
          auto& indices = out.emplace_back();
          for (const auto& op : stage) indices.push_back(op.fn.target<PythonCall>()->index);
        }
        return out;
      },
      nb::arg("ops"),
      "Cuts [(name, fn or None)] at its yield points (fn None): the indices of each stage's operations. A "
      "trailing yield adds no empty stage; consecutive yields give an empty one.");
  m.def(
      "execute_two_batch_overlap",
      [](const std::vector<PyOp>& ops_a, const std::vector<PyOp>& ops_b, int delta_stages) {
        const auto a = to_operations(ops_a, "ops_a");
        const auto b = to_operations(ops_b, "ops_b");
        nb::gil_scoped_release release;
        execute_two_batch_overlap(a, b, delta_stages);
      },
      nb::arg("ops_a"), nb::arg("ops_b"), nb::arg("delta_stages"),
      "Runs the stages of A and B on this thread: A's first delta_stages stages, then (A stage i + delta, B "
      "stage i) alternately, then B's last delta_stages stages. fn(batch_idx) gets 0 for A, 1 for B. Both lists "
      "need the same number of stages and 0 <= delta_stages <= stages (InvalidArgumentError before running). "
      "An exception from an operation propagates at once.");
}

}  // namespace

void register_tbo(nb::module_& parent) {
  nb::module_ m = parent.def_submodule("tbo", "Two-batch overlap: split rules and stage executor (epx/tbo.h).");
  bind_split(m);
  bind_executor(m);
}

}  // namespace epx::py

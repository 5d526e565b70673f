// The input files of `epx eplb plan`: the load file (--weights) and the current placement (--current).
// Separate from the command so that tests/fuzz/eplb_input_fuzz.cpp calls the very same parsers.
// Every function throws BadInput (exit 2) naming the flag, the file and the offending cell; nothing else
// escapes except std::bad_alloc.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace epx::cli {

// JSON {"weights": [[...], ...]} (or a bare array of rows), SGLang's {"logical_count": [...]} (2-D, or 3-D with
// the passes summed; epx/eplb/sglang_format.h), or CSV with one layer a line. Cells are plain
// decimal numbers (no hex, inf or nan); an empty cell, including after a trailing comma, is an error. Rows
// are returned as read: check_weights checks them. `path` names the file in messages.
std::vector<std::vector<double>> parse_weights(const std::string& text, const std::string& path);

// The library's weight checks, in the CLI's words, plus row sums: at least one layer and one expert, every
// row as long as row 0, every weight finite and >= 0, and every row's sum finite.
void check_weights(const std::vector<std::vector<double>>& weight, const std::string& path);

// An ExpertLocation JSON, {"phy2log": [[...], ...]} or SGLang's {"physical_to_logical_map": [[...], ...]}: num_layers rows of num_physical ids, each id in
// [0, num_logical) and every logical expert present in every row. Returns the rows flattened
// ([num_layers, num_physical]). Expects num_layers >= 1 and 1 <= num_logical <= num_physical.
std::vector<int32_t> parse_current(const std::string& text, int num_layers, int num_logical, int num_physical);

}  // namespace epx::cli

// SPDX-License-Identifier: MIT
// residency idle's result files: JSON (everything, for scripts), CSV (one row per sample, for
// spreadsheets) and a PNG plot of decode time against pause with one line per policy (gnuplot).
#pragma once

#include <string>

#include "workload/idle_benchmark.hpp"

namespace residency::workload {

// What the run was about, for the JSON and the plot's title.
struct IdleRunInfo {
  std::string model_path;
  bool synthetic_model = false;
  std::uint64_t model_bytes = 0;
  std::string model_summary;            // "llama, F16, n_vocab 32000, ..." or "123 weight matrices, F16"
  std::string backend;                  // IdleTarget::describe()
  std::string tool = "residency idle";  // the plot's title starts with it ("residency llama-idle")
};

// Errors name the file that could not be written.
Status write_idle_json(const std::string& path, const IdleResults& r, const IdleRunInfo& info);
Status write_idle_csv(const std::string& path, const IdleResults& r);
// Runs gnuplot. Returns an empty string on success, else why there is no plot (gnuplot missing
// or failing): a plot is a convenience, its absence is a warning, not a failure.
std::string write_idle_plot(const std::string& path, const IdleResults& r, const IdleRunInfo& info);
// The gnuplot script write_idle_plot runs (exposed for tests): `file_name` a plain name.
std::string idle_plot_script(const std::string& terminal, const std::string& file_name, const IdleResults& r,
                             const IdleRunInfo& info);
// What the plot's legend calls a policy: its name, and for `off` what off is.
std::string idle_plot_label(const IdlePolicy& policy);

}  // namespace residency::workload

// `epx doctor`: what this machine offers epx, and what that means.
#include <cstdio>
#include <thread>

#include "command.h"
#include "doctor.h"
#include "epx/version.h"

namespace epx::cli {
namespace {

void add_doctor(CLI::App& app) {
  auto* cmd = app.add_subcommand("doctor",
                                 "Report GPUs, peer access/NVLink between each pair, driver, CUDA and "
                                 "NCCL versions, and what they mean for epx");
  auto* as_json = cmd->add_flag("--json")->description("Print the report as JSON");
  cmd->callback([as_json] {
    nlohmann::json j = {{"epx_version", version()},
                        {"cuda_backend_built", built_with_cuda()},
                        {"host_cpu_threads", std::thread::hardware_concurrency()}};
    std::vector<std::string> verdicts;
#ifdef EPX_WITH_CUDA
    j["cuda"] = cuda_doctor();
    const auto& gpus = j["cuda"]["gpus"];
    if (!j["cuda"]["nccl_groups_rebuild_after_failure"].get<bool>()) {
      verdicts.push_back("NCCL " + j["cuda"]["nccl"].get<std::string>() +
                         " has no ncclCommRevoke (2.28.7): an NCCL group fails for good at its first timeout instead "
                         "of rebuilding its communicator (docs/reliability.md)");
    }
    if (gpus.empty()) {
      verdicts.push_back("no usable GPU: epx runs on the host backend (ranks as threads)");
    } else {
      bool all_peer = true;
      for (const auto& p : j["cuda"]["peer"]) all_peer = all_peer && p["peer_access"].get<bool>();
      bool all_sm90 = true;
      for (const auto& g : gpus) all_sm90 = all_sm90 && g["compute_capability"].get<std::string>() == "9.0";
      verdicts.push_back(std::to_string(gpus.size()) + " GPU(s): the cuda backend can run " +
                         std::to_string(gpus.size()) + " ranks in one process");
      if (!all_sm90) verdicts.push_back("some GPU is not sm_90: this build's kernels target sm_90 (Hopper) only");
      if (gpus.size() > 1) {
        verdicts.push_back(all_peer ? "every GPU pair has peer access: intranode NVLink kernels can run"
                                    : "some GPU pair lacks peer access: the intranode kernels cannot span those "
                                      "GPUs");
      }
    }
#else
    verdicts.push_back("this build has no CUDA backend: epx runs on the host backend (ranks as threads)");
#endif
    j["verdicts"] = verdicts;
    if (as_json->count() > 0) {
      std::printf("%s\n", j.dump(2).c_str());
      return;
    }
    std::printf("epx %s (%s)\n", version(), built_with_cuda() ? "cuda backend built" : "host backend only");
#ifdef EPX_WITH_CUDA
    const auto& c = j["cuda"];
    std::printf("CUDA driver %s, runtime %s, NCCL %s\n", c["cuda_driver"].get<std::string>().c_str(),
                c["cuda_runtime"].get<std::string>().c_str(), c["nccl"].get<std::string>().c_str());
    if (c.contains("error")) std::printf("CUDA: %s\n", c["error"].get<std::string>().c_str());
    for (const auto& g : c["gpus"]) {
      std::printf("GPU %d: %s, sm_%s, %d SMs, %.0f GiB, %d active NVLinks\n", g["index"].get<int>(),
                  g["name"].get<std::string>().c_str(), g["compute_capability"].get<std::string>().c_str(),
                  g["sms"].get<int>(), g["memory_gib"].get<double>(), g["active_nvlinks"].get<int>());
    }
    for (const auto& p : c["peer"]) {
      std::printf("GPU %d -> GPU %d: peer access %s, native atomics %s\n", p["from"].get<int>(), p["to"].get<int>(),
                  p["peer_access"].get<bool>() ? "yes" : "no", p["native_atomics"].get<bool>() ? "yes" : "no");
    }
#endif
    std::printf("host: %u CPU threads\n", std::thread::hardware_concurrency());
    for (const auto& v : verdicts) std::printf("- %s\n", v.c_str());
  });
}

const bool kRegistered = register_command(90, add_doctor);

}  // namespace
}  // namespace epx::cli

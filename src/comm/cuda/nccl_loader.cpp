#include "comm/cuda/nccl_loader.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <optional>

#include "core/check.h"
#include "core/timeout.h"

namespace epx::cuda {
namespace {

constexpr const char* kDefaultLibrary = "libnccl.so.2";

std::string version_string(int code) {
  // NCCL_VERSION(): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after.
  if (code < 10000) return fmt::format("{}.{}.{}", code / 1000, code % 1000 / 100, code % 100);
  return fmt::format("{}.{}.{}", code / 10000, code % 10000 / 100, code % 100);
}

std::string dl_error() {
  const char* e = dlerror();
  return e != nullptr ? e : "unknown dlerror";
}

const char* hint() {
  return "epx's CUDA backend loads NCCL on first use: install it (the CUDA toolkit's copy or `pip install "
         "nvidia-nccl-cu13`) and put its lib directory on LD_LIBRARY_PATH, or set EPX_NCCL_LIBRARY to the file";
}

template <typename Fn>
void resolve(void* handle, const std::string& library, const char* symbol, Fn& fn) {
  dlerror();
  void* p = dlsym(handle, symbol);
  if (p == nullptr) {
    detail::raise(ErrorCode::kUnsupported,
                  "NCCL library '{}' has no {}: {}; it is not NCCL or too old (epx needs >= {})", library, symbol,
                  dl_error(), version_string(NCCL_VERSION_CODE));
  }
  fn = reinterpret_cast<Fn>(p);
}

}  // namespace

std::string nccl_library_name() {
  const char* env = std::getenv("EPX_NCCL_LIBRARY");
  return env != nullptr && env[0] != '\0' ? env : kDefaultLibrary;
}

NcclApi load_nccl(const std::string& library) {
  // NOTE: never dlclose'd: communicators, NCCL's proxy threads and the table outlive any scope here.
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    detail::raise(ErrorCode::kUnsupported, "cannot load NCCL library '{}': {}. {}", library, dl_error(), hint());
  }
  NcclApi api;
  resolve(handle, library, "ncclGetVersion", api.GetVersion);
  resolve(handle, library, "ncclGetErrorString", api.GetErrorString);
  resolve(handle, library, "ncclGetUniqueId", api.GetUniqueId);
  resolve(handle, library, "ncclCommInitRankConfig", api.CommInitRankConfig);
  resolve(handle, library, "ncclCommAbort", api.CommAbort);
  resolve(handle, library, "ncclCommFinalize", api.CommFinalize);
  resolve(handle, library, "ncclCommDestroy", api.CommDestroy);
  resolve(handle, library, "ncclCommGetAsyncError", api.CommGetAsyncError);
  resolve(handle, library, "ncclCommUserRank", api.CommUserRank);
  resolve(handle, library, "ncclCommCount", api.CommCount);
  resolve(handle, library, "ncclCommCuDevice", api.CommCuDevice);
  resolve(handle, library, "ncclAllGather", api.AllGather);
  resolve(handle, library, "ncclAllReduce", api.AllReduce);
  resolve(handle, library, "ncclReduce", api.Reduce);
  resolve(handle, library, "ncclGroupStart", api.GroupStart);
  resolve(handle, library, "ncclGroupEnd", api.GroupEnd);
  resolve(handle, library, "ncclSend", api.Send);
  resolve(handle, library, "ncclRecv", api.Recv);
  resolve(handle, library, "ncclCommSplit", api.CommSplit);
  dlerror();
  api.CommRevoke = reinterpret_cast<decltype(api.CommRevoke)>(dlsym(handle, "ncclCommRevoke"));  // may be absent

  Dl_info info{};
  api.path = dladdr(reinterpret_cast<void*>(api.GetVersion), &info) != 0 && info.dli_fname != nullptr ? info.dli_fname
                                                                                                      : library;
  const ncclResult_t res = api.GetVersion(&api.version);
  EPX_CHECK(ErrorCode::kUnsupported, res == ncclSuccess, "NCCL library '{}': ncclGetVersion failed ({})", api.path,
            static_cast<int>(res));
  // NOTE: NCCL_CONFIG_INITIALIZER stamps the header's version into ncclConfig_t; an older library may
  // not know that layout, and may lack functions the headers promise.
  EPX_CHECK(ErrorCode::kUnsupported, api.version >= NCCL_VERSION_CODE,
            "NCCL library '{}' is version {}, older than the {} epx was built with. {}", api.path,
            version_string(api.version), version_string(NCCL_VERSION_CODE), hint());
  return api;
}

ncclResult_t comm_state(const NcclApi& api, ncclComm_t comm) {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = api.CommGetAsyncError(comm, &state);
  return r == ncclSuccess ? state : r;
}

ncclResult_t wait_comm(const NcclApi& api, ncclComm_t comm, std::chrono::steady_clock::time_point deadline) {
  ncclResult_t state = ncclInProgress;
  detail::poll_until(deadline, [&] {
    state = comm_state(api, comm);
    return state != ncclInProgress;
  });
  return state;
}

const NcclApi& nccl() {
  // NOTE: the once-callable catches and stores the error instead of throwing through call_once, so a
  // failure is sticky and every caller sees the same message.
  static std::once_flag once;
  static NcclApi api;
  static std::optional<Error> error;
  std::call_once(once, [] {
    try {
      api = load_nccl(nccl_library_name());
    } catch (const Error& e) {
      error = e;
    }
  });
  if (error) throw *error;
  return api;
}

}  // namespace epx::cuda

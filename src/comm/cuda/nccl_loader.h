// NCCL, loaded on first use (private; CUDA builds only).
//
// libepx links no libnccl: the library (and a Python extension that links it statically) must load on a
// machine without NCCL, a driver or a GPU. nccl.h is included for types and signatures only; every NCCL
// call of the library goes through the table below, e.g. `nccl().AllGather(...)`.
//
// Which library: the path in $EPX_NCCL_LIBRARY if set, else the soname "libnccl.so.2" (so LD_LIBRARY_PATH,
// the rpath of the executable and ldconfig apply). NOTE: a process that already has libnccl.so.2 loaded
// (PyTorch, an application linking NCCL) gets that same copy back from dlopen, so communicators it created
// are valid here. Pointing EPX_NCCL_LIBRARY at a different file loads a second NCCL, whose functions must
// not be given the first one's communicators.
#pragma once

#include <nccl.h>

#include <chrono>
#include <string>

namespace epx::cuda {

// Every NCCL function epx's library calls, named as in nccl.h without the "nccl" prefix.
struct NcclApi {
  decltype(&ncclGetVersion) GetVersion = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
  decltype(&ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&ncclCommAbort) CommAbort = nullptr;
  decltype(&ncclCommFinalize) CommFinalize = nullptr;
  decltype(&ncclCommDestroy) CommDestroy = nullptr;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&ncclCommUserRank) CommUserRank = nullptr;
  decltype(&ncclCommCount) CommCount = nullptr;
  decltype(&ncclCommCuDevice) CommCuDevice = nullptr;
  decltype(&ncclAllGather) AllGather = nullptr;
  decltype(&ncclAllReduce) AllReduce = nullptr;
  decltype(&ncclReduce) Reduce = nullptr;
  decltype(&ncclGroupStart) GroupStart = nullptr;
  decltype(&ncclGroupEnd) GroupEnd = nullptr;
  decltype(&ncclSend) Send = nullptr;  // the hierarchical path's network leg (net_leg.cpp)
  decltype(&ncclRecv) Recv = nullptr;
  decltype(&ncclCommSplit) CommSplit = nullptr;  // rebuilding an owned communicator after a failure (owned_comm.h)
  // Optional (NCCL >= 2.28.7; null in an older library): ends a communicator's work in flight so that it can be split
  // into a fresh one. Declared by hand so that headers older than 2.28.7 still compile.
  ncclResult_t (*CommRevoke)(ncclComm_t comm, int revoke_flags) = nullptr;

  std::string path;  // the file actually loaded (from dladdr), for messages and `epx doctor`
  int version = 0;   // ncclGetVersion's code, e.g. 22809 for 2.28.9
};

// The process's NCCL table, loaded on the first call (thread-safe, std::call_once). The first outcome
// is kept for the life of the process: a failed load is not retried, later calls throw the same error.
// The library is never unloaded. Throws Error(kUnsupported) naming the library and the dlerror() text
// when it cannot be opened or lacks a function, or naming both versions when it is older than the
// nccl.h epx was built with (NCCL_VERSION_CODE; NCCL_CONFIG_INITIALIZER carries that version).
const NcclApi& nccl();

// Loads a fresh table from `library` (a path or a soname), with the same checks and errors as nccl(),
// without caching; nccl() calls it once. Exposed for tests.
NcclApi load_nccl(const std::string& library);

// The state of a communicator's pending work: ncclSuccess, ncclInProgress (a non-blocking call not finished), or
// the error it ended with.
ncclResult_t comm_state(const NcclApi& api, ncclComm_t comm);
inline ncclResult_t comm_state(ncclComm_t comm) { return comm_state(nccl(), comm); }

// Polls comm_state every 20 us until it is no longer ncclInProgress or `deadline` passed; returns the last state
// (ncclInProgress at the deadline).
ncclResult_t wait_comm(const NcclApi& api, ncclComm_t comm, std::chrono::steady_clock::time_point deadline);
inline ncclResult_t wait_comm(ncclComm_t comm, std::chrono::steady_clock::time_point deadline) {
  return wait_comm(nccl(), comm, deadline);
}

// The library nccl() loads: $EPX_NCCL_LIBRARY if set and not empty, else "libnccl.so.2".
std::string nccl_library_name();

}  // namespace epx::cuda

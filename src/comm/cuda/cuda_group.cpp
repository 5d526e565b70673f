#include "comm/cuda/cuda_group.h"

#include <cuda_runtime.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <nccl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/cuda/nccl_loader.h"
#include "comm/cuda/owned_comm.h"
#include "core/check.h"
#include "core/cuda/cuda_util.h"
#include "core/limits.h"
#include "core/timeout.h"

namespace epx::cuda {
namespace {

// Ranks as threads: collectives delegate to a host group; each rank owns one device.
class ThreadCudaGroup final : public CudaGroup {
 public:
  ThreadCudaGroup(std::shared_ptr<Group> host, int device) : host_(std::move(host)), device_(device) {}
  int rank() const override { return host_->rank(); }
  Topology topology() const override { return host_->topology(); }
  int num_ranks() const override { return host_->num_ranks(); }
  Device device() const override { return Device::cuda(device_); }
  int64_t timeout_ms() const override { return host_->timeout_ms(); }
  void barrier() override { host_->barrier(); }
  void all_gather_bytes(const void* send, void* recv, size_t bytes) override {
    host_->all_gather_bytes(send, recv, bytes);
  }
  bool single_process() const override { return true; }

 private:
  std::shared_ptr<Group> host_;
  int device_;
};

void check_nccl(ncclResult_t result, const char* what) {
  if (result != ncclSuccess) {
    detail::raise(ErrorCode::kNcclError, "{} failed: {}", what, nccl().GetErrorString(result));
  }
}

// One process per GPU: collectives are ncclAllGather on a private stream. Every wait is bounded:
// - the host data goes through pinned staging, so no cudaMemcpyAsync blocks the host (from pageable
//   memory it returns only once the all-gather ahead of it finished, and the deadline loop never ran);
// - the stream is polled against the deadline together with ncclCommGetAsyncError, so a peer's failure
//   that NCCL detects ends the wait at once;
// - an owned communicator is non-blocking (created with blocking = 0), so neither its creation nor the
//   first collective (which connects the peers) blocks the host; on a timeout or an NCCL error it is
//   revoked and rebuilt in the next collective (OwnedComm), or aborted where that cannot be done.
// A borrowed communicator (create_cuda_group(comm)) is never aborted by epx: after a failure its
// all-gather may still be in flight, and the caller must abort it (see docs/reliability.md).

class NcclCudaGroup final : public CudaGroup {
 public:
  // owns_comm: the group destroys (or aborts) the communicator with itself, and the spare (OwnedComm); owned ones are
  // non-blocking.
  NcclCudaGroup(ncclComm_t comm, const CudaGroupOptions& options, bool owns_comm = false, ncclComm_t spare = nullptr)
      : timeout_ms_(detail::clamp_timeout_ms(options.timeout_ms)) {
    check_nccl(nccl().CommUserRank(comm, &rank_), "ncclCommUserRank");
    check_nccl(nccl().CommCount(comm, &num_ranks_), "ncclCommCount");
    topology_ = cuda_group_topology(num_ranks_, options.gpus_per_node);
    check_nccl(nccl().CommCuDevice(comm, &device_), "ncclCommCuDevice");
    DeviceGuard guard(device_);
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    // NOTE: last, so that a throw above leaves the communicator to the caller (create_cuda_group aborts it).
    if (owns_comm) {
      owned_ = std::make_unique<OwnedComm>(comm, rank_, timeout_ms_, nccl(), spare);
    } else {
      borrowed_ = comm;
    }
  }
  ~NcclCudaGroup() override {
    DeviceGuard guard(device_);
    if (!failed_.empty() && owned_ == nullptr) {
      // NOTE: the caller's communicator may still run our all-gather into scratch_: freeing it (cudaFree
      // synchronizes the device) could wait forever, so a failed borrowed group leaks its staging.
      cudaStreamDestroy(stream_);
      return;
    }
    owned_.reset();  // finalized, or aborted (bounded)
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (host_stage_ != nullptr) cudaFreeHost(host_stage_);
    cudaStreamDestroy(stream_);
  }
  int rank() const override { return rank_; }
  int num_ranks() const override { return num_ranks_; }
  Device device() const override { return Device::cuda(device_); }
  int64_t timeout_ms() const override { return timeout_ms_; }
  Topology topology() const override { return topology_; }
  ncclComm_t nccl_comm() const override { return owned_ != nullptr ? owned_->get() : borrowed_; }
  int nccl_rebuilds() const override { return owned_ != nullptr ? owned_->rebuilds() : 0; }
  bool nccl_rebuild_pending() const override {
    return owned_ != nullptr && owned_->state() == OwnedComm::State::kRevoked;
  }
  ncclComm_t collective_comm() override {
    if (nccl_rebuild_pending()) rebuild();
    EPX_CHECK(ErrorCode::kPeerFailure, failed_.empty(),
              "cuda rank {}: the NCCL group failed earlier ({}) and cannot be used again; destroy the buffers on it "
              "and the group, and create a new group",
              rank_, failed_);
    return nccl_comm();
  }
  void barrier() override {
    const char mine = 1;
    std::vector<char> all(num_ranks_);
    all_gather_bytes(&mine, all.data(), 1);
  }
  void all_gather_bytes(const void* send, void* recv, size_t bytes) override {
    EPX_CHECK_ARG(bytes == 0 || (send != nullptr && recv != nullptr), "all_gather_bytes: null buffer for {} bytes",
                  bytes);
    ncclComm_t comm = collective_comm();
    DeviceGuard guard(device_);
    const size_t total = static_cast<size_t>(
        detail::checked_mul(static_cast<int64_t>(bytes), num_ranks_, "all_gather_bytes: bytes * num_ranks"));
    reserve_staging(total + bytes);
    char* dev_send = static_cast<char*>(scratch_) + total;
    char* host_send = static_cast<char*>(host_stage_) + total;
    if (bytes > 0) std::memcpy(host_send, send, bytes);
    const auto deadline = detail::deadline_after_ms(timeout_ms_);
    check_cuda(cudaMemcpyAsync(dev_send, host_send, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync");
    const ncclResult_t posted = nccl().AllGather(dev_send, scratch_, bytes, ncclChar, comm, stream_);
    if (posted == ncclInProgress) {
      wait_comm_ready(comm, deadline, "ncclAllGather");  // a non-blocking communicator finishes the call later
    } else if (posted != ncclSuccess) {
      fail(ErrorCode::kNcclError, fmt::format("ncclAllGather failed: {}", nccl().GetErrorString(posted)));
    }
    check_cuda(cudaMemcpyAsync(host_stage_, scratch_, total, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync");
    wait_stream(comm, deadline);
    if (total > 0) std::memcpy(recv, host_stage_, total);
  }
  bool single_process() const override { return false; }
  // Owned: revokes the communicator (a rebuild in the next collective) or, where that fails, aborts it for good; the
  // revoke or the abort ends the kernels, so the streams drain. Borrowed: left to its owner, the group failed for
  // good. Then throws.
  [[noreturn]] void fail(ErrorCode code, const std::string& what) override {
    if (owned_ != nullptr) {
      bool revoked = owned_->revoke();
      constexpr int64_t kDrainMs = 10'000;  // how long the stream may take to drain once NCCL's work was ended
      // NOTE: bounded, not cudaStreamSynchronize: the revoke should have ended the NCCL kernel the stream waits
      // behind; if the stream still does not drain, the communicator is aborted for good (which ends NCCL's kernels).
      if (!stream_idle_by(stream_, detail::deadline_after_ms(kDrainMs)) && revoked) {
        owned_->fail_for_good(fmt::format("the group's stream did not drain within {} ms of ncclCommRevoke", kDrainMs));
        revoked = false;
        stream_idle_by(stream_, detail::deadline_after_ms(kDrainMs));
      }
      if (revoked) {
        detail::raise(code,
                      "cuda rank {}: {}; the outputs of this call are invalid. The group revoked its NCCL "
                      "communicator (ncclCommRevoke ended the NCCL work in flight) and rebuilds it in its next "
                      "collective call: make that call on every rank, all within {} ms of each other (twice the "
                      "timeout), or the group fails for good",
                      rank_, what, rebuild_wait_ms());
      }
      if (failed_.empty()) failed_ = what + " (" + owned_->failure() + ")";
      detail::raise(code,
                    "cuda rank {}: {}; the group aborted its NCCL communicator ({}) and cannot be used again: "
                    "destroy it and the buffers on it, and create a new group",
                    rank_, what, owned_->failure());
    }
    if (failed_.empty()) failed_ = what;
    detail::raise(code,
                  "cuda rank {}: {}; the caller's NCCL communicator may still run epx's NCCL calls (an all-gather, "
                  "a hierarchical exchange): abort it (ncclCommAbort; it cannot be reused), then destroy this group "
                  "and the buffers on it",
                  rank_, what);
  }

 private:
  // How long a rebuild waits for the other ranks: a rank one failed call behind its peers (it timed out in the call
  // after theirs) still arrives within twice the timeout.
  int64_t rebuild_wait_ms() const { return std::min(2 * timeout_ms_, kMaxTimeoutMs); }

  // The revoked communicator's rebuild (collective); on failure the group fails for good and this throws.
  void rebuild() {
    DeviceGuard guard(device_);
    bool timed_out = false;
    if (owned_->ready(detail::deadline_after_ms(rebuild_wait_ms()), &timed_out) != nullptr) return;
    failed_ = owned_->failure();
    detail::raise(timed_out ? ErrorCode::kTimeout : ErrorCode::kNcclError,
                  "cuda rank {}: {} (waited {} ms, twice the timeout); the group aborted its NCCL communicator and "
                  "cannot be used again: destroy it and the buffers on it, and create a new group",
                  rank_, owned_->failure(), rebuild_wait_ms());
  }

  // Waits until a non-blocking communicator finished its pending call (creation, a collective),
  // polling ncclCommGetAsyncError against `deadline`; fails the group on an error or the deadline.
  void wait_comm_ready(ncclComm_t comm, std::chrono::steady_clock::time_point deadline, const char* what) {
    const ncclResult_t state = wait_comm(comm, deadline);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      fail(ErrorCode::kNcclError, fmt::format("{}: NCCL reports {}", what, nccl().GetErrorString(state)));
    }
    fail(ErrorCode::kTimeout,
         fmt::format("{} did not complete within {} ms: a peer rank is absent or stuck", what, timeout_ms_));
  }

  void reserve_staging(size_t bytes) {
    if (bytes <= scratch_bytes_) return;
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (host_stage_ != nullptr) cudaFreeHost(host_stage_);
    scratch_ = host_stage_ = nullptr;
    scratch_bytes_ = 0;
    const size_t size = std::max<size_t>(bytes, 4096);
    check_cuda(cudaMalloc(&scratch_, size), "cudaMalloc (group scratch)");
    check_cuda(cudaMallocHost(&host_stage_, size), "cudaMallocHost (group staging)");
    scratch_bytes_ = size;
  }

  void wait_stream(ncclComm_t comm, std::chrono::steady_clock::time_point deadline) {
    while (true) {
      const cudaError_t status = cudaStreamQuery(stream_);
      if (status == cudaSuccess) return;
      if (status != cudaErrorNotReady) check_cuda(status, "all_gather_bytes");
      const ncclResult_t state = comm_state(comm);
      if (state != ncclSuccess && state != ncclInProgress) {
        fail(ErrorCode::kPeerFailure,
             fmt::format("all_gather_bytes: NCCL reports {} (a peer failed)", nccl().GetErrorString(state)));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        fail(
            ErrorCode::kTimeout,
            fmt::format("waited {} ms in all_gather_bytes for its peers: a peer rank is absent or stuck", timeout_ms_));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  std::unique_ptr<OwnedComm> owned_;  // create_cuda_group(unique_id, ...)
  ncclComm_t borrowed_ = nullptr;     // create_cuda_group(comm): the caller's
  int64_t timeout_ms_;
  Topology topology_;
  int rank_ = 0;
  int num_ranks_ = 0;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;     // device: [num_ranks * bytes] received, then [bytes] sent
  void* host_stage_ = nullptr;  // pinned host, the same layout
  size_t scratch_bytes_ = 0;
  std::string failed_;  // why the group failed for good; empty while it works
};

}  // namespace

void CudaGroup::fail(ErrorCode code, const std::string& what) { detail::raise(code, "cuda rank {}: {}", rank(), what); }

Topology cuda_group_topology(int num_ranks, int gpus_per_node) {
  EPX_CHECK_ARG(gpus_per_node >= 0 && gpus_per_node <= num_ranks,
                "gpus_per_node must be in [0, num_ranks = {}] (0: one node), got {}", num_ranks, gpus_per_node);
  EPX_CHECK_ARG(gpus_per_node == 0 || num_ranks % gpus_per_node == 0, "gpus_per_node = {} must divide num_ranks = {}",
                gpus_per_node, num_ranks);
  const int per_node = gpus_per_node == 0 ? num_ranks : gpus_per_node;
  return Topology{num_ranks / per_node, per_node};
}

std::shared_ptr<CudaWorld> map_shared_world(Group& group) {
  constexpr size_t kNameBytes = 64;
  // Rank 0 creates the object under a fresh name; the others learn the name and map it.
  char name[kNameBytes] = {};
  int fd = -1;
  if (group.rank() == 0) {
    std::random_device entropy;
    const uint64_t salt = (uint64_t{entropy()} << 32) ^ entropy();
    std::snprintf(name, sizeof(name), "/epx-world-%d-%016llx", static_cast<int>(getpid()),
                  static_cast<unsigned long long>(salt));
    fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0 && ftruncate(fd, sizeof(CudaWorld)) != 0) {
      close(fd);
      shm_unlink(name);
      fd = -1;
    }
    if (fd < 0) name[0] = '\0';
  }
  // The name goes once every rank mapped the object, or the call failed (an all-gather timed out).
  struct Unlink {
    const char* name;
    ~Unlink() {
      if (name != nullptr && name[0] != '\0') shm_unlink(name);
    }
  } unlink_guard{group.rank() == 0 ? name : nullptr};
  std::vector<char> names(kNameBytes * static_cast<size_t>(group.num_ranks()));
  group.all_gather_bytes(name, names.data(), kNameBytes);
  std::memcpy(name, names.data(), kNameBytes);  // rank 0's
  name[kNameBytes - 1] = '\0';
  if (group.rank() != 0 && name[0] != '\0') fd = shm_open(name, O_RDWR, 0600);
  void* p = MAP_FAILED;
  if (fd >= 0) {
    p = mmap(nullptr, sizeof(CudaWorld), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
  }
  std::shared_ptr<CudaWorld> world;
  if (p != MAP_FAILED) {
    // Rank 0 constructs the object before the second all-gather; nobody reads it before that.
    if (group.rank() == 0) new (p) CudaWorld();
    world.reset(static_cast<CudaWorld*>(p), [](CudaWorld* w) { munmap(w, sizeof(CudaWorld)); });
  }
  const char mapped = world != nullptr;
  std::vector<char> all(static_cast<size_t>(group.num_ranks()));
  group.all_gather_bytes(&mapped, all.data(), 1);
  const bool everyone = std::all_of(all.begin(), all.end(), [](char c) { return c != 0; });
  return everyone ? world : nullptr;
}

std::shared_ptr<CudaWorld> share_world(CudaGroup& group) {
  EPX_CHECK_ARG(group.num_ranks() <= kWorldMaxRanks, "a cuda buffer's group has at most {} ranks, got {}",
                kWorldMaxRanks, group.num_ranks());
  if (!group.single_process()) return map_shared_world(group);
  // Ranks as threads: rank 0's object, handed over by address; the barrier keeps rank 0's reference alive
  // until every rank copied it.
  std::shared_ptr<CudaWorld> world = group.rank() == 0 ? std::make_shared<CudaWorld>() : nullptr;
  const std::shared_ptr<CudaWorld>* mine = &world;
  std::vector<const std::shared_ptr<CudaWorld>*> all(static_cast<size_t>(group.num_ranks()));
  group.all_gather_bytes(&mine, all.data(), sizeof(mine));
  if (group.rank() != 0) world = *all[0];
  group.barrier();
  return world;
}

}  // namespace epx::cuda

namespace epx {

std::vector<std::shared_ptr<Group>> create_cuda_groups(const std::vector<int>& devices,
                                                       const CudaGroupOptions& options) {
  const int num_ranks = static_cast<int>(devices.size());
  EPX_CHECK_ARG(num_ranks >= 1 && num_ranks <= kCudaMaxRanks, "devices must list 1 to {} ranks, got {}", kCudaMaxRanks,
                num_ranks);
  EPX_CHECK_ARG(options.timeout_ms >= 1, "timeout_ms must be >= 1, got {}", options.timeout_ms);
  cuda::cuda_group_topology(num_ranks, options.gpus_per_node);  // checked before any CUDA call
  int count = 0;
  cuda::check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount (create_cuda_groups)");
  for (int r = 0; r < num_ranks; ++r) {
    EPX_CHECK_ARG(devices[r] >= 0 && devices[r] < count, "devices[{}] = {} is outside [0, {} visible GPUs)", r,
                  devices[r], count);
  }
  HostGroupOptions host_options;
  host_options.timeout_ms = detail::clamp_timeout_ms(options.timeout_ms);
  host_options.gpus_per_node = options.gpus_per_node;
  auto hosts = create_host_groups(num_ranks, host_options);
  std::vector<std::shared_ptr<Group>> groups;
  for (int r = 0; r < num_ranks; ++r) groups.push_back(std::make_shared<cuda::ThreadCudaGroup>(hosts[r], devices[r]));
  return groups;
}

std::shared_ptr<Group> create_cuda_group(ncclComm_t comm, const CudaGroupOptions& options) {
  EPX_CHECK_ARG(comm != nullptr, "comm must not be null");
  EPX_CHECK_ARG(options.timeout_ms >= 1, "timeout_ms must be >= 1, got {}", options.timeout_ms);
  return std::make_shared<cuda::NcclCudaGroup>(comm, options);
}

std::vector<uint8_t> nccl_unique_id() {
  ncclUniqueId id;
  cuda::check_nccl(cuda::nccl().GetUniqueId(&id), "ncclGetUniqueId");
  return {reinterpret_cast<const uint8_t*>(id.internal), reinterpret_cast<const uint8_t*>(id.internal) + sizeof(id)};
}

std::shared_ptr<Group> create_cuda_group(const std::vector<uint8_t>& unique_id, int rank, int num_ranks, int device,
                                         const CudaGroupOptions& options) {
  ncclUniqueId id;
  EPX_CHECK_ARG(unique_id.size() == sizeof(id), "unique_id must hold {} bytes (NCCL_UNIQUE_ID_BYTES), got {}",
                sizeof(id), unique_id.size());
  EPX_CHECK_ARG(num_ranks >= 1, "num_ranks must be >= 1, got {}", num_ranks);
  EPX_CHECK_ARG(rank >= 0 && rank < num_ranks, "rank must be in [0, {}), got {}", num_ranks, rank);
  EPX_CHECK_ARG(options.timeout_ms >= 1, "timeout_ms must be >= 1, got {}", options.timeout_ms);
  cuda::cuda_group_topology(num_ranks, options.gpus_per_node);  // before the communicator exists
  int count = 0;
  cuda::check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount (create_cuda_group)");
  EPX_CHECK_ARG(device >= 0 && device < count, "device = {} is outside [0, {} visible GPUs)", device, count);
  std::memcpy(id.internal, unique_id.data(), sizeof(id));
  cuda::DeviceGuard guard(device);
  // NOTE: non-blocking, so that neither this call nor the group's first all-gather (which connects the
  // peers) can block forever on an absent rank; every wait polls ncclCommGetAsyncError with a deadline.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t created = cuda::nccl().CommInitRankConfig(&comm, num_ranks, id, rank, &config);
  if (created != ncclSuccess && created != ncclInProgress) {
    if (comm != nullptr) cuda::nccl().CommAbort(comm);
    cuda::check_nccl(created, "ncclCommInitRankConfig");
  }
  const ncclResult_t state =
      cuda::wait_comm(comm, detail::deadline_after_ms(detail::clamp_timeout_ms(options.timeout_ms)));
  if (state != ncclSuccess) {
    cuda::nccl().CommAbort(comm);
    if (state != ncclInProgress) cuda::check_nccl(state, "ncclCommInitRankConfig");
    detail::raise(ErrorCode::kTimeout,
                  "cuda rank {}: creating the NCCL communicator of {} ranks did not complete within {} ms: a "
                  "rank did not join (each of the {} processes must call create_cuda_group with the same id)",
                  rank, num_ranks, detail::clamp_timeout_ms(options.timeout_ms), num_ranks);
  }
  // The spare the group rebuilds from after a failure (OwnedComm): split off now, while every connection is sound.
  bool timed_out = false;
  std::string why;
  const ncclComm_t spare =
      cuda::split_same_ranks(cuda::nccl(), comm, rank,
                             detail::deadline_after_ms(detail::clamp_timeout_ms(options.timeout_ms)), &timed_out, &why);
  if (spare == nullptr) {  // comm was aborted
    detail::raise(timed_out ? ErrorCode::kTimeout : ErrorCode::kNcclError,
                  "cuda rank {}: splitting the group's spare communicator{} (the {} processes must each call "
                  "create_cuda_group with the same id; waited up to {} ms)",
                  rank, why, num_ranks, detail::clamp_timeout_ms(options.timeout_ms));
  }
  try {
    return std::make_shared<cuda::NcclCudaGroup>(comm, options, /*owns_comm=*/true, spare);
  } catch (...) {
    cuda::nccl().CommAbort(spare);
    cuda::nccl().CommAbort(comm);
    throw;
  }
}

}  // namespace epx

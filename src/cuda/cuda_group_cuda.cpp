#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "core/check.h"
#include "core/timeout.h"
#include "cuda/cuda_group.h"
#include "cuda/cuda_util.h"
#include "cuda/nccl_loader.h"

namespace epx::cuda {
namespace {

// Ranks as threads: collectives delegate to a host group; each rank owns one device.
class ThreadCudaGroup final : public CudaGroup {
 public:
  ThreadCudaGroup(std::shared_ptr<Group> host, std::shared_ptr<CudaWorld> world, int device)
      : host_(std::move(host)), world_(std::move(world)), device_(device) {}
  int rank() const override { return host_->rank(); }
  int num_ranks() const override { return host_->num_ranks(); }
  Device device() const override { return Device::cuda(device_); }
  int64_t timeout_ms() const override { return host_->timeout_ms(); }
  void barrier() override { host_->barrier(); }
  void all_gather_bytes(const void* send, void* recv, size_t bytes) override {
    host_->all_gather_bytes(send, recv, bytes);
  }
  bool single_process() const override { return true; }
  CudaWorld* world() const override { return world_.get(); }

 private:
  std::shared_ptr<Group> host_;
  std::shared_ptr<CudaWorld> world_;
  int device_;
};

void check_nccl(ncclResult_t result, const char* what) {
  if (result != ncclSuccess) {
    detail::raise(ErrorCode::kNcclError, "{} failed: {}", what, nccl().GetErrorString(result));
  }
}

// One process per GPU: collectives are ncclAllGather on a private stream, waited on with a deadline.
class NcclCudaGroup final : public CudaGroup {
 public:
  // owns_comm: the group destroys the communicator with itself.
  NcclCudaGroup(ncclComm_t comm, const CudaGroupOptions& options, bool owns_comm = false)
      : comm_(comm), owns_comm_(owns_comm), timeout_ms_(detail::clamp_timeout_ms(options.timeout_ms)) {
    check_nccl(nccl().CommUserRank(comm, &rank_), "ncclCommUserRank");
    check_nccl(nccl().CommCount(comm, &num_ranks_), "ncclCommCount");
    check_nccl(nccl().CommCuDevice(comm, &device_), "ncclCommCuDevice");
    DeviceGuard guard(device_);
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  }
  ~NcclCudaGroup() override {
    DeviceGuard guard(device_);
    if (scratch_ != nullptr) cudaFree(scratch_);
    cudaStreamDestroy(stream_);
    if (owns_comm_) nccl().CommDestroy(comm_);
  }
  int rank() const override { return rank_; }
  int num_ranks() const override { return num_ranks_; }
  Device device() const override { return Device::cuda(device_); }
  int64_t timeout_ms() const override { return timeout_ms_; }
  void barrier() override {
    const char mine = 1;
    std::vector<char> all(num_ranks_);
    all_gather_bytes(&mine, all.data(), 1);
  }
  void all_gather_bytes(const void* send, void* recv, size_t bytes) override {
    EPX_CHECK_ARG(bytes == 0 || (send != nullptr && recv != nullptr), "all_gather_bytes: null buffer for {} bytes",
                  bytes);
    DeviceGuard guard(device_);
    const size_t total = bytes * num_ranks_;
    if (total + bytes > scratch_bytes_) {
      if (scratch_ != nullptr) cudaFree(scratch_);
      scratch_ = nullptr;
      scratch_bytes_ = std::max<size_t>(total + bytes, 4096);
      check_cuda(cudaMalloc(&scratch_, scratch_bytes_), "cudaMalloc (group scratch)");
    }
    char* dev_send = static_cast<char*>(scratch_) + total;
    check_cuda(cudaMemcpyAsync(dev_send, send, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync");
    check_nccl(nccl().AllGather(dev_send, scratch_, bytes, ncclChar, comm_, stream_), "ncclAllGather");
    check_cuda(cudaMemcpyAsync(recv, scratch_, total, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync");
    // NOTE: poll with a deadline instead of cudaStreamSynchronize so that a missing peer is a timeout.
    const auto deadline = detail::deadline_after_ms(timeout_ms_);
    while (true) {
      const cudaError_t status = cudaStreamQuery(stream_);
      if (status == cudaSuccess) break;
      if (status != cudaErrorNotReady) check_cuda(status, "all_gather_bytes");
      if (std::chrono::steady_clock::now() > deadline) {
        detail::raise(ErrorCode::kTimeout, "cuda rank {} waited {} ms in all_gather_bytes for its peers", rank_,
                      timeout_ms_);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  bool single_process() const override { return false; }
  CudaWorld* world() const override { return nullptr; }

 private:
  ncclComm_t comm_;
  bool owns_comm_ = false;
  int64_t timeout_ms_;
  int rank_ = 0;
  int num_ranks_ = 0;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

}  // namespace
}  // namespace epx::cuda

namespace epx {

std::vector<std::shared_ptr<Group>> create_cuda_groups(const std::vector<int>& devices,
                                                       const CudaGroupOptions& options) {
  const int num_ranks = static_cast<int>(devices.size());
  EPX_CHECK_ARG(num_ranks >= 1 && num_ranks <= 8, "devices must list 1 to 8 ranks, got {}", num_ranks);
  EPX_CHECK_ARG(options.timeout_ms >= 1, "timeout_ms must be >= 1, got {}", options.timeout_ms);
  int count = 0;
  cuda::check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount (create_cuda_groups)");
  for (int r = 0; r < num_ranks; ++r) {
    EPX_CHECK_ARG(devices[r] >= 0 && devices[r] < count, "devices[{}] = {} is outside [0, {} visible GPUs)", r,
                  devices[r], count);
  }
  HostGroupOptions host_options;
  host_options.timeout_ms = detail::clamp_timeout_ms(options.timeout_ms);
  auto hosts = create_host_groups(num_ranks, host_options);
  auto world = std::make_shared<cuda::CudaWorld>();
  std::vector<std::shared_ptr<Group>> groups;
  for (int r = 0; r < num_ranks; ++r) {
    groups.push_back(std::make_shared<cuda::ThreadCudaGroup>(hosts[r], world, devices[r]));
  }
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
  int count = 0;
  cuda::check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount (create_cuda_group)");
  EPX_CHECK_ARG(device >= 0 && device < count, "device = {} is outside [0, {} visible GPUs)", device, count);
  std::memcpy(id.internal, unique_id.data(), sizeof(id));
  cuda::DeviceGuard guard(device);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  ncclComm_t comm = nullptr;
  cuda::check_nccl(cuda::nccl().CommInitRankConfig(&comm, num_ranks, id, rank, &config), "ncclCommInitRankConfig");
  try {
    return std::make_shared<cuda::NcclCudaGroup>(comm, options, /*owns_comm=*/true);
  } catch (...) {
    cuda::nccl().CommDestroy(comm);
    throw;
  }
}

}  // namespace epx

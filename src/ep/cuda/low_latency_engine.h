// The low-latency half of the cuda Buffer: owns the peer-visible low-latency region and runs the
// kernels of low_latency.h behind the Buffer contract (private to the CUDA backend).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/cuda/cuda_group.h"
#include "comm/cuda/peer_memory.h"
#include "ep/cuda/hierarchical_low_latency_engine.h"
#include "ep/cuda/low_latency.h"
#include "ep/validate.h"
#include "epx/buffer.h"

namespace epx::cuda {

class LowLatencyEngine {
 public:
  // Collective over `group`: allocates `bytes` on `device`, zeroes it and maps every rank's region.
  // config: the same on every rank (Buffer::create checked it). relay_group: the hierarchical routing
  // (LowLatencyRouting) on that group's topology, through a LowLatencyRelay; only the regions of this rank's node are
  // mapped then; node_partials is BufferOptions::node_partials for its combine. Null: the flat routing.
  LowLatencyEngine(Group& group, bool single_process, int device, int64_t bytes, std::shared_ptr<Allocator> allocator,
                   const LowLatencyConfig& config, CudaGroup* relay_group = nullptr,
                   NodePartials node_partials = NodePartials::kFloat32);
  ~LowLatencyEngine();
  LowLatencyEngine(const LowLatencyEngine&) = delete;
  LowLatencyEngine& operator=(const LowLatencyEngine&) = delete;

  LowLatencyDispatchResult dispatch(const LowLatencyDispatchArgs& args);
  LowLatencyCombineResult combine(const LowLatencyCombineArgs& args);
  void mask_rank(int rank);
  void unmask_rank(int rank);
  std::vector<bool> rank_mask() const;
  void clear_rank_mask();
  // Collective: see Buffer::clean_low_latency_buffer.
  void clean();

 private:
  // Fixes (M, H, E) at the first dispatch and checks later calls use the same ones.
  void ensure_layout(int64_t max_tokens, int64_t hidden, int64_t num_experts);
  // Logs and clears a timeout the kernels recorded (the peer is already masked on the device); with
  // LowLatencyConfig::raise_on_timeout also keeps it in pending_timeout_.
  void report_device_events();
  // Raises (once) pending_timeout_ as kTimeout. Called once a combine is enqueued (after its receive, with a hook),
  // so the rank's calls stay in step with its peers'.
  void raise_pending_timeout();
  int* device_mask() const;

  Group& group_;
  int device_;
  int rank_;
  int num_ranks_;
  int64_t region_bytes_;
  std::shared_ptr<char> region_;  // outputs are views into it and keep it alive
  PeerRegions peers_map_;
  ErrorRecord* error_ = nullptr;  // host-mapped: the kernels' failures (LowLatencyPeers::error)
  LowLatencyPeers peers_{};
  LowLatencyLayout layout_{};
  bool has_layout_ = false;
  uint64_t num_dispatches_ = 0;
  uint64_t num_combines_ = 0;
  std::shared_ptr<Allocator> allocator_;
  LowLatencyConfig config_;
  std::unique_ptr<LowLatencyRelay> relay_;  // hierarchical routing; null when flat
  // The combine grids when ranks share this GPU (shared_gpu_combine_grid; {0, 0}: the full grids).
  SharedGpuCombineGrid shared_gpu_;
  std::string pending_timeout_;  // LowLatencyConfig::raise_on_timeout: timeouts not raised yet
};

}  // namespace epx::cuda

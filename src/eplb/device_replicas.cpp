#include "epx/eplb/device_replicas.h"

#include <vector>

#include "core/check.h"
#include "eplb/replica_rule.h"
#ifdef EPX_WITH_CUDA
#include "eplb/cuda/device_replicas_kernels.h"
#endif

namespace epx::eplb {

std::shared_ptr<const DeviceReplicaTable> DeviceReplicaTable::upload(const ExpertLocation& location, Device device,
                                                                     Stream stream) {
  EPX_CHECK_ARG(device.is_cuda(), "device must be a CUDA device, got {}", to_string(device));
#ifdef EPX_WITH_CUDA
  const int L = location.num_layers(), E = location.num_logical(), P = location.num_physical();
  std::vector<int32_t> offsets(static_cast<size_t>(L) * (E + 1)), slots(static_cast<size_t>(L) * P);
  for (int l = 0; l < L; ++l) {
    int32_t* off = offsets.data() + static_cast<size_t>(l) * (E + 1);
    int32_t* out = slots.data() + static_cast<size_t>(l) * P;
    for (int e = 0; e < E; ++e) {
      const auto reps = location.replicas(l, e);
      off[e + 1] = off[e] + static_cast<int32_t>(reps.size());
      for (size_t i = 0; i < reps.size(); ++i) out[off[e] + i] = reps[i];
    }
  }
  auto table = std::make_shared<DeviceReplicaTable>();
  table->num_layers_ = L;
  table->num_logical_ = E;
  table->num_physical_ = P;
  table->num_gpus_ = location.num_gpus();
  table->offsets_ = Tensor::empty(DType::kInt32, {L, E + 1}, device, nullptr, stream);
  table->slots_ = Tensor::empty(DType::kInt32, {L, P}, device, nullptr, stream);
  cuda::copy_to_device(table->offsets_.data(), offsets.data(), offsets.size() * sizeof(int32_t), device.index, stream);
  cuda::copy_to_device(table->slots_.data(), slots.data(), slots.size() * sizeof(int32_t), device.index, stream);
  return table;
#else
  (void)location;
  (void)stream;
  epx::detail::raise(ErrorCode::kUnsupported, "DeviceReplicaTable::upload: this build of epx has no CUDA backend");
#endif
}

void choose_replicas(const DeviceReplicaTable& table, int layer, const TensorView& topk_logical,
                     const TensorView& topk_physical, int gpu, const ReplicaChoiceOptions& options, int64_t first_token,
                     Stream stream) {
  check_tensor(topk_logical, "topk_logical", {DType::kInt64, DType::kInt32}, {-1, -1});
  check_device(topk_logical, "topk_logical", table.device());
  EPX_CHECK_ARG(topk_logical.shape[1] >= 1, "topk_logical must have >= 1 column (num_topk), got {}",
                topk_logical.describe());
  check_tensor(topk_physical, "topk_physical", topk_logical.dtype, {topk_logical.shape[0], topk_logical.shape[1]});
  check_device(topk_physical, "topk_physical", table.device());
  EPX_CHECK_ARG(topk_logical.is_contiguous() && topk_physical.is_contiguous(),
                "topk_logical and topk_physical must be contiguous");
  EPX_CHECK_ARG(layer >= 0 && layer < table.num_layers(), "layer must be in [0, {}), got {}", table.num_layers(),
                layer);
  EPX_CHECK_ARG(gpu >= 0 && gpu < table.num_gpus(), "gpu must be in [0, {}), got {}", table.num_gpus(), gpu);
  EPX_CHECK_ARG(first_token >= 0, "first_token must be >= 0, got {}", first_token);
  EPX_CHECK_ARG(options.mode == ReplicaChoice::kStatic || options.mode == ReplicaChoice::kDynamic,
                "options.mode {} is not a ReplicaChoice", static_cast<int>(options.mode));
#ifdef EPX_WITH_CUDA
  cuda::ReplicaChoiceLaunch a{};
  a.offsets = table.offsets().data_as<const int32_t>() + static_cast<int64_t>(layer) * (table.num_logical() + 1);
  a.slots = table.slots().data_as<const int32_t>() + static_cast<int64_t>(layer) * table.num_physical();
  a.num_logical = table.num_logical();
  a.slots_per_gpu = table.num_physical() / table.num_gpus();
  a.gpu = gpu;
  a.layer_key = rule::layer_key(options.seed, layer);
  a.dynamic = options.mode == ReplicaChoice::kDynamic;
  a.rank_invariant = options.rank_invariant;
  a.first_token = first_token;
  a.num_topk = static_cast<int>(topk_logical.shape[1]);
  a.num_entries = topk_logical.numel();
  a.int64 = topk_logical.dtype == DType::kInt64;
  a.in = topk_logical.data;
  a.out = topk_physical.data;
  cuda::launch_choose_replicas(a, table.device().index, stream);
#else
  (void)options;
  (void)first_token;
  (void)stream;
  epx::detail::raise(ErrorCode::kUnsupported, "choose_replicas on a device: this build of epx has no CUDA backend");
#endif
}

}  // namespace epx::eplb

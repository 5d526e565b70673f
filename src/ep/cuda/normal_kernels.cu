// Normal-mode kernels, by stage: normal_layout.cu (layout, scan, strided scales), normal_notify.cu (epoch,
// notify), normal_ring.cu (SM rings: dispatch, combine), normal_copy.cu (copy-engine path); shared device
// helpers in normal_device.cuh. This file names the wait sites and loads every kernel. Protocol:
// docs/normal-kernels.md.
#include "ep/cuda/normal_device.cuh"

namespace epx::cuda {

const char* wait_site_name(int32_t site) {
  switch (site) {
    case kSiteNotify:
      return "notify (counts from the peer)";
    case kSiteDispatchSendDone:
      return "dispatch send (peer finishing its previous receive)";
    case kSiteDispatchSendHead:
      return "dispatch send (ring space at the peer)";
    case kSiteDispatchRecvTail:
      return "dispatch receive (rows from the peer)";
    case kSiteCombineSendDone:
      return "combine send (peer finishing its previous receive)";
    case kSiteCombineSendHead:
      return "combine send (ring space at the peer)";
    case kSiteCombineRecvTail:
      return "combine receive (rows from the peer)";
    case kSiteCopyDispatchReleased:
      return "dispatch copy (peer finishing its previous receive)";
    case kSiteCopyDispatchRows:
      return "dispatch receive (copy-engine rows from the peer)";
    case kSiteCopyCombineReleased:
      return "combine copy (peer finishing its previous receive)";
    case kSiteCopyCombineRows:
      return "combine receive (copy-engine rows from the peer)";
    case kSiteLowLatencyDispatchRecv:
      return "low-latency dispatch receive (counts from the peer)";
    case kSiteLowLatencyCombineRecv:
      return "low-latency combine receive (rows from the peer)";
    case kSiteCopyDispatchEarly:
      return "dispatch on SM rings (the peer's early copy landing)";
    case kSiteReceiveEnd:
      return "the end of a receive (rows it read may have been overwritten by the peer's copies)";
    default:
      return "unknown";
  }
}

cudaError_t preload_normal_kernels() {
  for (auto preload : {preload_layout_kernels, preload_notify_kernels, preload_ring_kernels, preload_copy_kernels}) {
    const cudaError_t err = preload();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace epx::cuda

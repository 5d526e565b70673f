// Programmatic dependent launch (PDL, sm_90 and later), the device side. A kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization (launch_kernel in core/cuda/cuda_util.h, `programmatic`) may be
// scheduled while the kernel before it on the stream is still running: once every block of that kernel has called
// griddepcontrol_launch_dependents or exited. It then runs up to its griddepcontrol_wait, which returns when that
// kernel has completed and its memory operations are performed and visible (the same guarantee as plain stream
// order). Launched without the attribute, or compiled for an older architecture, both calls do nothing, so a kernel
// reads the same either way. A captured graph keeps the relation as a programmatic edge.
//
// The kernel's contract: before griddepcontrol_wait, nothing that touches global memory an earlier kernel on the
// stream may have written or may still read (inputs, a control block, sequence numbers): only index math and
// shared-memory setup; every global write after it too.
//
// NOTE: inline, in an anonymous namespace, like the other headers of this directory.
#pragma once

namespace epx::cuda {
namespace {

// Waits until every prerequisite grid (the previous kernel on the stream, for a programmatic launch) has completed
// and its memory is visible to this grid. epx's kernels call it in every thread, first thing; the "memory" clobber
// keeps the compiler from moving loads or stores above it.
__device__ __forceinline__ void griddepcontrol_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next programmatic launch on the stream be scheduled once every block of this grid has called it or exited.
// PTX counts a block's first call (later ones do nothing), so the first thread to call it speaks for its block: epx's
// kernels call it at a point where no thread of the block has a wait left (after the barrier that ends the waits).
// Memory needs no care: the dependent still waits for this grid's completion in its griddepcontrol_wait. Residency
// does: a dependent's blocks hold SM slots (registers, shared memory) while they wait, so a block must not call it
// while it may still spin-wait for work of another grid that needs SM slots on this GPU to run (the NOTE at
// ll::dispatch, src/ep/cuda/low_latency_dispatch.cu).
__device__ __forceinline__ void griddepcontrol_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace
}  // namespace epx::cuda

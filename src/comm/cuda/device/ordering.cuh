// Memory-ordering primitives of every epx kernel (normal and low-latency paths), named by operation, order and
// scope. Signals cross GPUs over NVLink peer mappings (or stay on one GPU when ranks share it), so every signal is
// at system scope (.sys): a .gpu release would not order a store made through a peer mapping.
//
// The signal protocol, written once: writers store data with plain stores (to local or peer memory), the writing
// threads meet at a barrier (__syncthreads or named_barrier), then one thread publishes with st_release_sys; the
// reader polls with ld_acquire_sys (bounded_wait, device/wait.cuh), meets its block at a barrier, then reads the
// data, bypassing L1 where another GPU wrote it (__ldcg or volatile loads).
//
// NOTE: why st_release_sys is a bare st.release.sys (ptxas: MEMBAR.ALL.SYS, then STG.E.64.STRONG.SYS). A release
// orders every memory operation before it in program order, loads and stores, local and peer-mapped alike, before
// the store; the membar waits until the thread's earlier stores through NVLink are performed at system scope. It
// is cumulative: what other threads did before a barrier the releasing thread passed is in its past too, so one
// release per barrier suffices. The normal path used to issue fence.acq_rel.sys first: that adds the acquire half
// (an L1 invalidation, CCTL.IVALL) and a second MEMBAR.ALL.SYS, which no signal needs: every reader acquires on
// its own side. Where a thread publishes work that other blocks did before a relaxed atomic it read (the
// last-block finisher, device/grid.cuh), the acquire is an explicit fence_acq_rel_gpu after that atomic.
//
// NOTE: inline, in an anonymous namespace: each kernel file gets its own copy, so the kernels compile as they did
// with the helpers inside their own file (the same SASS).
#pragma once

#include <cstdint>

namespace epx::cuda {
namespace {

// Acquire at system scope: data that the writer stored before its release of *p is visible to this thread's later
// loads once this load returns the released value (or a later one).
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Release at system scope: every memory operation before it (this thread's, and, through a barrier it passed, its
// block's) is performed, peer-mapped stores included, before a reader can observe v. See the top of this file.
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Relaxed read past L1 (volatile): a word another block or GPU may change under a running kernel (the low-latency
// rank mask). Orders nothing else; the caller acquires separately where it then reads data.
__device__ __forceinline__ int32_t ld_volatile_global(const int32_t* p) {
  int32_t v;
  asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Acquire-release fence at GPU scope: the acquire half of a relaxed atomic read just before it (what the other
// blocks of this GPU fenced before their atomic is visible after it) and the release half of a store after it.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// Barrier of num_threads threads (a multiple of 32) on barrier id (1..15; 0 is __syncthreads): orders the
// group's memory operations before it before every member's operations after it (CTA scope), which a following
// st_release_sys extends to the system (cumulativity).
__device__ __forceinline__ void named_barrier(int id, int num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

// The one device clock of epx: %globaltimer, nanoseconds, the same on every SM (budgets and timestamps).
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace
}  // namespace epx::cuda

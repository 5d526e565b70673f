// The CUDA and NCCL WeightTransports' constructors, built only with the CUDA backend (src/eplb/cuda/transport.cpp,
// nccl_transport.cpp); the factories in cuda_transport.cpp check the arguments and call them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "epx/eplb/relocation.h"

namespace epx::eplb {

std::unique_ptr<WeightTransport> make_cuda_transport_impl(Group& group, size_t staging_bytes);
std::unique_ptr<WeightTransport> make_nccl_transport_impl(Group& group);
// choose_transport for a cuda group (collective when its ranks are processes).
TransportKind choose_cuda_transport(Group& group);

// What every rank sends every other in one exchange, agreed on by all ranks.
struct MessageTotals {
  int num_ranks = 0;
  std::vector<uint64_t> bytes{};  // [num_ranks * num_ranks]: bytes[a * num_ranks + b], what rank a sends rank b
  uint64_t sent(int from, int to) const { return bytes[static_cast<size_t>(from) * num_ranks + to]; }
};

// Collective over `group` (one all-gather): every rank's per-peer byte totals, message counts and a hash of each
// peer's sequence of message sizes (messages of 0 bytes left out: neither transport moves them), for its sends
// and its receives. Every rank checks the whole matrix, so a mismatch raises the same error on every rank and
// nobody is left waiting for data: Error(kInvalidArgument) for a peer outside [0, num_ranks), kInternal when
// what a sends b differs from what b receives from a (in total, in number, or message by message). `name` is
// the transport in messages ("cuda transport").
MessageTotals gather_message_totals(Group& group, std::span<const SendOp> sends, std::span<const RecvOp> recvs,
                                    const char* name);

// The local operations both device transports share. device_copy: bytes from src to dst on `stream`, then waits
// for it. device_allocate_temp: cudaMalloc on `device`, Error(kOutOfMemory) naming the transport (`name`) and the
// bytes when it fails.
void device_copy(int device, cudaStream_t stream, void* dst, const void* src, size_t bytes, const char* name);
void* device_allocate_temp(int device, size_t bytes, const char* name);

}  // namespace epx::eplb

// The host WeightTransport: ranks are threads sharing memory; a round is one HostGroup collective in which
// every rank publishes its send list and each receiver copies straight out of the sender's buffers.
#include <cstdlib>
#include <cstring>
#include <exception>

#include "core/check.h"
#include "epx/eplb/relocation.h"
#include "comm/host/host_group.h"

namespace epx::eplb {

namespace {

class HostTransport final : public WeightTransport {
 public:
  HostTransport(host::HostGroup& group, std::vector<bool> failed) : group_(group), failed_(std::move(failed)) {}

  int rank() const override { return group_.rank(); }
  int num_ranks() const override { return group_.num_ranks(); }

  void exchange(std::span<const SendOp> sends, std::span<const RecvOp> recvs) override {
    for (const SendOp& op : sends) {
      EPX_CHECK_ARG(op.peer >= 0 && op.peer < num_ranks(), "send peer must be in [0, {}), got {}", num_ranks(),
                    op.peer);
    }
    for (const RecvOp& op : recvs) {
      EPX_CHECK_ARG(op.peer >= 0 && op.peer < num_ranks(), "recv peer must be in [0, {}), got {}", num_ranks(),
                    op.peer);
    }
    const Published mine{sends.data(), sends.size()};
    const std::vector<bool>* skip = failed_.empty() ? nullptr : &failed_;
    const auto ptrs = group_.exchange(&mine, skip);
    // NOTE: peers read our send buffers until release() returns, so errors are raised after it.
    std::exception_ptr error;
    try {
      std::vector<size_t> cursor(num_ranks(), 0);  // next send of each peer to consider
      for (const RecvOp& op : recvs) {
        const auto* theirs = static_cast<const Published*>(ptrs[op.peer]);
        EPX_CHECK(ErrorCode::kPeerFailure, theirs != nullptr, "rank {} receives from rank {}, which is not live",
                  rank(), op.peer);
        size_t& c = cursor[op.peer];
        while (c < theirs->num_sends && theirs->sends[c].peer != rank()) ++c;
        EPX_CHECK(ErrorCode::kInternal, c < theirs->num_sends, "rank {} expects more messages from rank {}", rank(),
                  op.peer);
        const SendOp& match = theirs->sends[c++];
        EPX_CHECK(ErrorCode::kInternal, match.bytes == op.bytes,
                  "message size mismatch from rank {} to rank {}: sent {} bytes, receiving {}", op.peer, rank(),
                  match.bytes, op.bytes);
        if (op.bytes > 0) std::memcpy(op.data, match.data, op.bytes);
      }
    } catch (...) {
      error = std::current_exception();
    }
    group_.release(skip);
    if (error) std::rethrow_exception(error);
  }

  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
  }
  void* allocate_temp(size_t bytes) override {
    void* p = std::malloc(bytes);
    EPX_CHECK(ErrorCode::kOutOfMemory, p != nullptr, "host transport: cannot allocate {} temporary bytes", bytes);
    return p;
  }
  void free_temp(void* ptr) noexcept override { std::free(ptr); }

 private:
  struct Published {
    const SendOp* sends;
    size_t num_sends;
  };
  host::HostGroup& group_;
  std::vector<bool> failed_;
};

}  // namespace

std::unique_ptr<WeightTransport> make_host_transport(Group& group, std::vector<bool> failed_ranks) {
  auto* host_group = dynamic_cast<host::HostGroup*>(&group);
  EPX_CHECK_ARG(host_group != nullptr, "make_host_transport needs a host group, got a {} group",
                to_string(group.backend()));
  EPX_CHECK_ARG(failed_ranks.empty() || failed_ranks.size() == static_cast<size_t>(group.num_ranks()),
                "failed_ranks must be empty or have num_ranks = {} entries, got {}", group.num_ranks(),
                failed_ranks.size());
  return std::make_unique<HostTransport>(*host_group, std::move(failed_ranks));
}

}  // namespace epx::eplb

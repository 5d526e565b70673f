// The device replica choice's argument checks that need no GPU (the GPU test is tests/gpu/replica_choice_test.cpp).
#include <gtest/gtest.h>

#include "epx/eplb/device_replicas.h"
#include "epx/error.h"

namespace epx::eplb {
namespace {

TEST(DeviceReplicas, UploadNeedsACudaDevice) {
  const ExpertLocation loc = ExpertLocation::trivial(1, 4, 8, 2);
  try {
    DeviceReplicaTable::upload(loc, Device::cpu());
    ADD_FAILURE() << "expected kInvalidArgument";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("device must be a CUDA device"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace epx::eplb

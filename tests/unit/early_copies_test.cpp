// EarlyCopies::kAuto's guess of the peer's share (src/ep/early_copies.h).
#include "ep/early_copies.h"

#include <gtest/gtest.h>

namespace epx::ep {
namespace {

TEST(EarlyCopies, UniformPeerShare) {
  // DeepSeek-V3: top-8 of 256 misses the peer only when all 8 experts are among this rank's 128.
  double miss = 1.0;
  for (int i = 0; i < 8; ++i) miss *= (128.0 - i) / (256.0 - i);
  EXPECT_DOUBLE_EQ(uniform_peer_share(256, 8), 1.0 - miss);
  EXPECT_NEAR(uniform_peer_share(256, 8), 0.99651, 1e-5);
  EXPECT_DOUBLE_EQ(uniform_peer_share(8, 2), 1.0 - (4.0 * 3.0) / (8.0 * 7.0));
  EXPECT_DOUBLE_EQ(uniform_peer_share(2, 1), 0.5);
  EXPECT_DOUBLE_EQ(uniform_peer_share(4, 3), 1.0) << "more experts than this rank holds: every token reaches the peer";
  EXPECT_DOUBLE_EQ(uniform_peer_share(64, 0), 0.0) << "no experts chosen";
}

TEST(EarlyCopies, DenseFromTheUniformShareBeforeTheFirstDispatch) {
  EXPECT_TRUE(expect_dense_peer(256, 8, 0, 0));
  EXPECT_TRUE(expect_dense_peer(64, 8, 0, 0));
  EXPECT_FALSE(expect_dense_peer(8, 2, 0, 0));   // 0.79
  EXPECT_FALSE(expect_dense_peer(256, 1, 0, 0));  // 0.5
}

TEST(EarlyCopies, ThePreviousDispatchDecidesOnceThereWasOne) {
  EXPECT_TRUE(expect_dense_peer(8, 2, 4096, 3840)) << "exactly 15/16";
  EXPECT_FALSE(expect_dense_peer(256, 8, 4096, 3839));
  EXPECT_FALSE(expect_dense_peer(256, 8, 4096, 0)) << "skewed routing: the peer needed none";
  EXPECT_TRUE(expect_dense_peer(256, 1, 16, 16));
}

}  // namespace
}  // namespace epx::ep

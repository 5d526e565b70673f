// A CUDA build loads without NCCL, a driver or a GPU: NCCL is dlopen'ed on first use
// (src/comm/cuda/nccl_loader.h) and a CUDA call without a driver raises an Error that says so
// (src/core/cuda/cuda_util.h).
#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "epx/error.h"

#ifdef EPX_WITH_CUDA
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdlib>

#include "comm/cuda/nccl_loader.h"
#include "core/cuda/cuda_util.h"
#include "epx/cuda.h"

namespace epx {
namespace {

// Taken during static initialisation, after the dynamic linker loaded every NEEDED library and before any
// test could dlopen one.
const bool kNcclLoadedAtStart = dlopen("libnccl.so.2", RTLD_NOLOAD | RTLD_LAZY) != nullptr;
const bool kDriverLoadedAtStart = dlopen("libcuda.so.1", RTLD_NOLOAD | RTLD_LAZY) != nullptr;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(NcclLoader, NoNcclOrDriverAtLoadTime) {
  EXPECT_FALSE(kNcclLoadedAtStart) << "libnccl.so.2 is a load-time dependency of this binary";
  EXPECT_FALSE(kDriverLoadedAtStart) << "libcuda.so.1 is a load-time dependency of this binary";
}

TEST(NcclLoader, MissingLibraryNamesThePathAndTheReason) {
  const std::string path = "/nonexistent/libnccl.so.2";
  try {
    cuda::load_nccl(path);
    FAIL() << "loading " << path << " did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_TRUE(contains(e.what(), "'" + path + "'")) << e.what();
    EXPECT_TRUE(contains(e.what(), "No such file")) << e.what();  // dlerror()'s text
    EXPECT_TRUE(contains(e.what(), "EPX_NCCL_LIBRARY")) << e.what();
  }
}

TEST(NcclLoader, LibraryWithoutNcclNamesTheMissingFunction) {
  try {
    cuda::load_nccl("libc.so.6");
    FAIL() << "libc.so.6 was accepted as NCCL";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_TRUE(contains(e.what(), "'libc.so.6' has no ncclGetVersion")) << e.what();
  }
}

// The only test that touches the process-wide table: it must see the variable before the first load.
TEST(NcclLoader, EnvironmentVariableChoosesTheLibraryAndFailureIsSticky) {
  const std::string path = "/nonexistent/from-env/libnccl.so.2";
  ASSERT_EQ(setenv("EPX_NCCL_LIBRARY", path.c_str(), 1), 0);
  EXPECT_EQ(cuda::nccl_library_name(), path);
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      cuda::nccl();
      FAIL() << "nccl() loaded " << path;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
      EXPECT_TRUE(contains(e.what(), path)) << e.what();
    }
  }
  unsetenv("EPX_NCCL_LIBRARY");
  EXPECT_EQ(cuda::nccl_library_name(), "libnccl.so.2");
}

TEST(NcclLoader, ResolvesEveryFunctionOfTheRealLibrary) {
  cuda::NcclApi api;
  try {
    api = cuda::load_nccl("libnccl.so.2");
  } catch (const Error& e) {
    GTEST_SKIP() << "no loadable libnccl.so.2 here: " << e.what();
  }
  EXPECT_GE(api.version, NCCL_VERSION_CODE);
  EXPECT_TRUE(contains(api.path, "libnccl")) << api.path;
  const void* fns[] = {reinterpret_cast<void*>(api.GetVersion),   reinterpret_cast<void*>(api.GetErrorString),
                       reinterpret_cast<void*>(api.GetUniqueId),  reinterpret_cast<void*>(api.CommInitRankConfig),
                       reinterpret_cast<void*>(api.CommAbort),    reinterpret_cast<void*>(api.CommGetAsyncError),
                       reinterpret_cast<void*>(api.CommUserRank), reinterpret_cast<void*>(api.CommCount),
                       reinterpret_cast<void*>(api.CommCuDevice), reinterpret_cast<void*>(api.AllGather),
                       reinterpret_cast<void*>(api.AllReduce),    reinterpret_cast<void*>(api.Reduce),
                       reinterpret_cast<void*>(api.GroupStart),   reinterpret_cast<void*>(api.GroupEnd),
                       reinterpret_cast<void*>(api.Send),         reinterpret_cast<void*>(api.Recv),
                       reinterpret_cast<void*>(api.CommSplit),    reinterpret_cast<void*>(api.CommFinalize),
                       reinterpret_cast<void*>(api.CommDestroy)};
  for (const void* fn : fns) EXPECT_NE(fn, nullptr);
  // Optional in the table, present from 2.28.7: what rebuilds an owned communicator after a failure (owned_comm.h).
  if (api.version >= 22807) {
    EXPECT_NE(api.CommRevoke, nullptr);
  }
  EXPECT_STRNE(api.GetErrorString(ncclInvalidArgument), "");
}

TEST(CudaErrors, MissingDriverIsNamed) {
  try {
    cuda::check_cuda(cudaErrorInsufficientDriver, "cudaMalloc");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_TRUE(contains(e.what(), "cudaMalloc failed: no CUDA driver (libcuda.so.1) found")) << e.what();
  }
  try {
    cuda::check_cuda(cudaErrorNoDevice, "cudaSetDevice");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_TRUE(contains(e.what(), "no CUDA GPU is visible")) << e.what();
  }
  try {
    cuda::check_cuda(cudaErrorMemoryAllocation, "cudaMalloc");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
  }
}

// On a machine without a driver or GPU (CI), the first CUDA call of the public API says what is missing.
TEST(CudaErrors, CreateGroupsWithoutGpuSaysWhatIsMissing) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  cudaGetLastError();
  if (err == cudaSuccess) GTEST_SKIP() << count << " GPUs visible";
  try {
    create_cuda_groups({0});
    FAIL() << "create_cuda_groups succeeded without a GPU";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
    EXPECT_TRUE(contains(e.what(), cuda::cuda_error_text(err))) << e.what();
  }
}

// CudaGroupOptions::gpus_per_node is checked before any CUDA call, with HostGroupOptions' wording.
TEST(CudaGroupTopology, BadGpusPerNodeIsNamed) {
  for (const auto& [gpus_per_node, message] :
       {std::pair<int, std::string>{2, "gpus_per_node = 2 must divide num_ranks = 3"},
        {4, "gpus_per_node must be in [0, num_ranks = 3]"},
        {-1, "gpus_per_node must be in [0, num_ranks = 3]"}}) {
    CudaGroupOptions options;
    options.gpus_per_node = gpus_per_node;
    try {
      create_cuda_groups({0, 0, 0}, options);
      FAIL() << "gpus_per_node = " << gpus_per_node << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_TRUE(contains(e.what(), message)) << e.what();
    }
  }
}

}  // namespace
}  // namespace epx

#else

TEST(NcclLoader, HostOnlyBuild) { GTEST_SKIP() << "built without the CUDA backend"; }

#endif

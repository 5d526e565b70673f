# Finds NCCL: the CUDA toolkit's copy, or pip's nvidia-nccl package, or EPX_NCCL_ROOT / NCCL_ROOT.
# Defines two INTERFACE targets: epx_nccl_headers (nccl.h only: the epx library loads libnccl.so.2 on first
# use, src/comm/cuda/nccl_loader.h) and epx_nccl (headers + the library, for executables that call NCCL
# themselves). The library found here is only linked by those executables.
set(_epx_nccl_hints ${EPX_NCCL_ROOT} $ENV{EPX_NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_ROOT})
execute_process(COMMAND python3 -c "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))"
  OUTPUT_VARIABLE _epx_pip_nccl OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(_epx_pip_nccl)
  list(APPEND _epx_nccl_hints ${_epx_pip_nccl})
endif()
find_path(EPX_NCCL_INCLUDE_DIR nccl.h HINTS ${_epx_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
find_library(EPX_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_epx_nccl_hints} ${CUDAToolkit_LIBRARY_DIR}
  PATH_SUFFIXES lib lib64)
if(NOT EPX_NCCL_INCLUDE_DIR OR NOT EPX_NCCL_LIBRARY)
  set(_epx_nccl_msg "NCCL not found: install it with the CUDA toolkit or `pip install nvidia-nccl-cu13`, or set EPX_NCCL_ROOT")
  if(EPX_CUDA STREQUAL "ON")
    message(FATAL_ERROR "${_epx_nccl_msg}")
  endif()
  message(WARNING "${_epx_nccl_msg}; building without the CUDA backend")
  set(EPX_HAVE_CUDA OFF)
  return()
endif()
message(STATUS "epx: NCCL ${EPX_NCCL_LIBRARY} (headers ${EPX_NCCL_INCLUDE_DIR})")
add_library(epx_nccl_headers INTERFACE)
target_include_directories(epx_nccl_headers INTERFACE ${EPX_NCCL_INCLUDE_DIR})
add_library(epx_nccl INTERFACE)
target_link_libraries(epx_nccl INTERFACE epx_nccl_headers ${EPX_NCCL_LIBRARY})

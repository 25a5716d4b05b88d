# Every dependency is found with find_package. scripts/install_deps.sh installs them from
# Debian packages; on the GPU machine (no Faiss, no compiled Boost.ProgramOptions) pass
# -DKVS_DEPS_PREFIX=<folder made by scripts/stage_gpu_deps.sh> to use staged static copies.

if(KVS_DEPS_PREFIX)
  # Staged Boost.ProgramOptions headers must win over the system's (other Boost version).
  list(PREPEND CMAKE_PREFIX_PATH ${KVS_DEPS_PREFIX})
  include_directories(BEFORE SYSTEM ${KVS_DEPS_PREFIX}/include)
endif()

find_package(CUDAToolkit REQUIRED)
find_package(HDF5 REQUIRED COMPONENTS C)
find_package(Eigen3 3.3 REQUIRED NO_MODULE)
find_package(Threads REQUIRED)
find_package(ZLIB REQUIRED)  # gzip'd corpus text; HDF5's deflate uses it too

# OpenMP before Faiss: Faiss's exported target links OpenMP::OpenMP_CXX.
find_package(OpenMP REQUIRED COMPONENTS CXX)
# OpenBLAS, so that Faiss and libtorch never fall back to the reference BLAS.
set(BLA_VENDOR OpenBLAS)
find_package(BLAS REQUIRED)
find_package(LAPACK REQUIRED)

if(KVS_DEPS_PREFIX AND EXISTS ${KVS_DEPS_PREFIX}/lib/libboost_program_options.a)
  # The GPU machine has Boost headers but no compiled library: use the staged static one.
  add_library(Boost::program_options STATIC IMPORTED)
  set_target_properties(Boost::program_options PROPERTIES
    IMPORTED_LOCATION ${KVS_DEPS_PREFIX}/lib/libboost_program_options.a
    INTERFACE_INCLUDE_DIRECTORIES ${KVS_DEPS_PREFIX}/include)
else()
  find_package(Boost 1.71 REQUIRED COMPONENTS program_options)
endif()

if(KVS_WITH_FAISS)
  if(KVS_DEPS_PREFIX AND EXISTS ${KVS_DEPS_PREFIX}/lib/libfaiss.a)
    add_library(faiss STATIC IMPORTED)
    set_target_properties(faiss PROPERTIES
      IMPORTED_LOCATION ${KVS_DEPS_PREFIX}/lib/libfaiss.a
      INTERFACE_INCLUDE_DIRECTORIES ${KVS_DEPS_PREFIX}/include
      INTERFACE_LINK_LIBRARIES "OpenMP::OpenMP_CXX;${BLAS_LIBRARIES};${LAPACK_LIBRARIES}")
  else()
    find_package(faiss REQUIRED)
  endif()
endif()

if(KVS_WITH_TORCH)
  # Torch's own config looks for CUDA with the legacy FindCUDA variables; it finds the
  # toolkit through CUDAToolkit_ROOT on the GPU machine and is CPU-only on Debian.
  find_package(Torch REQUIRED)
  message(STATUS "kvsparse: libtorch ${Torch_VERSION} from ${Torch_DIR}")
endif()

if(KVS_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()

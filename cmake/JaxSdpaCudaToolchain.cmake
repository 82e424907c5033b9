# What the CUDA backend builds with: nvcc, the cuDNN headers and library, the cudnn-frontend
# headers and nvrtc.h, from PyPI wheels in the Python environment or from a CUDA toolkit.
# Included by cuda/CMakeLists.txt; enables the CUDA language when a compiler is found.
#
# nvcc, in this order:
#   1. CMAKE_CUDA_COMPILER or CUDACXX when given;
#   2. with JAX_SDPA_CUDA_MAJOR=13 (what `-Cjax_sdpa.cuda=13` sets): PyPI's nvidia-cuda-nvcc
#      (site-packages/nvidia/cu13/bin/nvcc, with nvidia-cuda-crt, -cccl, -runtime, nvidia-nvvm);
#   3. /usr/local/cuda-<JAX_SDPA_CUDA_MAJOR>.*, nvcc on PATH, CUDA_PATH / CUDA_HOME,
#      /usr/local/cuda;
#   4. PyPI's nvidia-cuda-nvcc when no toolkit was found.
# PyPI has no CUDA 12 compiler (nvidia-cuda-nvcc-cu12 holds ptxas and libnvvm only), so a
# CUDA 12 build takes a CUDA 12 toolkit's nvcc (3., or CUDACXX) and the rest from wheels.
#
# Sets JAX_SDPA_CUDA_SKIP_REASON and JAX_SDPA_CUDA_SKIP_FIX when something is missing, else
# JAX_SDPA_CUDNN_INCLUDE_DIR, JAX_SDPA_CUDNN_LIBRARY, JAX_SDPA_CUDNN_FRONTEND_INCLUDE_DIR,
# JAX_SDPA_CUDA_EXTRA_INCLUDE_DIRS, JAX_SDPA_CUDA_TOOLCHAIN_SOURCES (to compile into the
# module), JAX_SDPA_CUDNN_RPATH; records versions in the build info.

set(JAX_SDPA_CUDA_MAJOR "" CACHE STRING
    "CUDA major version to build the CUDA backend for (13 or 12); empty: the nvcc found")
set(CUDNN_INCLUDE_DIR "" CACHE PATH "cuDNN headers (default: the nvidia-cudnn wheel's)")
set(CUDNN_LIBRARY "" CACHE FILEPATH "libcudnn.so.9 (default: the nvidia-cudnn wheel's)")
set(CUDNN_FRONTEND_INCLUDE_DIR "" CACHE PATH
    "cudnn-frontend headers (default: the nvidia-cudnn-frontend wheel's)")

set(JAX_SDPA_CUDA_SKIP_REASON "")
set(JAX_SDPA_CUDA_SKIP_FIX "")
if(JAX_SDPA_CUDA_MAJOR STREQUAL "12")
  set(_jax_sdpa_cuda_fix
      "CUDACXX=<a CUDA 12 toolkit>/bin/nvcc pip install '.[cuda12]' -Cjax_sdpa.cuda=12")
  set(_jax_sdpa_cudnn_wheel nvidia-cudnn-cu12)
  set(_jax_sdpa_nvrtc_wheel nvidia-cuda-nvrtc-cu12)
else()
  set(_jax_sdpa_cuda_fix "pip install '.[cuda13]' -Cjax_sdpa.cuda=13")
  set(_jax_sdpa_cudnn_wheel nvidia-cudnn-cu13)
  set(_jax_sdpa_nvrtc_wheel nvidia-cuda-nvrtc)
endif()

# Records why the backend can't be built and leaves this file (return() from an included
# file goes back to the includer, which then skips the backend).
macro(_jax_sdpa_cuda_missing why fix)
  set(JAX_SDPA_CUDA_SKIP_REASON "${why}")
  set(JAX_SDPA_CUDA_SKIP_FIX "${fix}")
  return()
endmacro()

function(_jax_sdpa_json_get out json)
  string(JSON _v ERROR_VARIABLE _err GET "${json}" ${ARGN})
  if(_err OR _v STREQUAL "null")
    set(_v "")
  endif()
  set(${out} "${_v}" PARENT_SCOPE)
endfunction()

# ---- the wheels in the Python environment ------------------------------------------
execute_process(
  COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_LIST_DIR}/find_cuda_wheels.py"
  OUTPUT_VARIABLE _jax_sdpa_wheels OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _jax_sdpa_rc)
if(NOT _jax_sdpa_rc EQUAL 0 OR NOT _jax_sdpa_wheels MATCHES "^{")
  set(_jax_sdpa_wheels "{}")
endif()

# ---- nvcc ----------------------------------------------------------------------------
# nvcc's host compiler must be the C++ compiler we build with: the GPU machine's default g++
# on PATH has C++ headers that don't match the system libstdc++.
if(NOT DEFINED CMAKE_CUDA_HOST_COMPILER AND NOT DEFINED ENV{CUDAHOSTCXX})
  set(CMAKE_CUDA_HOST_COMPILER "${CMAKE_CXX_COMPILER}" CACHE FILEPATH "nvcc host compiler")
endif()

_jax_sdpa_json_get(_pip_nvcc "${_jax_sdpa_wheels}" nvcc13 path)
_jax_sdpa_json_get(_pip_nvcc_wheel "${_jax_sdpa_wheels}" nvcc13 wheel)
_jax_sdpa_json_get(_pip_nvvm_wheel "${_jax_sdpa_wheels}" nvcc13 nvvm)
if(JAX_SDPA_CUDA_MAJOR STREQUAL "12")
  _jax_sdpa_json_get(_pip_nvcc "${_jax_sdpa_wheels}" nvcc12 path)
  _jax_sdpa_json_get(_pip_nvcc_wheel "${_jax_sdpa_wheels}" nvcc12 wheel)
  set(_pip_nvvm_wheel "")
endif()

set(_nvcc_source "")
if(DEFINED CMAKE_CUDA_COMPILER OR DEFINED ENV{CUDACXX})
  set(_nvcc_source "given (CMAKE_CUDA_COMPILER / CUDACXX)")
else()
  # a toolkit of the requested major version first (/usr/local/cuda-12.9 before a PATH nvcc 13)
  set(_versioned_toolkits "")
  if(JAX_SDPA_CUDA_MAJOR)
    file(GLOB _versioned_toolkits "/usr/local/cuda-${JAX_SDPA_CUDA_MAJOR}.*")
    list(SORT _versioned_toolkits COMPARE NATURAL ORDER DESCENDING)
  endif()
  find_program(JAX_SDPA_TOOLKIT_NVCC nvcc
               HINTS ${_versioned_toolkits} ENV CUDA_PATH ENV CUDA_HOME PATHS /usr/local/cuda
               PATH_SUFFIXES bin DOC "a CUDA toolkit's nvcc")
  # a toolkit nvcc that runs, of the requested major version
  set(_toolkit_nvcc "")
  set(_toolkit_other "")
  if(JAX_SDPA_TOOLKIT_NVCC)
    execute_process(COMMAND "${JAX_SDPA_TOOLKIT_NVCC}" --version OUTPUT_VARIABLE _out
                    RESULT_VARIABLE _rc ERROR_QUIET)
    if(_rc EQUAL 0 AND _out MATCHES "release ([0-9]+)\\.([0-9]+)")
      if(NOT JAX_SDPA_CUDA_MAJOR OR CMAKE_MATCH_1 STREQUAL JAX_SDPA_CUDA_MAJOR)
        set(_toolkit_nvcc "${JAX_SDPA_TOOLKIT_NVCC}")
      else()
        set(_toolkit_other
            " (${JAX_SDPA_TOOLKIT_NVCC} is CUDA ${CMAKE_MATCH_1}.${CMAKE_MATCH_2})")
      endif()
    endif()
  endif()
  set(_use_pip OFF)
  if(_pip_nvcc AND (JAX_SDPA_CUDA_MAJOR STREQUAL "13" OR NOT _toolkit_nvcc))
    set(_use_pip ON)
  endif()
  if(_use_pip)
    # cicc (nvidia-nvvm) newer than ptxas (nvidia-cuda-nvcc) writes PTX ptxas refuses.
    if(_pip_nvvm_wheel MATCHES " ([0-9]+\\.[0-9]+)" )
      set(_nvvm_mm "${CMAKE_MATCH_1}")
      if(_pip_nvcc_wheel MATCHES " ([0-9]+\\.[0-9]+)" AND _nvvm_mm VERSION_GREATER CMAKE_MATCH_1)
        _jax_sdpa_cuda_missing(
          "the Python environment's ${_pip_nvvm_wheel} is newer than its ${_pip_nvcc_wheel} (its cicc writes PTX that this ptxas refuses)"
          "pip install -U nvidia-cuda-nvcc nvidia-cuda-crt nvidia-nvvm")
      endif()
    endif()
    get_filename_component(_pip_cuda_root "${_pip_nvcc}" DIRECTORY)
    get_filename_component(_pip_cuda_root "${_pip_cuda_root}" DIRECTORY)
    if(NOT EXISTS "${_pip_cuda_root}/include/crt/host_config.h")
      _jax_sdpa_cuda_missing("${_pip_nvcc_wheel} is installed without nvidia-cuda-crt"
                             "${_jax_sdpa_cuda_fix}")
    endif()
    if(NOT EXISTS "${_pip_cuda_root}/include/cccl/nv/target")
      _jax_sdpa_cuda_missing("${_pip_nvcc_wheel} is installed without nvidia-cuda-cccl (nv/target)"
                             "${_jax_sdpa_cuda_fix}")
    endif()
    set(CMAKE_CUDA_COMPILER "${_pip_nvcc}" CACHE FILEPATH "CUDA compiler" FORCE)
    set(CUDAToolkit_ROOT "${_pip_cuda_root}")
    # The wheels put the libraries in lib/, where nvcc.profile (lib64/) does not look; the
    # compiler checks link with nvcc.
    set(CMAKE_CUDA_FLAGS_INIT "-L${_pip_cuda_root}/lib")
    # ... and ship libcudart.so.13 without the libcudart.so link FindCUDAToolkit looks for
    # (we link cudart_static; this only satisfies the find).
    file(GLOB _pip_cudart "${_pip_cuda_root}/lib/libcudart.so.*")
    if(_pip_cudart)
      list(GET _pip_cudart 0 _pip_cudart)
      set(CUDA_CUDART "${_pip_cudart}" CACHE FILEPATH "libcudart (pip wheel)" FORCE)
    endif()
    set(_nvcc_source "pip wheel ${_pip_nvcc_wheel}")
  elseif(_toolkit_nvcc)
    set(CMAKE_CUDA_COMPILER "${_toolkit_nvcc}" CACHE FILEPATH "CUDA compiler")
    set(_nvcc_source "CUDA toolkit")
  elseif(JAX_SDPA_CUDA_MAJOR STREQUAL "12")
    _jax_sdpa_cuda_missing(
      "no CUDA 12 nvcc: PyPI has none (nvidia-cuda-nvcc-cu12 holds only ptxas), and no CUDA 12 toolkit was found${_toolkit_other}"
      "${_jax_sdpa_cuda_fix}")
  else()
    _jax_sdpa_cuda_missing(
      "no CUDA compiler: no working nvcc on PATH and no nvidia-cuda-nvcc wheel in the Python environment${_toolkit_other}"
      "${_jax_sdpa_cuda_fix}")
  endif()
endif()

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  _jax_sdpa_cuda_missing("no working CUDA compiler (nvcc) was found" "${_jax_sdpa_cuda_fix}")
endif()
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 80 90)
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
string(REGEX MATCH "^[0-9]+" _nvcc_major "${CMAKE_CUDA_COMPILER_VERSION}")
if(JAX_SDPA_CUDA_MAJOR AND NOT _nvcc_major STREQUAL JAX_SDPA_CUDA_MAJOR)
  _jax_sdpa_cuda_missing(
    "JAX_SDPA_CUDA_MAJOR=${JAX_SDPA_CUDA_MAJOR} but the CUDA compiler ${CMAKE_CUDA_COMPILER} is ${CMAKE_CUDA_COMPILER_VERSION}"
    "${_jax_sdpa_cuda_fix}")
endif()
jax_sdpa_build_fact(cuda nvcc "${CMAKE_CUDA_COMPILER}")
jax_sdpa_build_fact(cuda nvcc_version "${CMAKE_CUDA_COMPILER_VERSION}")
jax_sdpa_build_fact(cuda nvcc_source "${_nvcc_source}")
jax_sdpa_build_fact(cuda cuda_major "${_nvcc_major}")
message(STATUS "jax_sdpa: CUDA compiler ${CMAKE_CUDA_COMPILER} ${CMAKE_CUDA_COMPILER_VERSION} (${_nvcc_source})")

# ---- cuDNN and cudnn-frontend ------------------------------------------------------------
_jax_sdpa_json_get(_cudnn_h "${_jax_sdpa_wheels}" cudnn path)
_jax_sdpa_json_get(_cudnn_wheel "${_jax_sdpa_wheels}" cudnn wheel)
_jax_sdpa_json_get(_cudnn_temporary "${_jax_sdpa_wheels}" cudnn temporary)
_jax_sdpa_json_get(_fe_h "${_jax_sdpa_wheels}" cudnn_frontend path)
_jax_sdpa_json_get(_fe_wheel "${_jax_sdpa_wheels}" cudnn_frontend wheel)

set(JAX_SDPA_CUDNN_INCLUDE_DIR "${CUDNN_INCLUDE_DIR}")
set(JAX_SDPA_CUDNN_LIBRARY "${CUDNN_LIBRARY}")
set(JAX_SDPA_CUDNN_FRONTEND_INCLUDE_DIR "${CUDNN_FRONTEND_INCLUDE_DIR}")
if(_cudnn_h)
  get_filename_component(_cudnn_wheel_include "${_cudnn_h}" DIRECTORY)
  get_filename_component(_cudnn_wheel_root "${_cudnn_wheel_include}" DIRECTORY)
  if(NOT JAX_SDPA_CUDNN_INCLUDE_DIR)
    set(JAX_SDPA_CUDNN_INCLUDE_DIR "${_cudnn_wheel_include}")
  endif()
  if(NOT JAX_SDPA_CUDNN_LIBRARY)
    set(JAX_SDPA_CUDNN_LIBRARY "${_cudnn_wheel_root}/lib/libcudnn.so.9")
  endif()
endif()
if(NOT JAX_SDPA_CUDNN_FRONTEND_INCLUDE_DIR AND _fe_h)
  get_filename_component(JAX_SDPA_CUDNN_FRONTEND_INCLUDE_DIR "${_fe_h}" DIRECTORY)
endif()
if(NOT JAX_SDPA_CUDNN_INCLUDE_DIR OR NOT EXISTS "${JAX_SDPA_CUDNN_INCLUDE_DIR}/cudnn.h")
  _jax_sdpa_cuda_missing("cuDNN headers not found (PyPI ${_jax_sdpa_cudnn_wheel}, or set CUDNN_INCLUDE_DIR)"
                         "${_jax_sdpa_cuda_fix}")
endif()
if(NOT JAX_SDPA_CUDNN_LIBRARY OR NOT EXISTS "${JAX_SDPA_CUDNN_LIBRARY}")
  _jax_sdpa_cuda_missing("libcudnn.so.9 not found (PyPI ${_jax_sdpa_cudnn_wheel}, or set CUDNN_LIBRARY)"
                         "${_jax_sdpa_cuda_fix}")
endif()
if(NOT JAX_SDPA_CUDNN_FRONTEND_INCLUDE_DIR OR
   NOT EXISTS "${JAX_SDPA_CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend.h")
  _jax_sdpa_cuda_missing(
    "cudnn-frontend headers not found (PyPI nvidia-cudnn-frontend, or set CUDNN_FRONTEND_INCLUDE_DIR)"
    "${_jax_sdpa_cuda_fix}")
endif()

function(_jax_sdpa_header_version out file)
  set(_parts "")
  foreach(_macro IN LISTS ARGN)
    file(STRINGS "${file}" _line REGEX "^#define ${_macro} +[0-9]+")
    string(REGEX REPLACE "^#define ${_macro} +([0-9]+).*" "\\1" _n "${_line}")
    list(APPEND _parts "${_n}")
  endforeach()
  list(JOIN _parts "." _v)
  set(${out} "${_v}" PARENT_SCOPE)
endfunction()
_jax_sdpa_header_version(_cudnn_version "${JAX_SDPA_CUDNN_INCLUDE_DIR}/cudnn_version.h"
                         CUDNN_MAJOR CUDNN_MINOR CUDNN_PATCHLEVEL)
_jax_sdpa_header_version(_fe_version
                         "${JAX_SDPA_CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend_version.h"
                         CUDNN_FRONTEND_MAJOR_VERSION CUDNN_FRONTEND_MINOR_VERSION
                         CUDNN_FRONTEND_PATCH_VERSION)
jax_sdpa_build_fact(cuda cudnn_headers "${_cudnn_version}")
jax_sdpa_build_fact(cuda cudnn_headers_from "${JAX_SDPA_CUDNN_INCLUDE_DIR} ${_cudnn_wheel}")
jax_sdpa_build_fact(cuda cudnn_frontend "${_fe_version}")
jax_sdpa_build_fact(cuda cudnn_frontend_from "${JAX_SDPA_CUDNN_FRONTEND_INCLUDE_DIR} ${_fe_wheel}")
message(STATUS "jax_sdpa: cuDNN ${_cudnn_version} headers ${JAX_SDPA_CUDNN_INCLUDE_DIR}, library ${JAX_SDPA_CUDNN_LIBRARY}")
message(STATUS "jax_sdpa: cudnn-frontend ${_fe_version} headers ${JAX_SDPA_CUDNN_FRONTEND_INCLUDE_DIR}")

# ---- nvrtc.h -----------------------------------------------------------------------------
# cudnn-frontend >= 1.2x includes nvrtc.h (experimental/nvrtc_shim.h; it loads libnvrtc at
# run time, only the declarations are needed). A toolkit has it; pip's nvcc does not, the
# nvrtc wheel does. Only that one header is put on the include path, never the wheel's
# whole include folder, whose CUDA headers may be another version than nvcc's.
set(JAX_SDPA_CUDA_EXTRA_INCLUDE_DIRS "")
set(JAX_SDPA_CUDA_TOOLCHAIN_SOURCES "")
set(_nvrtc_h "")
foreach(_dir IN LISTS CUDAToolkit_INCLUDE_DIRS)
  if(EXISTS "${_dir}/nvrtc.h")
    set(_nvrtc_h "${_dir}/nvrtc.h")
    break()
  endif()
endforeach()
if(NOT _nvrtc_h)
  _jax_sdpa_json_get(_wheel_nvrtc "${_jax_sdpa_wheels}" nvrtc${_nvcc_major} path)
  if(_wheel_nvrtc)
    set(_shim "${CMAKE_CURRENT_BINARY_DIR}/jax_sdpa_nvrtc_include")
    file(COPY "${_wheel_nvrtc}" DESTINATION "${_shim}")
    set(JAX_SDPA_CUDA_EXTRA_INCLUDE_DIRS "${_shim}")
    set(_nvrtc_h "${_wheel_nvrtc}")
  elseif(EXISTS "${JAX_SDPA_CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend/experimental/nvrtc_shim.h")
    _jax_sdpa_cuda_missing(
      "cudnn-frontend ${_fe_version} includes nvrtc.h, found neither in the CUDA toolkit nor in the Python environment (PyPI ${_jax_sdpa_nvrtc_wheel})"
      "${_jax_sdpa_cuda_fix}")
  endif()
endif()
if(_nvrtc_h)
  message(STATUS "jax_sdpa: nvrtc.h from ${_nvrtc_h}")
endif()
# ... and calls nvrtc functions, which would make libnvrtc a load-time dependency.
if(EXISTS "${JAX_SDPA_CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend/experimental/nvrtc_shim.h")
  set(JAX_SDPA_CUDA_TOOLCHAIN_SOURCES "${PROJECT_SOURCE_DIR}/cuda/cudnn/nvrtc_on_first_use.cc")
endif()

# ---- where libcudnn is found at run time -------------------------------------------------
# One libcudnn in the process: the wheel's, the file JAX's CUDA plugin loads;
# $ORIGIN/../nvidia/cudnn/lib is its folder once jax_sdpa is installed in site-packages. The
# configure-time folder is a fallback (a venv over the system's site-packages), unless it is an
# isolated build environment, which is deleted after the build.
get_filename_component(_cudnn_libdir "${JAX_SDPA_CUDNN_LIBRARY}" DIRECTORY)
set(JAX_SDPA_CUDNN_RPATH "$ORIGIN/../nvidia/cudnn/lib")
if(NOT _cudnn_h OR NOT JAX_SDPA_CUDNN_LIBRARY STREQUAL "${_cudnn_wheel_root}/lib/libcudnn.so.9"
   OR NOT _cudnn_temporary)
  list(APPEND JAX_SDPA_CUDNN_RPATH "${_cudnn_libdir}")
endif()

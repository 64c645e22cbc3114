// Shared device helpers for the depthwise kernels: vector access, compile-time
// dispatch on dtype / kernel size / stride, and launch bookkeeping.
#pragma once

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/types.h>

#include <type_traits>

namespace lumenbridge {
namespace cuda {

constexpr int kThreads = 256;
constexpr int kVectorBytes = 16;

// VEC elements moved as one 16-, 8-, 4- or 2-byte access.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load_vec(const T* ptr) {
  return *reinterpret_cast<const Vec<T, VEC>*>(ptr);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* ptr, const Vec<T, VEC>& value) {
  *reinterpret_cast<Vec<T, VEC>*>(ptr) = value;
}

template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> zero_vec() {
  Vec<T, VEC> r;
#pragma unroll
  for (int i = 0; i < VEC; ++i) r.v[i] = T(0.0f);
  return r;
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
inline int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The widest access, up to MAX_VEC elements, that evenly divides `extent`
// elements and keeps every pointer aligned. 1 means scalar.
template <typename T>
int vector_width(int max_vec, int64_t extent, std::initializer_list<const void*> pointers) {
  int vec = max_vec;
  for (; vec > 1; vec /= 2) {
    bool aligned = extent % vec == 0;
    for (const void* p : pointers) {
      aligned = aligned && (p == nullptr || reinterpret_cast<uintptr_t>(p) % (vec * sizeof(T)) == 0);
    }
    if (aligned) break;
  }
  return vec;
}

// Runs `body` with std::integral_constant<int, K> for K in {3, 5, 7}, and
// likewise for the stride, so kernels see both as compile-time constants.
template <typename Body>
void dispatch_kernel_size(int64_t k, Body&& body) {
  switch (k) {
    case 3: body(std::integral_constant<int, 3>{}); break;
    case 5: body(std::integral_constant<int, 5>{}); break;
    case 7: body(std::integral_constant<int, 7>{}); break;
    default: TORCH_CHECK(false, "LumenBridge: internal error: unsupported kernel size ", k);
  }
}

template <typename Body>
void dispatch_stride(int64_t s, Body&& body) {
  switch (s) {
    case 1: body(std::integral_constant<int, 1>{}); break;
    case 2: body(std::integral_constant<int, 2>{}); break;
    default: TORCH_CHECK(false, "LumenBridge: internal error: unsupported stride ", s);
  }
}

// Runs `body` with std::integral_constant<int, VEC> for the two widths each
// kernel instantiates: MAX_VEC (when vector_width allows it) or scalar.
template <int MAX_VEC, typename Body>
void dispatch_vector_width(int vec, Body&& body) {
  if (vec == MAX_VEC) {
    body(std::integral_constant<int, MAX_VEC>{});
  } else {
    body(std::integral_constant<int, 1>{});
  }
}

#define LUMENBRIDGE_DISPATCH_CUDA_TYPES(TYPE, NAME, ...)                      \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__))

// Dynamic shared memory past 48 KB must be opted into per kernel.
template <typename Kernel>
void allow_shared_bytes(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
  }
}

// Grids are one-dimensional over blocks; refuse sizes past the hardware limit
// with a message rather than a launch failure.
inline unsigned grid_size(int64_t blocks) {
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(),
              "LumenBridge: problem too large for one launch (", blocks, " blocks)");
  return static_cast<unsigned>(blocks);
}

}  // namespace cuda
}  // namespace lumenbridge

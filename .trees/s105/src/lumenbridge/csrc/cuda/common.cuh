// Shared device helpers for the depthwise kernels: vector access, compile-time
// dispatch on dtype / kernel size / stride, and launch bookkeeping.
#pragma once

#include <ATen/Dispatch.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/types.h>

#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "../gateway.h"
#include "../kernel_sizes.h"

namespace lumenbridge {
namespace cuda {

constexpr int kThreads = 256;
constexpr int kMaxSharedBytes = 227 * 1024;  // shared memory a block may opt in to on sm_90

// VEC elements moved as one 16-, 8-, 4- or 2-byte access.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load_vec(const T* ptr) {
  return *reinterpret_cast<const Vec<T, VEC>*>(ptr);
}

// An unsigned word of `bytes` bytes.
template <int bytes>
using Word = std::conditional_t<
    bytes == 16, uint4,
    std::conditional_t<bytes == 8, uint2, std::conditional_t<bytes == 4, uint32_t, uint16_t>>>;

// Stored as words of up to 16 bytes: an assignment of the Vec as a struct
// may be split into its elements (the wide pointwise backward's widest
// instance stored each g_d pair as two 2-byte stores, and took 9% longer).
template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* ptr, const Vec<T, VEC>& value) {
  constexpr int bytes = sizeof(Vec<T, VEC>), word_bytes = bytes < 16 ? bytes : 16;
  static_assert(word_bytes >= 2 && (word_bytes & (word_bytes - 1)) == 0 && bytes % word_bytes == 0,
                "a Vec is whole words of 2, 4, 8 or 16 bytes");
  using W = Word<word_bytes>;
#pragma unroll
  for (int i = 0; i < bytes / word_bytes; ++i) reinterpret_cast<W*>(ptr)[i] = reinterpret_cast<const W*>(&value)[i];
}

// A bf16 pair (low half first) in float: a shift and a mask. Converted a
// value at a time, each half is first moved into a register of its own (two
// instructions a value in the SASS).
__device__ __forceinline__ float2 bf16_pair_to_floats(uint32_t pair) {
  return make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u));
}

// A vector's values in float, bf16 a pair at a time.
template <typename T, int VEC>
__device__ __forceinline__ void to_floats(const Vec<T, VEC>& in, float (&out)[VEC]) {
  if constexpr (std::is_same_v<T, at::BFloat16> && VEC % 2 == 0) {
    const auto* pairs = reinterpret_cast<const uint32_t*>(in.v);
#pragma unroll
    for (int i = 0; i < VEC / 2; ++i) {
      const float2 f = bf16_pair_to_floats(pairs[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = static_cast<float>(in.v[i]);
  }
}

// Two floats rounded to a bf16 / fp16 pair (a first, in the low half): one
// instruction (cvt ... x2), where rounding each value on its own and packing
// the halves takes three.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<at::BFloat16>(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<at::Half>(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// A bf16 / fp16 pair in float (pack2's inverse).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t u);
template <>
__device__ __forceinline__ float2 unpack2<at::BFloat16>(uint32_t u) {
  return bf16_pair_to_floats(u);
}
template <>
__device__ __forceinline__ float2 unpack2<at::Half>(uint32_t u) {
  return __half22float2(*reinterpret_cast<__half2*>(&u));
}

// Floats rounded to a vector of T (to_floats' inverse), half types a pair at
// a time.
template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> from_floats(const float (&in)[VEC]) {
  Vec<T, VEC> out;
  if constexpr ((std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) && VEC % 2 == 0) {
    auto* pairs = reinterpret_cast<uint32_t*>(out.v);
#pragma unroll
    for (int i = 0; i < VEC / 2; ++i) pairs[i] = pack2<T>(in[2 * i], in[2 * i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out.v[i] = static_cast<T>(in[i]);
  }
  return out;
}

template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> zero_vec() {
  Vec<T, VEC> r;
#pragma unroll
  for (int i = 0; i < VEC; ++i) r.v[i] = T(0.0f);
  return r;
}

// Sums `value` over the 32 lanes of a warp in a fixed order (the same tree
// for every lane), so every lane holds the same, deterministic sum.
__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
inline int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether 16-byte vector accesses may start at p.
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// MAX_VEC when that many elements evenly divide `extent` and every pointer is
// aligned to MAX_VEC elements; otherwise 1 (scalar).
template <typename T>
int vector_width(int max_vec, int64_t extent, std::initializer_list<const void*> pointers) {
  bool aligned = extent % max_vec == 0;
  for (const void* p : pointers) {
    aligned = aligned && (p == nullptr || reinterpret_cast<uintptr_t>(p) % (max_vec * sizeof(T)) == 0);
  }
  return aligned ? max_vec : 1;
}

// Runs `body` with std::integral_constant<int, K> for K in KernelSizes, and
// likewise for the stride, so kernels see both as compile-time constants.
template <typename Body>
void dispatch_kernel_size(int64_t k, Body&& body) {
  TORCH_CHECK(visit_kernel_size(k, body), "LumenBridge: internal error: unsupported kernel size ",
              text(k));
}

template <typename Body>
void dispatch_stride(int64_t s, Body&& body) {
  switch (s) {
    case 1: body(std::integral_constant<int, 1>{}); break;
    case 2: body(std::integral_constant<int, 2>{}); break;
    default: TORCH_CHECK(false, "LumenBridge: internal error: unsupported stride ", text(s));
  }
}

// dispatch_stride's twin for device code, on a stride the gateway has
// already checked (1 or 2).
template <typename Body>
__device__ __forceinline__ void dispatch_checked_stride(int s, Body&& body) {
  if (s == 2) {
    body(std::integral_constant<int, 2>{});
  } else {
    body(std::integral_constant<int, 1>{});
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

// The half types alone: the tensor-core kernels (fused, pointwise backward).
#define LUMENBRIDGE_DISPATCH_HALF_TYPES(TYPE, NAME, ...)                     \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__))

// Shared memory a block may opt in to on the current device (static and
// dynamic together): kMaxSharedBytes on sm_90, less on other GPUs. Asked of
// the runtime once per device and kept without a lock: every tokenize call
// consults it several times (threads that race store the same value).
inline size_t max_shared_bytes_per_block() {
  static std::array<std::atomic<size_t>, C10_COMPILE_TIME_MAX_GPUS> known{};
  const int device = c10::cuda::current_device();
  size_t bytes = known[device].load(std::memory_order_relaxed);
  if (bytes == 0) {
    int queried = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&queried, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    bytes = static_cast<size_t>(queried);
    known[device].store(bytes, std::memory_order_relaxed);
  }
  return bytes;
}

// Static plus dynamic shared memory past 48 KB must be opted into per
// kernel and device. The limit is an upper bound, so it is only ever raised:
// the runtime call costs microseconds of host time, which a small batch
// waits for, and is made once per kernel, device and new largest size (one
// kernel serves stages of different widths), and a launch on another thread
// can never find the limit lowered under it.
template <typename Kernel>
void allow_shared_bytes(Kernel kernel, size_t bytes) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, size_t> limits;
  const std::lock_guard<std::mutex> lock(mutex);
  size_t& limit = limits[{reinterpret_cast<const void*>(kernel), c10::cuda::current_device()}];
  if (bytes <= limit) return;
  TORCH_CHECK(bytes <= max_shared_bytes_per_block(), "LumenBridge: this GPU gives a block at most ",
              text(static_cast<int64_t>(max_shared_bytes_per_block())), " bytes of shared memory; the kernel for ",
              "this call needs ", text(static_cast<int64_t>(bytes)),
              " (backend=\"reference\" runs PyTorch's convolutions instead)");
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
  limit = bytes;
}

// Launch geometry of the kernels that are not persistent (the persistent ones
// use x alone): grid x covers tiles, y channels (NCHW) or channel slabs
// (NHWC weight gradient), z the batch where a kernel uses it, so kernels find
// their block with at most one 32-bit division. The hardware caps y and z at
// 65535: larger batches run as several launches, larger y extents are refused
// with a message.
constexpr int64_t kMaxGridYZ = 65535;

inline unsigned grid_x(int64_t blocks) {
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(),
              "LumenBridge: problem too large for one CUDA launch (", text(blocks), " blocks)");
  return static_cast<unsigned>(blocks);
}

inline unsigned grid_y(int64_t extent, const char* what) {
  TORCH_CHECK(extent <= kMaxGridYZ, "LumenBridge: the CUDA kernels cover at most ",
              text(kMaxGridYZ), " ", what, ", got ", text(extent));
  return static_cast<unsigned>(extent);
}

// The kernels index the depthwise weight ([C, 1, K, K]) with 32-bit integers too.
inline void check_extents_fit_int(const DepthwiseProblem& p) {
  TORCH_CHECK(p.C <= kMaxExtent && p.H <= kMaxExtent && p.W <= kMaxExtent,
              "LumenBridge: the CUDA kernels take channels, height and width up to ",
              text(kMaxExtent), " each, got [C, H, W] = ", text({p.C, p.H, p.W}));
  TORCH_CHECK(p.C * p.K * p.K <= std::numeric_limits<int32_t>::max(),
              "LumenBridge: the CUDA kernels take depthwise weights of fewer than 2^31 elements, got ",
              text({p.C, 1, p.K, p.K}));
}

// Calls launch(first_image, image_count) for slices of the batch that fit grid z.
template <typename Launch>
void for_each_batch_slice(int64_t batch, Launch&& launch) {
  for (int64_t n0 = 0; n0 < batch; n0 += kMaxGridYZ) {
    launch(n0, static_cast<unsigned>(std::min(kMaxGridYZ, batch - n0)));
  }
}

}  // namespace cuda
}  // namespace lumenbridge

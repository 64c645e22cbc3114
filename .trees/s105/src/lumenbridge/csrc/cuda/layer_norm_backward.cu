// LayerNorm's backward over rows [M, C] in one pass over x and grad. Each
// warp takes whole rows: it recomputes a row's statistics in float from x
// held in registers, writes the row's input gradient and adds the row's
// share of the weight's and bias's gradients to its lanes' sums. A block's
// warps then add their sums in warp order and write the block's partial
// sums, which sum_partials adds in a fixed order: no atomics, so the
// gradients are bitwise deterministic. ATen's form runs a forward for the
// statistics and two kernels after it (0.41 ms for the token norm at B = 256,
// bf16, on the H200: benchmarks/NOTES.md, twelfth session).
#include <c10/cuda/CUDAGuard.h>

#include "../layer_norm.h"
#include "common.cuh"
#include "partial_sums.cuh"

namespace lumenbridge {
namespace cuda {
namespace {

constexpr int kWarps = kThreads / 32;
// Rows split into at most this many runs, one a block: a function of the
// row count alone, so the sums' order (and the gradients' bits) never
// depend on the GPU; one wave at two blocks an SM on the H200.
constexpr int64_t kBlocks = 264;
// A lane holds at most 32 columns of a row, so rows of up to 1024 channels.
constexpr int kMaxLaneColumns = 32;

// A lane's columns of a row: NV vectors of one 16-byte access each, vector v
// at column (32 v + lane) VEC, so a warp's accesses are contiguous.
template <typename T, int NV>
struct LaneColumns {
  static constexpr int kVec = 16 / sizeof(T), kCount = NV * kVec;
  __device__ static int first(int v, int lane) { return (v * 32 + lane) * kVec; }
};

// This lane's columns of `row` in float; columns past C read as zero.
template <typename T, int NV>
__device__ __forceinline__ void load_lane(float (&out)[LaneColumns<T, NV>::kCount], const T* row, int lane,
                                          int C) {
  using Cols = LaneColumns<T, NV>;
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    const int col = Cols::first(v, lane);
    const Vec<T, Cols::kVec> x = col < C ? load_vec<T, Cols::kVec>(row + col) : zero_vec<T, Cols::kVec>();
#pragma unroll
    for (int e = 0; e < Cols::kVec; ++e) out[v * Cols::kVec + e] = static_cast<float>(x.v[e]);
  }
}

// Rows [blockIdx.x * rows_per_block, +rows_per_block) of this block (the
// last run may be shorter), its k-th row by warp k mod kWarps. partials is
// [gridDim.x, 2, C] (the weight's sums, then the bias's), or null when the
// parameters need no gradient.
template <typename T, int NV>
__global__ void __launch_bounds__(kThreads)
    layer_norm_backward_kernel(const T* __restrict__ grad, const T* __restrict__ x,
                               const T* __restrict__ weight, T* __restrict__ grad_input,
                               float* __restrict__ partials, int64_t rows, int64_t rows_per_block, int C,
                               float eps) {
  using Cols = LaneColumns<T, NV>;
  constexpr int E = Cols::kCount, VEC = Cols::kVec;
  extern __shared__ float shared[];
  float* const gamma = shared;           // [C], the weight in float
  float* const block_sums = shared + C;  // [2, C]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int i = threadIdx.x; i < C; i += kThreads) gamma[i] = static_cast<float>(weight[i]);
  __syncthreads();

  float sum_weight[E], sum_bias[E];
#pragma unroll
  for (int i = 0; i < E; ++i) sum_weight[i] = sum_bias[i] = 0.0f;

  const int64_t first = blockIdx.x * rows_per_block;
  const int64_t end = first + rows_per_block < rows ? first + rows_per_block : rows;
  for (int64_t r = first + warp; r < end; r += kWarps) {
    float xv[E], gv[E];
    load_lane<T, NV>(xv, x + r * C, lane, C);
    load_lane<T, NV>(gv, grad + r * C, lane, C);
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < E; ++i) total += xv[i];
    const float mean = warp_sum(total) * inv_c;
    float squares = 0.0f;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const bool inside = Cols::first(v, lane) < C;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float d = xv[v * VEC + e] - mean;
        squares += inside ? d * d : 0.0f;
      }
    }
    const float rstd = rsqrtf(warp_sum(squares) * inv_c + eps);
    // dx = rstd (gy - mean(gy) - xhat mean(gy xhat)) with gy = grad * gamma,
    // zero past C (where gamma is not there to read).
    float mean_gy = 0.0f, mean_gy_xhat = 0.0f;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const int col = Cols::first(v, lane);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int i = v * VEC + e;
        xv[i] = (xv[i] - mean) * rstd;  // xhat from here on
        const float gy = col < C ? gv[i] * gamma[col + e] : 0.0f;
        mean_gy += gy;
        mean_gy_xhat += gy * xv[i];
      }
    }
    mean_gy = warp_sum(mean_gy) * inv_c;
    mean_gy_xhat = warp_sum(mean_gy_xhat) * inv_c;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const int col = Cols::first(v, lane);
      if (col >= C) continue;
      Vec<T, VEC> dx;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int i = v * VEC + e;
        dx.v[e] = static_cast<T>(rstd * (gv[i] * gamma[col + e] - mean_gy - xv[i] * mean_gy_xhat));
        sum_weight[i] += gv[i] * xv[i];
        sum_bias[i] += gv[i];
      }
      store_vec<T, VEC>(grad_input + r * C + col, dx);
    }
  }
  if (partials == nullptr) return;  // uniform across the grid

  for (int w = 0; w < kWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        const int col = Cols::first(v, lane);
        if (col >= C) continue;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const int i = v * VEC + e;
          block_sums[col + e] = (w == 0 ? 0.0f : block_sums[col + e]) + sum_weight[i];
          block_sums[C + col + e] = (w == 0 ? 0.0f : block_sums[C + col + e]) + sum_bias[i];
        }
      }
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < 2 * C; i += kThreads) partials[blockIdx.x * 2LL * C + i] = block_sums[i];
}

// Runs body(std::integral_constant<int, NV>) for nv in [NV, MAX].
template <int NV, int MAX, typename Body>
void dispatch_lane_vectors(int nv, Body&& body) {
  if (nv == NV) {
    body(std::integral_constant<int, NV>{});
  } else if constexpr (NV < MAX) {
    dispatch_lane_vectors<NV + 1, MAX>(nv, body);
  }
}

// Whether the kernel covers these rows: one floating type throughout, both
// affine parameters (the tokenizer's norms have them), contiguous
// 16-byte-aligned rows of whole 16-byte vectors and at most kMaxLaneColumns
// columns a lane.
bool kernel_covers(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const at::ScalarType type = x.scalar_type();
  if (type != at::kFloat && type != at::kHalf && type != at::kBFloat16) return false;
  if (!weight.defined() || !bias.defined()) return false;
  for (const at::Tensor* t : {&grad, &weight, &bias}) {
    if (t->scalar_type() != type) return false;
  }
  const int64_t C = x.size(-1), vec = 16 / x.element_size();
  return x.numel() > 0 && C % vec == 0 && C <= 32 * kMaxLaneColumns && x.is_contiguous() &&
         grad.is_contiguous() && weight.is_contiguous() && aligned16(x.const_data_ptr()) &&
         aligned16(grad.const_data_ptr());
}

}  // namespace

AffineGrads layer_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                const at::Tensor& bias, double eps, bool parameters) {
  if (!kernel_covers(grad, x, weight, bias)) return layer_norm_backward_aten(grad, x, weight, bias, eps, parameters);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int C = static_cast<int>(x.size(-1));
  const int64_t rows = x.numel() / C;
  const size_t shared_bytes = 3 * C * sizeof(float);  // the weight, then the block's sums
  const int64_t rows_per_block = ceil_div64(rows, kBlocks);
  const int64_t blocks = ceil_div64(rows, rows_per_block);
  AffineGrads out{at::empty_like(x, at::MemoryFormat::Contiguous)};
  at::Tensor partials;
  if (parameters) partials = at::empty({blocks, 2, C}, x.options().dtype(at::kFloat));
  LUMENBRIDGE_DISPATCH_CUDA_TYPES(x.scalar_type(), "layer_norm_backward", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    bool launched = false;
    dispatch_lane_vectors<1, kMaxLaneColumns / kVec>(ceil_div(C, 32 * kVec), [&](auto nv) {
      layer_norm_backward_kernel<scalar_t, decltype(nv)::value><<<grid_x(blocks), kThreads, shared_bytes, stream>>>(
          grad.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(),
          out.input.mutable_data_ptr<scalar_t>(), parameters ? partials.mutable_data_ptr<float>() : nullptr,
          rows, rows_per_block, C, static_cast<float>(eps));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      launched = true;
    });
    TORCH_INTERNAL_ASSERT(launched, "the LayerNorm kernel covers rows of ", C, " channels");
    if (parameters) {
      out.weight = at::empty({C}, weight.options());
      out.bias = at::empty({C}, bias.options());
      sum_partials<scalar_t>(partials.const_data_ptr<float>(), 1, blocks, 2 * C,
                             {out.weight.mutable_data_ptr<scalar_t>(), out.bias.mutable_data_ptr<scalar_t>(), C, C},
                             stream);
    }
  });
  return out;
}

}  // namespace cuda
}  // namespace lumenbridge

// The pointwise backward of a stage with few input channels (the images'
// stage: 3), in one pass over its output gradient g [M, C] (M = N * h * w
// pixels, channels-last rows; 616 MB at B = 256 for lumenbridge-base):
//   g_d[m, j] = sum_c g[m, c] W[c, j]            j < Cin, written as [N, Cin, h, w]
//   partials of sum_m g[m, c] d[m, j]            j < Cin + 1: the weight, then the
//                                                 bias from the rows' ones column
// where d are the stage's depthwise rows [M, kRowWidth]. cuBLAS reads g twice
// for these (two GEMMs whose other dimension is 3 or 4, so both are bound by
// g's bytes), and g_d's narrow rows still need a copy to NCHW.
//
// A tile is kTileRows consecutive rows: g's rows and d's, one flat copy each.
// Each thread then takes, for the weight sums, a fixed 8-channel chunk of g's
// rows and a fixed set of rows (its sums stay in registers across tiles), and
// for g_d, chunks of one row (its three dot products reduced over the four
// threads of the row by shuffles). The sums are deterministic: each block
// takes a fixed run of tiles and adds its threads in a fixed order, and pass
// 2 sums the blocks in a fixed order (partial_sums.cuh).
#include <c10/cuda/CUDAGuard.h>

#include "../tokenize.h"
#include "common.cuh"
#include "partial_sums.cuh"
#include "pipeline.cuh"
#include "weight_partials.cuh"

namespace lumenbridge {
namespace cuda {
namespace {

constexpr int kRowWidth = static_cast<int>(kRowAlignment);  // the depthwise rows' width
constexpr int kTerms = static_cast<int>(kNarrowRowTerms);     // Cin weights, then the bias
constexpr int kMaxInChannels = kTerms - 1;
constexpr int kChunk = 8;       // channels a thread takes at once
constexpr int kMaxChunks = 32;  // C <= 256: at least 8 row groups for the weight sums
constexpr int kTileRows = 64;
constexpr int kRowThreads = 4;  // threads that share one row's g_d
constexpr int kStages = 3;      // tiles in flight, with the one computed
using WeightColumns = float[kMaxInChannels][kMaxChunks * kChunk];  // W^T in shared memory, zero past Cin
static_assert(kTileRows * kRowThreads == kThreads, "one g_d row per four threads");

template <typename T>
struct NarrowTile {
  static constexpr int kUnit = 16 / sizeof(T);  // elements per 16-byte copy
  static constexpr int kDElems = kTileRows * kRowWidth;
};

// A tile's elements: g's rows, then d's.
template <typename T>
__host__ __device__ int narrow_tile_elems(int C) {
  return kTileRows * C + NarrowTile<T>::kDElems;
}

// Copies `elems` elements from `src` (of which `valid` exist) to `dst` in
// 16-byte units, zero-filling past `valid`.
template <typename T>
__device__ __forceinline__ void copy_flat(T* dst, const T* src, int64_t elems, int64_t valid, int tid) {
  constexpr int kUnit = NarrowTile<T>::kUnit;
  for (int64_t e = static_cast<int64_t>(tid) * kUnit; e < elems; e += static_cast<int64_t>(kThreads) * kUnit) {
    copy_chunk_async<T, kUnit>(dst + e, src + (e < valid ? e : 0), e < valid);
  }
}

template <typename T>
__device__ __forceinline__ void unpack_chunk(const T* p, float (&v)[kChunk]) {
  const Vec<T, kChunk> chunk = load_vec<T, kChunk>(p);
#pragma unroll
  for (int e = 0; e < kChunk; ++e) v[e] = static_cast<float>(chunk.v[e]);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2)
    pointwise_backward_narrow_kernel(const T* __restrict__ grad, const T* __restrict__ rows,
                                     const T* __restrict__ weight, T* __restrict__ grad_depthwise,
                                     float* __restrict__ partials, int64_t M, int C, int cin, int64_t plane,
                                     TileSpace<1> space, int tiles, int tiles_per_block, int chunks) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  __shared__ __align__(32) WeightColumns w;
  T* const buffers = reinterpret_cast<T*>(shared_bytes);
  const int tid = threadIdx.x;
  const int chunks_per_row = C / kChunk;
  const int elems = narrow_tile_elems<T>(C);
  for (int k = tid; k < kMaxInChannels * C; k += kThreads) {
    const int j = k / C, c = k % C;
    w[j][c] = j < cin ? static_cast<float>(weight[c * cin + j]) : 0.0f;
  }

  auto load = [&](T* tile, const TileCursor<1>& t) {
    const int64_t m0 = static_cast<int64_t>(t.digit[0]) * kTileRows;
    const int64_t valid = M - m0;
    copy_flat<T>(tile, grad + m0 * C, static_cast<int64_t>(kTileRows) * C, valid * C, tid);
    copy_flat<T>(tile + kTileRows * C, rows + m0 * kRowWidth, NarrowTile<T>::kDElems, valid * kRowWidth, tid);
  };

  // Weight sums: thread (row group, chunk), over rows group, + groups, ...
  const int groups = kThreads / chunks_per_row;
  const int my_chunk = tid % chunks_per_row, my_group = tid / chunks_per_row;
  const bool sums_thread = my_group < groups;
  float sums[kChunk][kTerms] = {};
  // g_d: thread (row, part), over the row's chunks part, + kRowThreads, ...
  const int gd_row = tid / kRowThreads, gd_part = tid % kRowThreads;

  auto compute = [&](const T* tile, const TileCursor<1>& t) {
    const T* d = tile + kTileRows * C;
    if (sums_thread) {
      for (int r = my_group; r < kTileRows; r += groups) {
        float g[kChunk];
        unpack_chunk<T>(tile + r * C + my_chunk * kChunk, g);
        const Vec<T, kTerms> terms = load_vec<T, kTerms>(d + r * kRowWidth);
#pragma unroll
        for (int j = 0; j < kTerms; ++j) {
          const float dj = static_cast<float>(terms.v[j]);
#pragma unroll
          for (int e = 0; e < kChunk; ++e) sums[e][j] = fmaf(g[e], dj, sums[e][j]);
        }
      }
    }
    float gd[kMaxInChannels] = {};
    for (int q = gd_part; q < chunks_per_row; q += kRowThreads) {
      float g[kChunk];
      unpack_chunk<T>(tile + gd_row * C + q * kChunk, g);
#pragma unroll
      for (int j = 0; j < kMaxInChannels; ++j) {
        const Vec<float, kChunk> wj = load_vec<float, kChunk>(&w[j][q * kChunk]);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) gd[j] = fmaf(g[e], wj.v[e], gd[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kMaxInChannels; ++j) {
      gd[j] += __shfl_xor_sync(0xffffffffu, gd[j], 1);
      gd[j] += __shfl_xor_sync(0xffffffffu, gd[j], 2);
    }
    const int64_t m = static_cast<int64_t>(t.digit[0]) * kTileRows + gd_row;
    if (gd_part < cin && m < M) {
      const int64_t image = m / plane, pixel = m % plane;
      const float value = gd_part == 0 ? gd[0] : gd_part == 1 ? gd[1] : gd[2];
      grad_depthwise[(image * cin + gd_part) * plane + pixel] = static_cast<T>(value);
    }
  };

  const int first = static_cast<int>(blockIdx.x) * tiles_per_block;
  run_tile_pipeline<kStages>(space, first, min(tiles_per_block, tiles - first), buffers, elems, load, NoStep{},
                             NoStep{}, compute);
  cp_async_wait_pending<0>();
  __syncthreads();
  // The block's partials: each (channel, term) summed over the row groups in order.
  float* block_sums = reinterpret_cast<float*>(shared_bytes);  // [groups][C][kTerms]
  if (sums_thread) {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
#pragma unroll
      for (int j = 0; j < kTerms; ++j) block_sums[(my_group * C + my_chunk * kChunk + e) * kTerms + j] = sums[e][j];
    }
  }
  __syncthreads();
  const int terms = cin + 1;
  for (int k = tid; k < C * terms; k += kThreads) {
    const int c = k / terms, j = k % terms;
    float total = 0.0f;
    for (int group = 0; group < groups; ++group) total += block_sums[(group * C + c) * kTerms + j];
    partials[(static_cast<int64_t>(c) * chunks + blockIdx.x) * terms + j] = total;
  }
}

// Whether the kernel covers the problem: the tensors as it reads them.
bool narrow_kernel_covers(const at::Tensor& grad, const at::Tensor& rows, const at::Tensor& weight, int64_t cin) {
  const int64_t C = grad.size(1);
  return cin <= kMaxInChannels && rows.size(1) == kRowWidth && C % kChunk == 0 && C / kChunk <= kMaxChunks &&
         grad.is_contiguous() && rows.is_contiguous() && weight.is_contiguous() &&
         aligned16(grad.const_data_ptr()) && aligned16(rows.const_data_ptr()) && grad.size(0) > 0;
}

// Shared bytes: the pipeline's buffers, or the block's sums after it.
template <typename T>
size_t narrow_shared_bytes(int C) {
  const size_t pipeline = kStages * narrow_tile_elems<T>(C) * sizeof(T);
  const size_t sums = sizeof(float) * (kThreads / (C / kChunk)) * C * kTerms;
  return std::max(pipeline, sums);
}

}  // namespace

PointwiseGrads pointwise_backward(const at::Tensor& grad, const at::Tensor& rows, const at::Tensor& weight,
                                  const DepthwiseProblem& p, bool parameters) {
  const int64_t cin = p.C, M = grad.size(0), C = grad.size(1);
  if (!parameters || p.layout != Layout::NCHW || !narrow_kernel_covers(grad, rows, weight, cin)) {
    return pointwise_backward_composed(grad, rows, weight, p, parameters);
  }
  const c10::cuda::CUDAGuard guard(grad.device());
  TORCH_INTERNAL_ASSERT(M == p.N * p.Ho * p.Wo && rows.size(0) == M && weight.numel() == C * cin);
  const int64_t tiles = ceil_div64(M, kTileRows);
  TORCH_CHECK(tiles <= std::numeric_limits<int32_t>::max(), "LumenBridge: too many pixels for one launch (",
              text(M), ")");
  // A fixed run of tiles a block, aiming at one wave of two blocks an SM on
  // the H200, as the NHWC depthwise weight gradients.
  const int run = tiles_per_block(tiles, 1, kNhwcBlocks);
  const int64_t chunks = ceil_div64(tiles, run);
  PointwiseGrads out;
  LUMENBRIDGE_DISPATCH_CUDA_TYPES(grad.scalar_type(), "lumenbridge_pointwise_backward_narrow", [&] {
    using T = scalar_t;
    constexpr auto kernel = pointwise_backward_narrow_kernel<T>;
    const size_t shared = narrow_shared_bytes<T>(static_cast<int>(C));
    if (shared + sizeof(WeightColumns) > max_shared_bytes_per_block()) {
      out = pointwise_backward_composed(grad, rows, weight, p, parameters);
      return;
    }
    const auto options = grad.options();
    out.grad_depthwise = new_output({p.N, cin, p.Ho, p.Wo}, options, at::MemoryFormat::Contiguous);
    out.weight = new_output({C, cin, 1, 1}, options, at::MemoryFormat::Contiguous);
    out.bias = new_output({C}, options, at::MemoryFormat::Contiguous);
    at::Tensor partials = at::empty({C, chunks, cin + 1}, options.dtype(at::kFloat));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    allow_shared_bytes(kernel, shared);
    kernel<<<grid_x(chunks), kThreads, shared, stream>>>(
        grad.const_data_ptr<T>(), rows.const_data_ptr<T>(), weight.const_data_ptr<T>(),
        out.grad_depthwise.mutable_data_ptr<T>(), partials.mutable_data_ptr<float>(), M, static_cast<int>(C),
        static_cast<int>(cin), p.Ho * p.Wo, tile_space<1>({tiles}, 1), static_cast<int>(tiles), run,
        static_cast<int>(chunks));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    sum_partials<T>(partials.const_data_ptr<float>(), C, chunks, static_cast<int>(cin + 1),
                    {out.weight.mutable_data_ptr<T>(), out.bias.mutable_data_ptr<T>(), static_cast<int>(cin), 1},
                    stream);
  });
  return out;
}

}  // namespace cuda
}  // namespace lumenbridge

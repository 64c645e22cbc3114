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
// Both products run on the tensor cores (m16n8k16, float accumulators), so a
// tile costs a few dozen instructions a warp and the kernel waits on g's
// bytes alone (CUDA-core FMAs measured 342 us at B = 256, about 1.3 issues a
// cycle: benchmarks/NOTES.md, step 35). A tile is kTileRows consecutive rows
// of g (rows padded in shared memory, so ldmatrix's eight rows fall in
// distinct banks) and of d.
//   weight sums  G^T D: warp w owns channel blocks w, w + 8 (16 channels
//                each) for the whole run of tiles, A = G^T by transposed
//                ldmatrix, B = d's rows by transposed ldmatrix;
//   g_d          G W: warps 0-3 take one 16-row block each, A = G by ldmatrix,
//                B = W (zero past Cin) held in registers.
// The sums are deterministic: each block takes a fixed run of tiles, each
// warp adds its own channels' mma in a fixed order, and pass 2 sums the
// blocks in a fixed order (partial_sums.cuh).
#include "fused_parts.cuh"
#include "pointwise_backward_launch.cuh"

namespace lumenbridge {
namespace cuda {
namespace {

using fused::GridCursor;
using fused::padded_stride;

constexpr int kRowWidth = static_cast<int>(kRowAlignment);  // the depthwise rows' width
constexpr int kTerms = static_cast<int>(kNarrowRowTerms);     // Cin weights, then the bias
constexpr int kMaxInChannels = kTerms - 1;
constexpr int kTileRows = kOnePassTileRows, kBlockRows = kOnePassBlockRows;
constexpr int kRowBlocks = kTileRows / kBlockRows;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxChannelBlocks = 16;  // C <= 256
constexpr int kChannelBlocksPerWarp = kMaxChannelBlocks / kWarps;
constexpr int kStages = 3;  // tile buffers: two tiles in flight while one is computed
static_assert(kRowBlocks <= kWarps, "a warp per g_d row block");

// A tile's elements: g's rows (padded), then d's.
__host__ __device__ int narrow_tile_elems(int C) { return kTileRows * padded_stride(C) + kTileRows * kRowWidth; }

// Two elements as an mma operand word, the first in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(T low, T high) {
  return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&low)) |
         static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&high)) << 16;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 2)
    pointwise_backward_narrow_kernel(const T* __restrict__ grad, const T* __restrict__ rows,
                                     const T* __restrict__ weight, T* __restrict__ grad_depthwise,
                                     float* __restrict__ partials, int64_t M, int C, int cin, int64_t plane,
                                     TileSpace<1> space, int tiles, int tiles_per_block, int chunks) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* const buffers = reinterpret_cast<T*>(shared_bytes);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // an mma fragment's row group and column pair
  const int stride = padded_stride(C), channel_blocks = C / 16;
  const T zero = static_cast<T>(0.0f);

  // g_d's B operand, per 16-channel step: W[c][j] at k = c, n = j.
  uint32_t w[kMaxChannelBlocks][2] = {};
  if (warp < kRowBlocks) {
    const auto w_at = [&](int c, int j) { return j < cin ? weight[c * cin + j] : zero; };
#pragma unroll
    for (int kb = 0; kb < kMaxChannelBlocks; ++kb) {
      if (kb < channel_blocks) {
        const int c = kb * 16 + 2 * t;
        w[kb][0] = pack2<T>(w_at(c, g), w_at(c + 1, g));
        w[kb][1] = pack2<T>(w_at(c + 8, g), w_at(c + 9, g));
      }
    }
  }

  const GridCursor first_unit(C / 8, tid, kThreads);  // 16-byte units of g's rows
  auto load = [&](T* tile, const TileCursor<1>& cursor) {
    const int64_t m0 = static_cast<int64_t>(cursor.digit[0]) * kTileRows;
    for (GridCursor unit = first_unit; unit.row < kTileRows; unit.advance()) {
      const bool inside = m0 + unit.row < M;
      copy_chunk_async<T, 8>(tile + unit.row * stride + unit.column * 8,
                             grad + (inside ? (m0 + unit.row) * C + unit.column * 8 : 0), inside);
    }
    if (tid < kTileRows) {
      const bool inside = m0 + tid < M;
      copy_chunk_async<T, 8>(tile + kTileRows * stride + tid * kRowWidth,
                             rows + (inside ? (m0 + tid) * kRowWidth : 0), inside);
    }
  };

  float sums[kChannelBlocksPerWarp][4] = {};
  auto compute = [&](const T* tile, const TileCursor<1>& cursor) {
    const T* d = tile + kTileRows * stride;
    const int matrix = lane / 8, matrix_row = lane % 8;
    // Weight sums: A = G^T (16 channels x 16 rows): matrices (rows 0-7, channels
    // 0-7), (rows 0-7, channels 8-15), (rows 8-15, 0-7), (rows 8-15, 8-15).
#pragma unroll
    for (int s = 0; s < kChannelBlocksPerWarp; ++s) {
      const int cb = warp + s * kWarps;
      if (cb >= channel_blocks) continue;
#pragma unroll
      for (int rb = 0; rb < kRowBlocks; ++rb) {
        uint32_t a[4], b[2];
        const int row = rb * kBlockRows + (matrix / 2) * 8 + matrix_row;
        fused::ldmatrix_x4_trans(a, tile + row * stride + cb * 16 + (matrix % 2) * 8);
        fused::ldmatrix_x2_trans(b, d + (rb * kBlockRows + lane % 16) * kRowWidth);
        fused::mma_16816<T>(sums[s], a, b[0], b[1]);
      }
    }
    // g_d: A = G (16 rows x 16 channels): matrices (rows 0-7, channels 0-7),
    // (rows 8-15, 0-7), (rows 0-7, 8-15), (rows 8-15, 8-15).
    if (warp < kRowBlocks) {
      float gd[4] = {};
      const int row = warp * kBlockRows + (matrix % 2) * 8 + matrix_row;
#pragma unroll
      for (int kb = 0; kb < kMaxChannelBlocks; ++kb) {
        if (kb >= channel_blocks) break;
        uint32_t a[4];
        fused::ldmatrix_x4(a, tile + row * stride + kb * 16 + (matrix / 2) * 8);
        fused::mma_16816<T>(gd, a, w[kb][0], w[kb][1]);
      }
      // gd[0], gd[1]: row g, j = 2t, 2t + 1; gd[2], gd[3]: row g + 8.
      const int64_t m0 = static_cast<int64_t>(cursor.digit[0]) * kTileRows + warp * kBlockRows + g;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t m = m0 + half * 8;
        if (m >= M) continue;
        const int64_t image = m / plane, pixel = m % plane;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = 2 * t + e;
          if (j < cin) grad_depthwise[(image * cin + j) * plane + pixel] = static_cast<T>(gd[2 * half + e]);
        }
      }
    }
  };

  const int first = static_cast<int>(blockIdx.x) * tiles_per_block;
  run_tile_pipeline<kStages>(space, first, min(tiles_per_block, tiles - first), buffers, narrow_tile_elems(C), load,
                             NoStep{}, NoStep{}, compute);
  cp_async_wait_pending<0>();
  // sums[s][0], [1]: channel 16 cb + g, terms 2t, 2t + 1; [2], [3]: channel + 8.
  const int terms = cin + 1;
#pragma unroll
  for (int s = 0; s < kChannelBlocksPerWarp; ++s) {
    const int cb = warp + s * kWarps;
    if (cb >= channel_blocks) continue;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = cb * 16 + g + (i / 2) * 8, j = 2 * t + i % 2;
      if (j < terms) partials[(static_cast<int64_t>(c) * chunks + blockIdx.x) * terms + j] = sums[s][i];
    }
  }
}

// Whether the kernel covers the problem: the tensors as it reads them.
bool narrow_kernel_covers(const at::Tensor& grad, const at::Tensor& rows, const at::Tensor& weight, int64_t cin) {
  const int64_t C = grad.size(1);
  const bool half = grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kBFloat16;
  return half && cin <= kMaxInChannels && rows.size(1) == kRowWidth && C % 16 == 0 &&
         C / 16 <= kMaxChannelBlocks && grad.is_contiguous() && rows.is_contiguous() && weight.is_contiguous() &&
         aligned16(grad.const_data_ptr()) && aligned16(rows.const_data_ptr()) && grad.size(0) > 0;
}

}  // namespace

PointwiseGrads pointwise_backward(at::Tensor grad, const at::Tensor& rows, const at::Tensor& weight,
                                  const DepthwiseProblem& p, bool parameters) {
  if (parameters) {
    if (auto wide = pointwise_backward_wide(grad, rows, weight, p)) return std::move(*wide);
  }
  std::optional<PointwiseGrads> out;
  if (parameters && p.layout == Layout::NCHW && narrow_kernel_covers(grad, rows, weight, p.C)) {
    LUMENBRIDGE_DISPATCH_HALF_TYPES(grad.scalar_type(), "lumenbridge_pointwise_backward_narrow", [&] {
      // A fixed run of tiles a block, aiming at one wave of two blocks an SM
      // on the H200, as the NHWC depthwise weight gradients.
      out = launch_one_pass<scalar_t>(pointwise_backward_narrow_kernel<scalar_t>, kThreads,
                                      kStages * narrow_tile_elems(static_cast<int>(grad.size(1))) * sizeof(scalar_t),
                                      kNhwcBlocks, p.Ho * p.Wo, at::MemoryFormat::Contiguous, at::Tensor(),
                                      grad, rows, weight, p);
    });
  }
  return out ? std::move(*out) : pointwise_backward_composed(std::move(grad), rows, weight, p, parameters);
}

}  // namespace cuda
}  // namespace lumenbridge

// The pointwise backward of a wide stage (lumenbridge-base's stage 2: 96 ->
// 192 channels) in one pass over its output gradient g [M, C] (M = N * h * w
// pixels, channels-last rows; 308 MB at B = 256):
//   g_d[m, j] = sum_c g[m, c] W[c, j]            j < Cin, written as rows [M, Cin],
//                                                 or over g's rows (below)
//   partials of sum_m g[m, c] d[m, j]            j < Cin + 1: the weight, then the
//                                                 bias from the rows' ones column
// where d are the stage's depthwise rows [M, depthwise_row_width(Cin)].
// cuBLAS runs these as two GEMMs that each read g, both bound by their bytes
// (937 MB at B = 256, 2.8 TB/s on an H100); one pass reads g once (629 MB).
//
// The narrow kernel's design (pointwise_backward_narrow.cu) with both
// products' operands from shared memory: a tile is kTileRows consecutive
// rows of g and of d in a cp.async ring; W sits in shared memory for the
// whole run. Sixteen warps, four a scheduler, so that one warp's ldmatrix
// and mma latencies hide behind the others' (at eight warps, 181 registers
// a thread, the kernel took 504 us at stage 2 where its bytes and its mma
// each allow about 200):
//   weight sums  G^T D: warp w owns channel blocks 3 (w % 4) .. + 2 (16
//                channels each) and term tiles 4 (w / 4) .. + 3 (8 terms
//                each) for the whole run of tiles, A = G^T and B = d's rows
//                by transposed ldmatrix: 48 float accumulators a thread;
//   g_d          G W: warp w takes row block w % 4 and output tiles 3 (w / 4)
//                .. + 2, A = G by ldmatrix, B = W by transposed ldmatrix.
// A warp's slots past the shape's blocks and tiles repeat its last one, so
// the loops hold no branch: with a branch around each term tile, each
// tile's mma waited for its own ldmatrix (sm_90a SASS). Branch-free and
// with sixteen warps the kernel took 314 us where the branched eight-warp
// one took 504 (H100, benchmarks/NOTES.md, step 100). The repeats' sums
// are not written (at stage 2, 3 of d's 16 term slots).
// The sums are deterministic as the narrow kernel's: a fixed run of tiles a
// block, each warp's own mma in a fixed order, pass 2 in block order.
// The widest stage the kernel covers (C = 192, Cin = 96: lumenbridge-base's
// stage 2 and lumenbridge-small's stage 3) runs an instance with those widths
// known to the compiler, so that each ldmatrix's shared-memory address is a
// register plus an immediate, and the g_d loop is unrolled whole: its sm_90a
// SASS runs about 245 instructions a warp between a tile's loads and its
// stores where the instance for any width runs 395 on that stage (the
// strides' products recomputed for each ldmatrix). With the tile's loads as
// runs of units (below: about 125 instructions a warp, where a cursor over
// rows and columns with 64-bit addresses took 200), a tile is about 450.
// Handed g's only reference, the kernel writes g_d over g: row m of g_d into
// the first Cin elements of g's row m, so g_d's rows lie C elements apart.
// A tile stores its g_d rows after its g rows reached shared memory (each
// thread's wait, then the pipeline's barrier), and no other tile reads them:
// at B = 256 this keeps lumenbridge-base's 147 MiB g_d out of the training
// step's peak, which was this kernel's launch (benchmarks/NOTES.md).
#include "../activated_depthwise.h"
#include "fused_parts.cuh"
#include "pointwise_backward_launch.cuh"

namespace lumenbridge {
namespace cuda {
namespace {

using fused::padded_stride;

constexpr int kWideThreads = 512;
constexpr int kWarps = kWideThreads / 32;
constexpr int kTileRows = kOnePassTileRows, kBlockRows = kOnePassBlockRows;
constexpr int kRowBlocks = kTileRows / kBlockRows;
// Tile buffers: two tiles in flight while one is computed. At stage 2 a
// tile is 38.9 KB, past pipeline_stages' rule for two blocks an SM; this
// kernel runs one (its 16 warps take all of an SM's registers).
constexpr int kStages = 3;
// What a block's accumulators hold: C <= 192 and Cin <= 96, so d's rows
// (Cin + 1 rounded up to 8: at most 104 terms, 13 tiles) fit four groups of
// four term tiles.
constexpr int kChannelGroups = 4, kTermGroups = kWarps / kChannelGroups;
constexpr int kWarpChannelBlocks = 3, kWarpTermTiles = 4, kWarpOutputTiles = 3;
constexpr int kMaxChannels = kWarpChannelBlocks * 16 * kChannelGroups;
constexpr int kMaxInChannels = kWarpOutputTiles * 8 * (kWarps / kRowBlocks);
static_assert(kWarps % kRowBlocks == 0, "whole warps a g_d row block");
static_assert(kTermGroups * kWarpTermTiles * 8 >= kMaxInChannels + 8, "the term groups hold d's rows");
// A thread's 16-byte units of a tile's g and d (whose rows are at most the
// terms the term groups hold).
constexpr int kGUnitsPerThread = (kTileRows * kMaxChannels / 8 + kWideThreads - 1) / kWideThreads;
constexpr int kDUnitsPerThread = (kTileRows * kTermGroups * kWarpTermTiles + kWideThreads - 1) / kWideThreads;
// One block an SM (its registers and the ring): one wave on 132 SMs. A
// function of the shape alone, so the sums are the same on every GPU.
constexpr int64_t kWideBlocks = 132;

// A tile's rows of one matrix into shared memory: in global memory they are
// one run of 16-byte units, `row_units` a row, so a thread's i-th unit (u =
// tid + 512 i) sits at a fixed place in the run, and the units inside the
// matrix are the first rows_inside x row_units (the rest are zeros). Shared
// rows are `padding` elements longer, so the unit's row places it there.
template <int kUnitsPerThread, typename T>
__device__ __forceinline__ void load_tile_rows(T* dst, const T* run, int row_units, int padding, int rows_inside) {
  const int inside = rows_inside * row_units;
#pragma unroll
  for (int i = 0; i < kUnitsPerThread; ++i) {
    const int u = static_cast<int>(threadIdx.x) + i * kWideThreads;
    if (u >= kTileRows * row_units) break;
    copy_chunk_async<T, 8>(dst + u * 8 + u / row_units * padding, run + (u < inside ? u * 8 : 0), u < inside);
  }
}

// A tile's elements: g's rows (padded), then d's.
__host__ __device__ int wide_tile_elems(int C, int row_width) {
  return kTileRows * padded_stride(C) + kTileRows * row_width;
}

// The widths the kernel takes besides C and Cin: d's rows', and the distance
// between g_d's rows (Cin, or C where g_d is written over g).
struct WideWidths {
  int row_width, grad_depthwise_pitch;
};

// kWidest: the caller has checked that C and Cin are the widest covered.
template <typename T, bool kWidest>
__global__ void __launch_bounds__(kWideThreads, 1)
    pointwise_backward_wide_kernel(const T* grad, const T* __restrict__ rows,
                                   const T* __restrict__ weight, T* grad_depthwise,  // may be grad
                                   float* __restrict__ partials, int64_t M, int C, int cin, WideWidths widths,
                                   TileSpace<1> space, int tiles, int tiles_per_block, int chunks) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  if constexpr (kWidest) {
    C = kMaxChannels;
    cin = kMaxInChannels;
  }
  const int row_width = widths.row_width;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // an mma fragment's row group and column pair
  const int matrix = lane / 8, matrix_row = lane % 8;
  const int g_stride = padded_stride(C), w_stride = padded_stride(cin);
  const int channel_blocks = C / 16, term_tiles = row_width / 8, output_tiles = cin / 8;
  T* const w_tile = reinterpret_cast<T*>(shared_bytes);  // [C][w_stride]: W, zero past Cin
  T* const buffers = w_tile + C * w_stride;

  for (int i = tid; i < C * w_stride; i += kWideThreads) {
    const int c = i / w_stride, j = i % w_stride;
    w_tile[i] = j < cin ? weight[c * cin + j] : static_cast<T>(0.0f);
  }

  auto load = [&](T* tile, const TileCursor<1>& cursor) {
    const int64_t m0 = static_cast<int64_t>(cursor.digit[0]) * kTileRows;
    const int rows_inside = static_cast<int>(min(static_cast<int64_t>(kTileRows), M - m0));
    load_tile_rows<kGUnitsPerThread>(tile, grad + m0 * C, C / 8, g_stride - C, rows_inside);
    load_tile_rows<kDUnitsPerThread>(tile + kTileRows * g_stride, rows + m0 * row_width, row_width / 8, 0,
                                     rows_inside);
  };

  const int first_block = (warp % kChannelGroups) * kWarpChannelBlocks;
  const int first_term_tile = (warp / kChannelGroups) * kWarpTermTiles;
  const int row_block = warp % kRowBlocks, first_output_tile = (warp / kRowBlocks) * kWarpOutputTiles;
  // Each slot's shared-memory column (elements), its repeats clamped to the last.
  int block_column[kWarpChannelBlocks], term_column[kWarpTermTiles], output_column[kWarpOutputTiles];
#pragma unroll
  for (int s = 0; s < kWarpChannelBlocks; ++s) block_column[s] = min(first_block + s, channel_blocks - 1) * 16;
#pragma unroll
  for (int n = 0; n < kWarpTermTiles; ++n) term_column[n] = min(first_term_tile + n, term_tiles - 1) * 8;
#pragma unroll
  for (int n = 0; n < kWarpOutputTiles; ++n) output_column[n] = min(first_output_tile + n, output_tiles - 1) * 8;
  float sums[kWarpChannelBlocks][kWarpTermTiles][4] = {};
  auto compute = [&](const T* tile, const TileCursor<1>& cursor) {
    const T* d = tile + kTileRows * g_stride;
    // Weight sums: A = G^T (16 channels x 16 rows): matrices (rows 0-7, channels
    // 0-7), (rows 0-7, channels 8-15), (rows 8-15, 0-7), (rows 8-15, 8-15).
#pragma unroll
    for (int rb = 0; rb < kRowBlocks; ++rb) {
      uint32_t a[kWarpChannelBlocks][4];
      const int row = rb * kBlockRows + (matrix / 2) * 8 + matrix_row;
#pragma unroll
      for (int s = 0; s < kWarpChannelBlocks; ++s) {
        fused::ldmatrix_x4_trans(a[s], tile + row * g_stride + block_column[s] + (matrix % 2) * 8);
      }
#pragma unroll
      for (int n = 0; n < kWarpTermTiles; ++n) {
        uint32_t b[2];
        fused::ldmatrix_x2_trans(b, d + (rb * kBlockRows + lane % 16) * row_width + term_column[n]);
#pragma unroll
        for (int s = 0; s < kWarpChannelBlocks; ++s) fused::mma_16816<T>(sums[s][n], a[s], b[0], b[1]);
      }
    }
    // g_d: A = G (16 rows x 16 channels): matrices (rows 0-7, channels 0-7),
    // (rows 8-15, 0-7), (rows 0-7, 8-15), (rows 8-15, 8-15); B = W's rows.
    float gd[kWarpOutputTiles][4] = {};
    const int row = row_block * kBlockRows + (matrix % 2) * 8 + matrix_row;
    for (int kb = 0; kb < channel_blocks; ++kb) {
      uint32_t a[4];
      fused::ldmatrix_x4(a, tile + row * g_stride + kb * 16 + (matrix / 2) * 8);
#pragma unroll
      for (int n = 0; n < kWarpOutputTiles; ++n) {
        uint32_t b[2];
        fused::ldmatrix_x2_trans(b, w_tile + (kb * 16 + lane % 16) * w_stride + output_column[n]);
        fused::mma_16816<T>(gd[n], a, b[0], b[1]);
      }
    }
    // gd[n][0], [1]: row g, outputs 8 (first + n) + 2t, + 1; [2], [3]: row g + 8.
    const int64_t m0 = static_cast<int64_t>(cursor.digit[0]) * kTileRows + row_block * kBlockRows + g;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t m = m0 + half * 8;
      if (m >= M) continue;
#pragma unroll
      for (int n = 0; n < kWarpOutputTiles; ++n) {
        // The widest stage has no slots past its tiles: no test there.
        if (!kWidest && first_output_tile + n >= output_tiles) continue;
        const float pair[2] = {gd[n][2 * half], gd[n][2 * half + 1]};
        store_vec<T, 2>(grad_depthwise + m * widths.grad_depthwise_pitch + (first_output_tile + n) * 8 + 2 * t,
                        from_floats<T, 2>(pair));
      }
    }
  };

  const int first = static_cast<int>(blockIdx.x) * tiles_per_block;
  run_tile_pipeline<kStages>(space, first, min(tiles_per_block, tiles - first), buffers,
                             wide_tile_elems(C, row_width), load, NoStep{}, NoStep{}, compute);
  cp_async_wait_pending<0>();
  // sums[s][n][0], [1]: channel 16 (first + s) + g, terms 8 (first + n) + 2t,
  // + 1; [2], [3]: channel + 8.
  const int terms = cin + 1;
#pragma unroll
  for (int s = 0; s < kWarpChannelBlocks; ++s) {
    if (first_block + s >= channel_blocks) continue;
#pragma unroll
    for (int n = 0; n < kWarpTermTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        // A repeated term slot's j is past d's rows, so j < terms drops it too.
        const int c = (first_block + s) * 16 + g + (i / 2) * 8, j = (first_term_tile + n) * 8 + 2 * t + i % 2;
        if (j < terms) partials[(static_cast<int64_t>(c) * chunks + blockIdx.x) * terms + j] = sums[s][n][i];
      }
    }
  }
}

// Whether the kernel covers the problem: the tensors as it reads them, and a
// stage whose sums fit a block's accumulators.
bool wide_kernel_covers(const at::Tensor& grad, const at::Tensor& rows, const at::Tensor& weight, int64_t cin) {
  const int64_t C = grad.size(1);
  const bool half = grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kBFloat16;
  return half && C > 0 && C % 16 == 0 && C <= kMaxChannels && cin % 8 == 0 && cin <= kMaxInChannels &&
         rows.size(1) == depthwise_row_width(cin) && grad.is_contiguous() && rows.is_contiguous() &&
         weight.is_contiguous() && aligned16(grad.const_data_ptr()) && aligned16(rows.const_data_ptr()) &&
         grad.size(0) > 0;
}

}  // namespace

std::optional<PointwiseGrads> pointwise_backward_wide(const at::Tensor& grad, const at::Tensor& rows,
                                                      const at::Tensor& weight, const DepthwiseProblem& p) {
  if (p.layout != Layout::NHWC || !wide_kernel_covers(grad, rows, weight, p.C)) return std::nullopt;
  const int C = static_cast<int>(grad.size(1)), cin = static_cast<int>(p.C), row_width = static_cast<int>(rows.size(1));
  // (Whether the depthwise backward runs in one pass depends on the device's shared memory.)
  const c10::cuda::CUDAGuard guard(grad.device());
  const bool over_grad = sole_reference(grad) && depthwise_backward_in_one_pass(p, grad.scalar_type());
  at::Tensor grad_depthwise =
      over_grad ? grad.as_strided({p.N, cin, p.Ho, p.Wo}, {p.Ho * p.Wo * C, 1, p.Wo * C, C}, grad.storage_offset())
                : at::Tensor();
  std::optional<PointwiseGrads> out;
  LUMENBRIDGE_DISPATCH_HALF_TYPES(grad.scalar_type(), "lumenbridge_pointwise_backward_wide", [&] {
    const size_t shared = (C * padded_stride(cin) + kStages * wide_tile_elems(C, row_width)) * sizeof(scalar_t);
    const auto kernel = C == kMaxChannels && cin == kMaxInChannels ? pointwise_backward_wide_kernel<scalar_t, true>
                                                                   : pointwise_backward_wide_kernel<scalar_t, false>;
    out = launch_one_pass<scalar_t>(kernel, kWideThreads, shared, kWideBlocks,
                                    WideWidths{row_width, over_grad ? C : cin}, at::MemoryFormat::ChannelsLast,
                                    std::move(grad_depthwise), grad, rows, weight, p);
  });
  return out;
}

}  // namespace cuda
}  // namespace lumenbridge

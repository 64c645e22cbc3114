// Both gradients of an NHWC stride-2 depthwise convolution whose input is
// x = act(pre), as the composed backward needs them for every stage after
// the first: the gradient of pre and the weight and bias gradients, in one
// pass over pre and grad_output (the two kernels of depthwise_backward_input.cu
// and depthwise_backward_weight.cu each read both).
//
// A tile is 8 x 8 quads of one image and a 32-channel slab: the 16 x 16 input
// pixels the quads cover. Its shared window holds grad_output over the quads'
// reach and pre at the quads' pixels. The weight gradient is gathered the
// way the input gradient is: each (input pixel, tap, output) triple the input
// gradient visits adds w[tap] g[output] to the pixel's gradient and
// x[pixel] g[output] to the tap's sum, and every (output, tap) pair whose
// pixel lies in the image is one such triple (pixels outside it hold x = 0:
// zero fill, act(0) = 0). So each thread computes x = act(pre) and the slope
// at its own pixels only: no halo, no activation pass over the window (x in
// registers; the slope at the scaling, or, in bf16 with GELU where pre comes
// from the rows, with x, kept in the pixel's own slot: keep_slopes). The
// bias sums each output once, at the centre tap (pixel 2a, 2b). The taps
// come from shared memory, so that registers hold the sums across tiles.
// The weight sums are deterministic as depthwise_backward_weight.cu's: each
// block takes a fixed run of tiles (weight_partials.cuh) and pass 2 sums the
// blocks in a fixed order (partial_sums.cuh).
//
// Where pre comes from a narrow stage's rows (FROM_ROWS), that stage's
// pointwise backward can run here too (FOLD), on the tensor cores, from the
// gradient of pre g as the threads hold it (rounded to T, as it would be
// stored), so g, the presets' largest gradient (112 x 112 x 96), never
// reaches device memory:
//   g_d[m, j] = sum_c g[m, c] W[c, j]    j < cin, each slab's share in float
//   sum_m g[m, c] rows[m, j]             j <= cin: the weight, then the bias
//                                         (the rows' ones column)
// Each thread leaves its g in its own shared slots (where the slope waited
// for the stores), and each warp, with no barrier, reads the 32
// pixels its threads hold as rows of a matrix G [pixels, 32 channels]
// (fold_warp). The weight sums follow the depthwise ones: per block in
// registers, then the fixed-order pass 2.
#include <c10/cuda/CUDAGuard.h>

#include <limits>
#include <numeric>

#include "../activated_depthwise.h"
#include "../tokenize.h"
#include "common.cuh"
#include "fused_parts.cuh"
#include "nhwc_tiles.cuh"
#include "partial_sums.cuh"
#include "quad_tiles.cuh"
#include "weight_partials.cuh"

namespace lumenbridge {
namespace cuda {
namespace {

// Where FROM_ROWS, pre is not read but computed: pre = rows[:, :terms]
// pointwise^T at each pixel, from the previous stage's depthwise rows (its
// pointwise GEMM's operand, kRowWidth wide) and its pointwise weight and bias
// (`terms` <= kRowTerms columns). So a stage whose input comes from a narrow
// stage (the images' 3 channels) never needs that input in device memory.
constexpr int kRowWidth = static_cast<int>(kRowAlignment), kRowTerms = static_cast<int>(kNarrowRowTerms);

template <typename T, int K, bool FROM_ROWS>
struct BothGradientsTile : NhwcLanes {
  using Reach = QuadReach<K>;
  static constexpr int kOutW = 8, kOutH = 8;  // quads per tile (weight_partials.cuh's split; outputs too)
  static constexpr int kRows = 2;             // quad rows per thread
  static constexpr int kThreads = kChannelThreads * kOutW * (kOutH / kRows);
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kSums = K * K + 1;  // taps, then the bias
  using Grad = PixelWindow<kOutH + Reach::kSpan, kOutW + Reach::kSpan, 1, kSlab>;
  // The quads' own pixels (pre's slab, or the rows), columns de-interleaved
  // by two: threads a quad apart read adjacent pixels.
  using Pre = PixelWindow<2 * kOutH, 2 * kOutW, 2, FROM_ROWS ? kRowWidth : kSlab>;
  static constexpr int kPreAt = Grad::kElems, kElems = kPreAt + Pre::kElems;
  // Where FROM_ROWS in half types, pre is computed on the tensor cores
  // (pre_on_tensor_cores); in float by FMAs from the terms in float.
  static constexpr bool kPreOnTensorCores = FROM_ROWS && sizeof(T) == 2;
  static constexpr int kStages = pipeline_stages(kElems * sizeof(T));
  static constexpr size_t kPipelineBytes = kStages * kElems * sizeof(T);
  // The sums go through the tile buffers once the pipeline is done.
  static constexpr size_t kReduceBytes = sizeof(float) * kWarps * kSums * kSlab;
  static constexpr size_t kSharedBytes = kPipelineBytes > kReduceBytes ? kPipelineBytes : kReduceBytes;
  // Beside the dynamic buffers: the taps in float, and where FROM_ROWS the
  // pointwise terms (each lane's B operand in half types, pre_terms; in
  // float, the terms), each thread's own slots at its pixels (pre,
  // computed before the visit; bf16 with GELU, its slopes; then, in the FOLD
  // instances, the gradient;
  // after the pipeline, the fold's block sums)
  // and, for the fold in half types, g_d's B operand (fold_weights) and the
  // threads' fold constants (fold_lanes).
  static constexpr size_t kTapBytes = sizeof(float) * K * K * kSlab;
  static constexpr size_t kFromRowsBytes =
      FROM_ROWS ? (kPreOnTensorCores ? sizeof(uint4) * 32 : sizeof(float) * kSlab * kRowTerms) +
                      sizeof(T) * 4 * kRows * kLane * kThreads
                : 0;
  static constexpr size_t kFoldBytes = FROM_ROWS && sizeof(T) == 2 ? sizeof(uint4) * (32 + kThreads) : 0;
  static constexpr size_t kBlockBytes = kSharedBytes + kTapBytes + kFromRowsBytes + kFoldBytes;
  // Where a thread's K * K + 1 sums of four channels would not fit in
  // registers beside the input gradient's work (K = 7: 200), or the window
  // not in an sm_90 block, the two kernels run instead; so they do on a
  // device with less shared memory a block (activated_depthwise_backward).
  static constexpr bool kCovered = kBlockBytes <= static_cast<size_t>(kMaxSharedBytes) && K <= 5;
  // Two blocks an SM (128 registers) in half types at K = 3; fp32's values
  // and K = 5's 26 sums of four channels need more.
  // (A function: a constant that K = 7's uninstantiated kernel never reads draws a warning.)
  static constexpr int min_blocks() { return K == 3 && sizeof(T) == 2 ? 2 : 1; }
};

// x = act(pre) at one pixel, this thread's L channels, as the forward's
// kernels take it: bf16 and fp16 in the packed form (activate_packed), float in
// ATen's form. (keep_slopes computes x in float instead.)
template <typename T, int L>
__device__ __forceinline__ void activate_pixel(const Vec<T, L>& pre, const InputActivation& act, float (&x)[L]) {
  if constexpr (std::is_same_v<T, float>) {
    dispatch_activation(act.kind, [&](auto a) {
#pragma unroll
      for (int e = 0; e < L; ++e) x[e] = activation_value<decltype(a)::value>(pre.v[e]);
    });
  } else {
    static_assert(L % 2 == 0, "the packed activation takes pairs");
    const auto* pairs = reinterpret_cast<const uint32_t*>(pre.v);
#pragma unroll
    for (int h = 0; h < L / 2; ++h) {
      const float2 a = unpack2<T>(act.kind == Activation::NONE ? pairs[h] : activate_packed<T>(pairs[h], act.form));
      x[2 * h] = a.x;
      x[2 * h + 1] = a.y;
    }
  }
}

// Where pre comes from: pre itself ([N, H, W, C]), or (FROM_ROWS) the rows
// ([N * H * W, kRowWidth]) and the pointwise terms ([C, terms]).
template <typename T>
struct PreSource {
  const T* values;
  int chunk;  // chunk_width of values
  const T* pointwise;
  int terms;
};

// Where FOLD writes the narrow stage's pointwise backward.
struct FoldTarget {
  float* grad_depthwise;  // [slabs, N, cin, H, W]: each slab's share of g_d
  int64_t images;         // N
  float* partials;        // [C, chunks, cin + 1]: the weight sums, then the bias's
  int cin;
};

// FROM_ROWS in half types: pre at the 32 pixels a warp's threads own (both
// quad rows), 32 channels, on the tensor cores, into the owners' own slots:
// per 16 pixels and 8 channels one m16n8k8, A = the pixels' rows (kRowWidth
// = k: the terms, then zeros) and B = the terms (pre_terms), pre = A B
// rounded to T. A's row 8 j + r (matrix j of ldmatrix_x4, lane 8 j + r's
// address `rows_lane`) is the warp's pixel p = 4 (j / 2) + 2 (j % 2) + r / 4
// of its thread column r % 4; B's column n of block nb is channel
// 4 (4 (nb / 2) + n / 2) + 2 (nb % 2) + n % 2, so blocks 2k and 2k + 1 give
// a lane (g, t) the four channels of lane_c = 4k + t at rows g and g + 8,
// one 8-byte store each. The caller syncs the warp before (the slots'
// last readers) and after.
template <typename T, int THREADS, int L, int SLOTS>
__device__ __forceinline__ void pre_on_tensor_cores(const T* rows_lane, const uint4& terms,
                                                    Vec<T, L> (&own_slots)[SLOTS][THREADS], int tid) {
  static_assert(L == 4 && kRowWidth == 8 && SLOTS == 8, "one m16n8k8 per 16 of the warp's 32 pixels, 8 channels");
  uint32_t a[4];
  fused::ldmatrix_x4(a, rows_lane);
  const uint32_t b[4] = {terms.x, terms.y, terms.z, terms.w};
  const int lane = tid % 32, g = lane / 4, t = lane % 4, warp_first = tid - lane;
#pragma unroll
  for (int block = 0; block < 2; ++block) {
    const uint32_t rows[2] = {a[2 * block], a[2 * block + 1]};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      float low[4] = {}, high[4] = {};  // channels 0, 1 and 2, 3 of lane_c = 4k + t
      fused::mma_1688<T>(low, rows, b[2 * k]);
      fused::mma_1688<T>(high, rows, b[2 * k + 1]);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float pre[4] = {low[2 * half], low[2 * half + 1], high[2 * half], high[2 * half + 1]};
        own_slots[4 * block + 2 * half + g / 4][warp_first + 8 * (g % 4) + 4 * k + t] = from_floats<T, 4>(pre);
      }
    }
  }
}

// One warp's share of a tile's narrow-stage pointwise backward (FOLD): the
// 32 pixels whose gradients its own threads hold, as G's rows 0 .. 31 in
// two blocks of 16. The lane hands ldmatrix `g_rows` (G, block 0's first
// channels) and `g_cols` (for G^T), blocks G_BLOCK elements apart and the
// next 16 channels G_STEP on, and `rows` its rows entry (block 1 ROWS_BLOCK
// on); its g_d row of block b, half h is pixel (y + 2b + h, x) of an H x W
// plane. `planes` is this lane's first g_d plane (j = 2t) of the tile's
// image and slab, the next one `plane_size` further; `weights` its part of
// g_d's B operand (fold_weights). No barrier: each warp folds its own pixels
// as soon as it has their gradients.
template <typename T, unsigned G_BLOCK, unsigned G_STEP, unsigned ROWS_BLOCK>
__device__ __forceinline__ void fold_warp(const uint4& weights, float (&weight_sums)[2][4], bool first_plane,
                                          bool second_plane, float* planes, unsigned plane_size, const T* g_rows,
                                          const T* g_cols, const T* rows, unsigned y, unsigned x, unsigned H,
                                          unsigned W) {
  const uint32_t w[2][2] = {{weights.x, weights.y}, {weights.z, weights.w}};
#pragma unroll
  for (unsigned block = 0; block < 2; ++block) {
    // g_d: A = G's 16 rows (matrices rows 0-7 / 8-15 by channels 0-7 / 8-15).
    float gd[4] = {};
#pragma unroll
    for (unsigned s = 0; s < 2; ++s) {
      uint32_t a[4];
      fused::ldmatrix_x4(a, g_rows + block * G_BLOCK + s * G_STEP);
      fused::mma_16816<T>(gd, a, w[s][0], w[s][1]);
    }
    // gd[0], gd[1]: this lane's row (half 0), j = 2t, 2t + 1; gd[2], gd[3]: 8 rows on (half 1).
#pragma unroll
    for (unsigned half = 0; half < 2; ++half) {
      const unsigned row = y + 2 * block + half;
      if (row >= H || x >= W) continue;
      const unsigned offset = row * W + x;
      if (first_plane) planes[offset] = gd[2 * half];
      if (second_plane) planes[offset + plane_size] = gd[2 * half + 1];
    }
    // The weight sums: A = G^T (16 channels x these 16 rows), B = the rows.
    uint32_t b[2];
    fused::ldmatrix_x2_trans(b, rows + block * ROWS_BLOCK);
#pragma unroll
    for (unsigned cb = 0; cb < 2; ++cb) {
      uint32_t a[4];
      fused::ldmatrix_x4_trans(a, g_cols + block * G_BLOCK + cb * G_STEP);
      fused::mma_16816<T>(weight_sums[cb], a, b[0], b[1]);
    }
  }
}

// Thread tid's constants in fold_warp, in element offsets: x, y the rows of
// G it hands ldmatrix for G and G^T (block 0, channels 0 .. 15) in own_slots,
// z its rows entry in a tile's rows window, w its g_d pixel's column from
// its warp's first pixel. Warp w's threads 8u + lane_c (u = 4w .. 4w + 3)
// hold its 32 pixels in their own slots: G's row i is slot p = i / 4 of
// u = 4w + i % 4, i.e. quad column u % 8 of quad row R (u / 8) + p / 4 and
// pixel (p / 2 % 2, p % 2) of that quad.
template <typename Tile, typename Pre>
__device__ uint4 fold_lane(unsigned tid) {
  constexpr unsigned L = Tile::kLane, R = Tile::kRows;
  const unsigned lane = tid % 32, u0 = 4 * (tid / 32), matrix = lane / 8, matrix_row = lane % 8;
  const auto g_row = [&](unsigned i, unsigned k) { return ((i / 4) * Tile::kThreads + 8 * (u0 + i % 4) + 2 * k) * L; };
  const unsigned i = lane % 16, p = i / 4;  // the rows entry's row of G
  const unsigned row = 2 * (R * (u0 / Tile::kOutW) + p / 4) + p / 2 % 2;
  const unsigned column = Pre::column(2 * (u0 % Tile::kOutW + i % 4) + p % 2);
  const unsigned g = lane / 4;  // g_d's row of G: g (half 0); pixel column 2 (g % 4) + g / 4 of the warp's
  return make_uint4(g_row((matrix % 2) * 8 + matrix_row, matrix / 2), g_row((matrix / 2) * 8 + matrix_row, matrix % 2),
                    (row * Pre::kRowPixels + column) * Pre::kSlab, 2 * (g % 4) + g / 4);
}

// A block's pointwise weight sums (FOLD) as its partials: the warps' mma
// accumulators (weight_sums[cb][i]: channel 16 cb + g + 8 (i / 2), term
// 2t + i % 2) summed over the warps in a fixed order through `scratch`
// (kWarps * 256 floats).
template <int WARPS>
__device__ __forceinline__ void store_fold_partials(const float (&weight_sums)[2][4], float* scratch, int tid,
                                                    int c0, int C, int chunk, int chunks, const FoldTarget& fold) {
  const int warp = tid / 32, lane = tid % 32;
#pragma unroll
  for (int k = 0; k < 8; ++k) scratch[(warp * 8 + k) * 32 + lane] = weight_sums[k / 4][k % 4];
  __syncthreads();
  for (int k = tid; k < 8 * 32; k += WARPS * 32) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total += scratch[w * 8 * 32 + k];
    const int at = k / 32, owner = k % 32, cb = at / 4, i = at % 4;
    const int c = c0 + 16 * cb + owner / 4 + 8 * (i / 2), j = 2 * (owner % 4) + i % 2;
    if (j <= fold.cin && c < C) fold.partials[(static_cast<int64_t>(c) * chunks + chunk) * (fold.cin + 1) + j] = total;
  }
}

// FOLD (with FROM_ROWS, half types): the narrow stage's pointwise backward
// into `fold`, instead of the gradient of pre into grad_input. grad_output's
// pixels lie grad_pitch >= C elements apart (pixel_pitch).
template <typename T, int K, bool FROM_ROWS, bool FOLD>
__global__ void __launch_bounds__(BothGradientsTile<T, K, FROM_ROWS>::kThreads,
                                  BothGradientsTile<T, K, FROM_ROWS>::min_blocks())
    depthwise_backward_both_s2_nhwc_kernel(const T* __restrict__ grad_output, const T* __restrict__ weight,
                                           PreSource<T> source, T* grad_input,  // may be source.values
                                           float* __restrict__ partials, FoldTarget fold,
                                           InputActivation activation, int C, int H, int W,
                                           int Ho, int Wo, int grad_pitch, int grad_chunk, bool vector_stores,
                                           TileSpace<3> space,
                                           int items, int tiles_per_block, int chunks) {
  static_assert(!FOLD || (FROM_ROWS && !std::is_same_v<T, float>), "the fold reads the rows on the tensor cores");
  using Tile = BothGradientsTile<T, K, FROM_ROWS>;
  using Grad = typename Tile::Grad;
  using Pre = typename Tile::Pre;
  using Reach = typename Tile::Reach;
  constexpr int L = Tile::kLane, R = Tile::kRows, kSums = Tile::kSums;
  constexpr int kCentre = (K / 2) * K + K / 2;  // the tap that takes pixel (2a, 2b) from output (a, b)
  // Two chunks' addresses at a time in half types (ptxas puts its three
  // spacer instructions before each group of cp.async, not each copy); one
  // in float, whose K = 5 kernels spill more with two.
  constexpr int kLoadUnroll = sizeof(T) == 2 ? 2 : 1;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  __shared__ __align__(16) float taps[K * K][Tile::kSlab];
  __shared__ __align__(16) float pointwise[FROM_ROWS && !Tile::kPreOnTensorCores ? Tile::kSlab : 1][kRowTerms];
  // kPreOnTensorCores: each lane's B operand in pre_on_tensor_cores, blocks
  // nb = 0 .. 3 (lane 4g + t: channel 4 (4 (nb / 2) + g / 2) + 2 (nb % 2) +
  // g % 2, terms 2t and 2t + 1; zero past the terms or C).
  __shared__ __align__(16) uint4 pre_terms[Tile::kPreOnTensorCores ? 32 : 1];
  __shared__ __align__(16) Vec<T, L> own_slots[FROM_ROWS ? 4 * R : 1][FROM_ROWS ? Tile::kThreads : 1];
  // FOLD: each lane's part of g_d's B operand, W[c][j] at k = c, n = j (per
  // 16 channels s, rows 2t, 2t + 1 then 2t + 8, 2t + 9 of column g; zero for
  // j >= cin or c >= C).
  __shared__ __align__(16) uint4 fold_weights[FOLD ? 32 : 1];
  // FOLD: each thread's constants in fold_warp (fold_lane), read once a tile
  // (at the kernel's 128 registers, ptxas would rebuild them every tile).
  __shared__ __align__(16) uint4 fold_lanes[FOLD ? Tile::kThreads : 1];
  T* const buffers = reinterpret_cast<T*>(shared_bytes);
  const int tid = threadIdx.x;
  const int lane_c = tid % Tile::kChannelThreads;
  const int column = (tid / Tile::kChannelThreads) % Tile::kOutW;
  const int row0 = tid / (Tile::kChannelThreads * Tile::kOutW) * R;
  const int chunk = blockIdx.x;
  const int c0 = static_cast<int>(blockIdx.y) * Tile::kSlab;
  const int c = c0 + lane_c * L;

  // The slab's taps, published by the pipeline's first barrier.
  for (int k = tid; k < K * K * Tile::kSlab; k += Tile::kThreads) {
    const int i = k / Tile::kSlab, ch = k % Tile::kSlab;
    taps[i][ch] = c0 + ch < C ? static_cast<float>(weight[(c0 + ch) * K * K + i]) : 0.0f;
  }
  if constexpr (FROM_ROWS) {
    // The pointwise terms W[c][j] (zero past the terms or C).
    const auto term = [&](int ch, int j) {
      return c0 + ch < C && j < source.terms ? static_cast<float>(source.pointwise[(c0 + ch) * source.terms + j])
                                             : 0.0f;
    };
    if constexpr (Tile::kPreOnTensorCores) {
      if (tid < 32) {
        const int g = tid / 4, t = tid % 4;
        uint32_t b[4];
#pragma unroll
        for (int nb = 0; nb < 4; ++nb) {
          const int ch = 4 * (4 * (nb / 2) + g / 2) + 2 * (nb % 2) + g % 2;
          b[nb] = pack2<T>(term(ch, 2 * t), term(ch, 2 * t + 1));
        }
        pre_terms[tid] = make_uint4(b[0], b[1], b[2], b[3]);
      }
    } else {
      for (int k = tid; k < Tile::kSlab * kRowTerms; k += Tile::kThreads) {
        pointwise[k / kRowTerms][k % kRowTerms] = term(k / kRowTerms, k % kRowTerms);
      }
    }
  }
  // kPreOnTensorCores: this lane's row of A in pre_on_tensor_cores, an element
  // offset in a tile: pixel (r / 4) of quad (row0 + j / 2, its warp's thread
  // column r % 4), row j % 2 of the quad (j = lane / 8, r = lane % 8).
  static_assert(!Tile::kPreOnTensorCores || (32 % Tile::kChannelThreads == 0 && Tile::kOutW % 4 == 0),
                "a warp's threads are 4 thread columns of one row of quads");
  int rows_lane = 0;
  if constexpr (Tile::kPreOnTensorCores) {
    const int lane = tid % 32, j = lane / 8, r = lane % 8;
    const int owner_column = ((tid - lane) / Tile::kChannelThreads + r % 4) % Tile::kOutW;
    rows_lane = Tile::kPreAt +
                ((2 * (row0 + j / 2) + j % 2) * Pre::kRowPixels + Pre::column(2 * owner_column + r / 4)) * Pre::kSlab;
  }

  if constexpr (FOLD) {
    fold_lanes[tid] = fold_lane<Tile, Pre>(tid);  // read back by this thread alone
    if (tid < 32) {
      const int g = tid / 4, t = tid % 4;
      const auto w_at = [&](int ch) {
        return c0 + ch < C && g < fold.cin ? static_cast<float>(source.pointwise[(c0 + ch) * source.terms + g]) : 0.0f;
      };
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = pack2<T>(w_at(8 * i + 2 * t), w_at(8 * i + 2 * t + 1));
      fold_weights[tid] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }

  // Digits: tile column, tile row, image.
  auto load = [&](T* tile, const TileCursor<3>& t) {
    const int64_t image = t.digit[2];
    const int y0 = t.digit[1] * Tile::kOutH, x0 = t.digit[0] * Tile::kOutW;
    dispatch_chunk<T>(grad_chunk, [&](auto width) {
      load_pixel_window<Grad, Tile::kThreads, decltype(width)::value, kLoadUnroll>(
          tile, grad_output + image * Ho * Wo * grad_pitch, Ho, Wo, C, grad_pitch, y0 + Reach::kMin, x0 + Reach::kMin,
          c0, tid);
    });
    dispatch_chunk<T>(source.chunk, [&](auto width) {
      constexpr int kWidth = decltype(width)::value;
      if constexpr (FROM_ROWS) {
        load_pixel_window<Pre, Tile::kThreads, kWidth, kLoadUnroll>(
            tile + Tile::kPreAt, source.values + image * H * W * kRowWidth, H, W, kRowWidth, 2 * y0, 2 * x0, 0, tid);
      } else {
        load_pixel_window<Pre, Tile::kThreads, kWidth, kLoadUnroll>(
            tile + Tile::kPreAt, source.values + image * H * W * C, H, W, C, 2 * y0, 2 * x0, c0, tid);
      }
    });
  };

  float sums[kSums][L] = {};
  float fold_sums[FOLD ? 2 : 1][4] = {};
  auto compute = [&](T* tile, const TileCursor<3>& t) {
    const auto window_pixel = [&](int la, int py, int px) {
      return tile + Tile::kPreAt + ((2 * la + py) * Pre::kRowPixels + Pre::column(2 * column + px)) * Pre::kSlab;
    };
    // pre at this thread's pixels, both quad rows before either, rounded to
    // T as the GEMM that would have written pre rounds it. Zero rows (pixels
    // past the image) give pre = 0: x = act(0) = 0.
    if constexpr (Tile::kPreOnTensorCores) {
      __syncwarp();  // the slots' last readers, the warp's threads (the passes, the fold), are done
      pre_on_tensor_cores<T, Tile::kThreads, L, 4 * R>(tile + rows_lane, pre_terms[tid % 32], own_slots, tid);
      __syncwarp();  // each thread's pre is in its slots
    } else if constexpr (FROM_ROWS) {
      // (The terms are live here only.)
      float w[L][kRowTerms];
#pragma unroll
      for (int e = 0; e < L; ++e) {
        const Vec<float, kRowTerms> terms = load_vec<float, kRowTerms>(pointwise[lane_c * L + e]);
#pragma unroll
        for (int j = 0; j < kRowTerms; ++j) w[e][j] = terms.v[j];
      }
#pragma unroll 4
      for (int p = 0; p < 4 * R; ++p) {
        float row[kRowTerms];
        to_floats(load_vec<T, kRowTerms>(window_pixel(row0 + p / 4, p / 2 % 2, p % 2)), row);
        float value[L];
#pragma unroll
        for (int e = 0; e < L; ++e) {
          value[e] = 0.0f;
#pragma unroll
          for (int j = 0; j < kRowTerms; ++j) value[e] = fmaf(w[e][j], row[j], value[e]);
        }
        own_slots[p][tid] = from_floats<T, L>(value);
      }
    }
    // A row at a time: unrolled, both rows' pixels stay live and the sums spill.
#pragma unroll 1
    for (int q = 0; q < R; ++q) {
      const int la = row0 + q;
      // This thread's pre at a pixel (where the slopes are kept, from x to the
      // scaling, the slopes; with FOLD, after the scaling, the gradient).
      const auto own_slot = [&](int py, int px) -> Vec<T, L>& {
        if constexpr (FROM_ROWS) {
          return own_slots[4 * q + 2 * py + px][tid];
        } else {
          return *reinterpret_cast<Vec<T, L>*>(window_pixel(la, py, px) + lane_c * L);
        }
      };
      // Its value, by copy (through the reference the compiler orders the loads differently).
      const auto pre_at = [&](int py, int px) { return own_slot(py, px); };
      // bf16 with GELU where pre comes from the rows, x and the slopes at
      // once (keep_slopes); else x packed here and the slope at the scaling.
      // (Where pre is read, the kept slopes measured slower at stage 3,
      // +24 us, than they gained at stage 4, -14: benchmarks/NOTES.md.)
      constexpr bool kKeepsSlopes = keeps_slopes<T> && FROM_ROWS;
      const bool kept = kKeepsSlopes && activation.kind == Activation::GELU;
      float x[2][2][L];
#pragma unroll
      for (int py = 0; py < 2; ++py) {
#pragma unroll
        for (int px = 0; px < 2; ++px) {
          if constexpr (kKeepsSlopes) {
            if (kept) {
              keep_slopes<T, L>(own_slot(py, px), x[py][px]);
              continue;
            }
          }
          activate_pixel<T, L>(pre_at(py, px), activation, x[py][px]);
        }
      }
      float acc[2][2][L] = {};
      visit_quad<T, K, L, Grad::kRowPixels, Tile::kSlab>(
          tile + (la * Grad::kRowPixels + column) * Tile::kSlab + lane_c * L,
          [&](int py, int px, int tap, const float(&g)[L]) {
            const Vec<float, L> w = load_vec<float, L>(&taps[tap][lane_c * L]);
#pragma unroll
            for (int e = 0; e < L; ++e) {
              acc[py][px][e] = fmaf(w.v[e], g[e], acc[py][px][e]);
              sums[tap][e] = fmaf(x[py][px][e], g[e], sums[tap][e]);
              if (py == 0 && px == 0 && tap == kCentre) sums[K * K][e] += g[e];
            }
          });
      // The gradient of pre at a pixel: acc times the slope.
      const auto scaled = [&](int py, int px) {
        if constexpr (kKeepsSlopes) {
          if (kept) return scaled_by_kept_slopes<T, L>(acc[py][px], own_slot(py, px));
        }
        return slope_scaled<T, L>(acc[py][px], pre_at(py, px), activation.kind);
      };
      const int y = 2 * (t.digit[1] * Tile::kOutH + la), xs = 2 * (t.digit[0] * Tile::kOutW + column);
      if constexpr (FOLD) {
        // g into this thread's own slots (zero past the image) for fold_warp.
#pragma unroll
        for (int py = 0; py < 2; ++py) {
#pragma unroll
          for (int px = 0; px < 2; ++px) {
            const bool inside = y + py < H && xs + px < W;
            const Vec<T, L> g = scaled(py, px);
            own_slot(py, px) = inside ? g : zero_vec<T, L>();
          }
        }
      } else {
        T* const image = grad_input + static_cast<int64_t>(t.digit[2]) * H * W * C + c;
        if constexpr (kKeepsSlopes) {
          // store_quad's scaling, by `scaled` (store_quad itself keeps the
          // other instances' SASS as it was: benchmarks/NOTES.md, step 106b).
          Vec<T, L> g[2][2];
#pragma unroll
          for (int py = 0; py < 2; ++py) {
#pragma unroll
            for (int px = 0; px < 2; ++px) g[py][px] = scaled(py, px);
          }
          store_quad_values<T, L>(g, image, y, xs, H, W, C, c, vector_stores);
        } else {
          store_quad<true, T, L>(acc, image, y, xs, H, W, C, c, vector_stores, activation.kind, pre_at);
        }
      }
    }
    if constexpr (FOLD) {
      __syncwarp();  // the warp's gradients are in its threads' own slots
      const unsigned plane_size = static_cast<unsigned>(H) * static_cast<unsigned>(W);
      const uint4 mine = fold_lanes[tid];  // fold_lane's constants
      const unsigned first = 2 * (tid % 4);  // this lane's g_d planes: first, first + 1
      // (Lanes with none past cin point at the last plane, never stored to.)
      const unsigned first_within = min(first, static_cast<unsigned>(fold.cin - 1));
      float* planes = fold.grad_depthwise +
                      (static_cast<int64_t>(blockIdx.y) * fold.images + t.digit[2]) * fold.cin * plane_size +
                      static_cast<int64_t>(first_within) * plane_size;
      // Once a tile: left to itself the compiler recomputes this 64-bit
      // address inside each store's branch (about 20 instructions a store).
      asm volatile("" : "+l"(planes));
      // The warp's first pixel: quad column 4 (w % 2), quad row R (w / 2).
      const unsigned warp = tid / 32;
      const unsigned y0 = 2 * (t.digit[1] * Tile::kOutH + R * (warp / 2));
      const unsigned x0 = 2 * (t.digit[0] * Tile::kOutW + 4 * (warp % 2));
      constexpr unsigned kGBlock = 4 * Tile::kThreads * L, kGStep = 4 * L;
      constexpr unsigned kRowsBlock = 2 * Pre::kRowPixels * Pre::kSlab;
      fold_warp<T, kGBlock, kGStep, kRowsBlock>(
          fold_weights[tid % 32], fold_sums, static_cast<int>(first) < fold.cin,
          static_cast<int>(first) + 1 < fold.cin, planes, plane_size, own_slots[0][0].v + mine.x,
          own_slots[0][0].v + mine.y, tile + Tile::kPreAt + mine.z, y0, x0 + mine.w, static_cast<unsigned>(H),
          static_cast<unsigned>(W));
    }
  };

  const int first = chunk * tiles_per_block;  // items fits an int (split_work)
  run_tile_pipeline<Tile::kStages>(space, first, min(tiles_per_block, items - first), buffers, Tile::kElems, load,
                                   NoStep{}, NoStep{}, compute);
  cp_async_wait_pending<0>();
  __syncthreads();
  store_slab_partials<Tile::kWarps>(sums, reinterpret_cast<float*>(shared_bytes), tid, c0, C, chunk, chunks,
                                    partials, [] { __syncthreads(); });
  if constexpr (FOLD) {
    static_assert(sizeof(own_slots) >= sizeof(float) * Tile::kWarps * 8 * 32, "the fold's block sums fit own_slots");
    store_fold_partials<Tile::kWarps>(fold_sums, reinterpret_cast<float*>(own_slots), tid, c0, C, chunk, chunks, fold);
  }
}

// g_d from the slabs' shares [slabs, count]: their sum in slab order,
// rounded to T as a GEMM's output; four elements a thread, 16-byte loads
// where count allows.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    sum_slab_shares_kernel(const float* __restrict__ shares, int64_t count, int slabs, T* __restrict__ out) {
  const int64_t i = 4 * (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x);
  if (i >= count) return;
  if (count % 4 == 0) {
    float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < slabs; ++s) {
      const float4 v = *reinterpret_cast<const float4*>(shares + s * count + i);
      total = make_float4(total.x + v.x, total.y + v.y, total.z + v.z, total.w + v.w);
    }
    const float sums[4] = {total.x, total.y, total.z, total.w};
    store_vec<T, 4>(out + i, from_floats<T, 4>(sums));
    return;
  }
  for (int64_t k = i; k < i + 4 && k < count; ++k) {
    float total = 0.0f;
    for (int s = 0; s < slabs; ++s) total += shares[s * count + k];
    out[k] = static_cast<T>(total);
  }
}

// The distance between a channels-last [N, C, H, W] tensor's pixels: C where
// it is dense, more where the wide pointwise kernel wrote it over its own
// input (pointwise_backward_wide.cu).
int64_t pixel_pitch(const at::Tensor& t) {
  if (t.is_contiguous(at::MemoryFormat::ChannelsLast)) return t.size(1);
  const int64_t pitch = t.stride(3);
  TORCH_INTERNAL_ASSERT(t.stride(1) == 1 && pitch >= t.size(1) && pitch <= std::numeric_limits<int32_t>::max() &&
                            t.stride(2) == t.size(3) * pitch && t.stride(0) == t.size(2) * t.size(3) * pitch,
                        "a channels-last tensor with its pixels a fixed pitch apart");
  return pitch;
}

template <typename T, int K, bool FROM_ROWS>
void launch_both(const at::Tensor& grad_output, const at::Tensor& weight, const PreSource<T>& source,
                 Activation activation, T* grad_input, float* partials, const FoldTarget& fold,
                 const WorkSplit& split, int64_t slabs, const DepthwiseProblem& p, cudaStream_t stream) {
  using Tile = BothGradientsTile<T, K, FROM_ROWS>;
  constexpr bool kFoldable = FROM_ROWS && !std::is_same_v<T, float>;
  const auto kernel = fold.partials != nullptr ? depthwise_backward_both_s2_nhwc_kernel<T, K, FROM_ROWS, kFoldable>
                                               : depthwise_backward_both_s2_nhwc_kernel<T, K, FROM_ROWS, false>;
  allow_shared_bytes(kernel, Tile::kSharedBytes);
  const TileSpace<3> space = tile_space<3>({split.tiles_x, split.tiles_y, p.N}, 1);
  const bool vector_stores = grad_input != nullptr && vector_width<T>(Tile::kLane, p.C, {grad_input}) == Tile::kLane;
  const int64_t pitch = pixel_pitch(grad_output);
  kernel<<<dim3(grid_x(split.chunks), grid_y(slabs, "channel slabs")), Tile::kThreads, Tile::kSharedBytes,
           stream>>>(grad_output.const_data_ptr<T>(), weight.const_data_ptr<T>(), source, grad_input, partials, fold,
                     InputActivation{activation, activation_form<T>(activation)}, static_cast<int>(p.C),
                     static_cast<int>(p.H),
                     static_cast<int>(p.W), static_cast<int>(p.Ho), static_cast<int>(p.Wo), static_cast<int>(pitch),
                     chunk_width<T>(std::gcd(p.C, pitch), grad_output.const_data_ptr()), vector_stores, space,
                     static_cast<int>(split.items), split.tiles_per_block, static_cast<int>(split.chunks));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// What one pass returns: the depthwise gradients (grad_input undefined where
// the pass folds), and where it folds, the narrow stage's pointwise ones.
struct OnePassGrads {
  at::Tensor grad_input, grad_weight, grad_bias;
  PointwiseGrads folded;
};

// Whether the kernel covers problem p in `dtype`, pre read as values
// (FROM_ROWS: computed from rows) on the current device.
template <bool FROM_ROWS>
bool covers(const DepthwiseProblem& p, at::ScalarType dtype) {
  if (p.stride != 2 || p.layout != Layout::NHWC || p.N * p.H * p.W * p.C == 0) return false;
  bool covered = false;
  LUMENBRIDGE_DISPATCH_CUDA_TYPES(dtype, "lumenbridge_depthwise_backward_both", [&] {
    dispatch_kernel_size(p.K, [&](auto k) {
      using Tile = BothGradientsTile<scalar_t, decltype(k)::value, FROM_ROWS>;
      if constexpr (Tile::kCovered) covered = Tile::kBlockBytes <= max_shared_bytes_per_block();
    });
  });
  return covered;
}

// The fold's output g_d [N, cin, H, W] (contiguous) over the memory of
// grad_output, which it has read by then, where nothing else holds that
// memory and it is large enough; else new. (That memory then stays held
// until g_d is released: at lumenbridge-base's sizes below the fold's own
// peak.)
at::Tensor fold_output(const at::Tensor& grad_output, int64_t cin, const DepthwiseProblem& p) {
  const std::vector<int64_t> sizes{p.N, cin, p.H, p.W};
  const int64_t count = p.N * cin * p.H * p.W;
  if (!sole_reference(grad_output) ||
      static_cast<size_t>(count) * grad_output.element_size() > grad_output.storage().nbytes()) {
    return new_output(sizes, grad_output.options(), at::MemoryFormat::Contiguous);
  }
  return grad_output.as_strided(sizes, {cin * p.H * p.W, p.H * p.W, p.W, 1}, 0);
}

// Both gradients in one pass where the kernel covers the problem, pre read
// from `values` (FROM_ROWS: computed from the rows `values` and `pointwise`;
// with `fold`, also that narrow stage's pointwise backward, its g_d written
// over grad_output where that is grad_output's only reference; with
// `overwrite_values`, the gradient written over pre); nullopt elsewhere.
template <bool FROM_ROWS>
std::optional<OnePassGrads> one_pass(const at::Tensor& grad_output, const at::Tensor& weight,
                                     const at::Tensor& values, const at::Tensor& pointwise,
                                     const DepthwiseProblem& p, Activation activation, bool fold,
                                     bool overwrite_values = false) {
  if constexpr (!FROM_ROWS) TORCH_INTERNAL_ASSERT(!fold, "the fold reads the rows");
  const c10::cuda::CUDAGuard guard(values.device());
  if (!covers<FROM_ROWS>(p, grad_output.scalar_type())) return std::nullopt;
  // The fold: half types (the tensor cores), an image's g_d planes in 32-bit offsets.
  const int64_t cin = FROM_ROWS ? pointwise.size(1) - 1 : 0;
  if (fold && (grad_output.scalar_type() == at::kFloat || cin * p.H * p.W > std::numeric_limits<int32_t>::max())) {
    return std::nullopt;
  }
  check_extents_fit_int(p);
  TORCH_INTERNAL_ASSERT(grad_output.sizes() == at::IntArrayRef({p.N, p.C, p.Ho, p.Wo}));
  if constexpr (FROM_ROWS) {
    TORCH_INTERNAL_ASSERT(values.sizes() == at::IntArrayRef({p.N * p.H * p.W, kRowWidth}) && values.is_contiguous() &&
                          pointwise.size(0) == p.C && pointwise.is_contiguous());
  } else {
    TORCH_INTERNAL_ASSERT(values.sizes() == at::IntArrayRef({p.N, p.C, p.H, p.W}) &&
                          values.is_contiguous(at::MemoryFormat::ChannelsLast));
  }
  const auto options = grad_output.options();
  std::optional<OnePassGrads> result;
  LUMENBRIDGE_DISPATCH_CUDA_TYPES(grad_output.scalar_type(), "lumenbridge_depthwise_backward_both", [&] {
    using T = scalar_t;
    dispatch_kernel_size(p.K, [&](auto k) {
      constexpr int K = decltype(k)::value;
      using Tile = BothGradientsTile<T, K, FROM_ROWS>;
      if constexpr (Tile::kCovered) {
        OnePassGrads out;
        const int64_t slabs = ceil_div64(p.C, Tile::kSlab);
        const WorkSplit split = split_work<Tile>(p, slabs, kNhwcBlocks);
        at::Tensor partials = at::empty({p.C, split.chunks, Tile::kSums}, options.dtype(at::kFloat));
        FoldTarget target{};
        at::Tensor fold_shares, fold_partials;
        if (fold) {
          target.cin = static_cast<int>(cin);
          target.images = p.N;
          fold_shares = at::empty({slabs, p.N, cin, p.H, p.W}, options.dtype(at::kFloat));
          fold_partials = at::empty({p.C, split.chunks, cin + 1}, options.dtype(at::kFloat));
          target.grad_depthwise = fold_shares.mutable_data_ptr<float>();
          target.partials = fold_partials.mutable_data_ptr<float>();
        } else {
          out.grad_input = !FROM_ROWS && overwrite_values
                               ? values
                               : new_output({p.N, p.C, p.H, p.W}, options, p.memory_format());
        }
        out.grad_weight = new_output({p.C, 1, p.K, p.K}, options, at::MemoryFormat::Contiguous);
        out.grad_bias = new_output({p.C}, options, at::MemoryFormat::Contiguous);
        const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
        const PreSource<T> source{values.const_data_ptr<T>(),
                                  chunk_width<T>(FROM_ROWS ? kRowWidth : p.C, values.const_data_ptr()),
                                  FROM_ROWS ? pointwise.const_data_ptr<T>() : nullptr,
                                  FROM_ROWS ? static_cast<int>(pointwise.size(1)) : 0};
        launch_both<T, K, FROM_ROWS>(grad_output, weight, source, activation,
                                     fold ? nullptr : out.grad_input.mutable_data_ptr<T>(),
                                     partials.mutable_data_ptr<float>(), target, split, slabs, p, stream);
        sum_partials<T>(partials.const_data_ptr<float>(), p.C, split.chunks, Tile::kSums,
                        {out.grad_weight.mutable_data_ptr<T>(), out.grad_bias.mutable_data_ptr<T>(), K * K, 1},
                        stream);
        if (fold) {
          out.folded.weight = new_output({p.C, cin, 1, 1}, options, at::MemoryFormat::Contiguous);
          out.folded.bias = new_output({p.C}, options, at::MemoryFormat::Contiguous);
          sum_partials<T>(fold_partials.const_data_ptr<float>(), p.C, split.chunks, target.cin + 1,
                          {out.folded.weight.mutable_data_ptr<T>(), out.folded.bias.mutable_data_ptr<T>(),
                           target.cin, 1},
                          stream);
          out.folded.grad_depthwise = fold_output(grad_output, cin, p);
          const int64_t count = out.folded.grad_depthwise.numel();
          sum_slab_shares_kernel<T><<<grid_x(ceil_div64(count, 4 * kThreads)), kThreads, 0, stream>>>(
              fold_shares.const_data_ptr<float>(), count, static_cast<int>(slabs),
              out.folded.grad_depthwise.mutable_data_ptr<T>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        result = std::move(out);
      }
    });
  });
  return result;
}

}  // namespace

bool depthwise_backward_in_one_pass(const DepthwiseProblem& p, at::ScalarType dtype) {
  return covers<false>(p, dtype) && covers<true>(p, dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> activated_depthwise_backward(const at::Tensor& grad_output,
                                                                          const at::Tensor& weight, at::Tensor pre,
                                                                          const DepthwiseProblem& p,
                                                                          Activation activation) {
  // Handed pre's only reference (and nothing else sharing its memory), the
  // one-pass kernel writes the gradient over it: each tile reads its own
  // pixels of pre before it writes their gradient, and no tile reads
  // another's (stage 3's p_2 is 308 MB at B = 256 for lumenbridge-base).
  if (auto out = one_pass<false>(grad_output, weight, pre, at::Tensor(), p, activation, false, sole_reference(pre))) {
    return {out->grad_input, out->grad_weight, out->grad_bias};
  }
  return depthwise_backward_in_two_passes(&activated_depthwise_backward_input, &activated_depthwise_backward_weight,
                                          grad_output, weight, pre, p, activation);
}

namespace {
// Whether the one-pass kernel can read pre from these rows and terms.
bool rows_readable(const at::Tensor& rows, const at::Tensor& pointwise) {
  return rows.size(1) == kRowWidth && pointwise.size(1) <= kRowTerms;
}
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> activated_depthwise_backward_from_rows(
    const at::Tensor& grad_output, const at::Tensor& weight, const at::Tensor& rows, const at::Tensor& pointwise,
    const DepthwiseProblem& p, Activation activation) {
  if (rows_readable(rows, pointwise)) {
    if (auto out = one_pass<true>(grad_output, weight, rows, pointwise, p, activation, false)) {
      return {out->grad_input, out->grad_weight, out->grad_bias};
    }
  }
  return activated_depthwise_backward(grad_output, weight, pre_from_rows(rows, pointwise, p), p, activation);
}

std::optional<FoldedGrads> activated_depthwise_backward_folding_pointwise(const at::Tensor& grad_output,
                                                                           const at::Tensor& weight,
                                                                           const at::Tensor& rows,
                                                                           const at::Tensor& pointwise,
                                                                           const DepthwiseProblem& p,
                                                                           Activation activation) {
  if (!rows_readable(rows, pointwise)) return std::nullopt;
  auto out = one_pass<true>(grad_output, weight, rows, pointwise, p, activation, true);
  if (!out) return std::nullopt;
  return FoldedGrads{out->grad_weight, out->grad_bias, std::move(out->folded)};
}

}  // namespace cuda
}  // namespace lumenbridge

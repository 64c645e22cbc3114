// Parts of the fused stage kernels (tokenize_fused.cu): tensor-core GEMM of a
// block's depthwise tile with the pointwise weight, the epilogue that writes a
// tile of stage outputs or tokens, and the small device helpers they share.
//
// A block owns kTileRows (64) output pixels. Its depthwise results, A [64 x Kp] in
// the compute dtype, live in shared memory only; each warp multiplies all 64
// rows by its own columns of the pointwise weight, read straight from the
// nn-layout [Cout, Cin] tensor (it stays in L2) with one 16-byte load per lane
// per 32 input channels. That load holds 8 consecutive input channels, so A's
// columns are stored permuted to match (store_a8); no packed copy of the
// weights exists anywhere. Where a launch's tiles would leave much of a
// wave of blocks idle (small batches: tokenize_fused.cu says when), a tile's
// output columns are split between `parts` blocks (TileOutput::parts), each
// computing its share of the GEMM and the epilogue; from sm_90 they run as a
// cluster and compute A in shares too, before sm_90 (stage kernels only)
// each computes the whole A.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../tokenize.h"
#include "common.cuh"
#include "packed_activation.cuh"
#include "phase_clocks.cuh"

namespace lumenbridge {
namespace cuda {
namespace fused {

constexpr int kWarps = 8;                   // of a first-kernel block; stage blocks have 8 or 16
constexpr int kThreads = kWarps * 32;
constexpr int kTileRows = 64;               // output pixels per block (the GEMM's M)
constexpr int kRowGroups = kTileRows / 16;  // of the mma's 16 rows: depthwise items' rows, the GEMM's m16 tiles
static_assert(kTileRows % 16 == 0, "a block's rows split into the mma's 16");
constexpr int kNTiles = 3;                  // n8 tiles per warp per pass
constexpr int kChannelGroup = 32;           // input channels per 16-byte B load
constexpr int kMaxColumnParts = 8;          // blocks a tile's output columns may split between (16-warp blocks)
constexpr int kMaxNarrowParts = 4;          // the same for 8-warp blocks (step 84: 8 parts slower there)
static_assert(kMaxColumnParts <= 32, "a lane of each warp writes one part's row statistics");

// Row stride (elements) of a shared [rows x cols] tile, cols a multiple of 8:
// an odd number of 16-byte units, so 8 consecutive rows fall in distinct banks.
__host__ __device__ constexpr int padded_stride(int cols) {
  return (cols / 8) % 2 == 0 ? cols + 8 : cols + 16;
}
__host__ __device__ constexpr int round_up(int v, int m) { return (v + m - 1) / m * m; }
__host__ __device__ constexpr size_t align16(size_t bytes) { return (bytes + 15) / 16 * 16; }

// A divisor known on the host, for quotients of non-negative ints on the
// device in two instructions (a multiply-high and a shift) where a division
// by a runtime value is about 20: q = umulhi(n, m) >> (s - 1) with
// s = ceil(log2 d) and m = ceil(2^(31 + s) / d), exact for 0 <= n < 2^31
// (the error n (m - 2^(31 + s) / d) / 2^(31 + s) stays under 1 / d).
struct Divisor {
  int value;
  uint32_t multiplier;
  int shift;

  static Divisor of(int d) {
    TORCH_INTERNAL_ASSERT(d >= 1, "a divisor is positive");
    if (d == 1) return {1, 0, 0};  // quotient() passes n through
    int s = 1;
    while ((int64_t{1} << s) < d) ++s;
    const uint64_t power = uint64_t{1} << (31 + s);
    return {d, static_cast<uint32_t>((power + static_cast<uint64_t>(d) - 1) / static_cast<uint64_t>(d)), s - 1};
  }
  __device__ __forceinline__ int quotient(int n) const {
    return value == 1 ? n : static_cast<int>(__umulhi(static_cast<uint32_t>(n), multiplier) >> shift);
  }
};

// A thread's items threadIdx.x, + blockDim.x, + 2 blockDim.x, ... (or a
// warp's items first, + step, ...) of a grid with `columns` items per row,
// as (row, column): the first item's and the step's quotients once per
// thread, then additions, not two divisions per item.
struct GridCursor {
  int row, column;
  const int columns, row_step, column_step;
  __device__ GridCursor(int columns, int first, int step)
      : row(first / columns), column(first % columns), columns(columns), row_step(step / columns),
        column_step(step % columns) {}
  __device__ GridCursor(const Divisor& columns, int first, int step)
      : row(columns.quotient(first)), column(first - row * columns.value), columns(columns.value),
        row_step(columns.quotient(step)), column_step(step - row_step * columns.value) {}
  __device__ explicit GridCursor(const Divisor& columns) : GridCursor(columns, threadIdx.x, blockDim.x) {}
  __device__ __forceinline__ void advance() {
    row += row_step;
    column += column_step;
    if (column >= columns) {
      column -= columns;
      ++row;
    }
  }
};

// ---- compute dtype ------------------------------------------------------------

// 8 consecutive elements as floats, from a 16-byte-aligned address.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& u, float (&v)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = unpack2<T>(w[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

// The 32-bit shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes of shared memory in one instruction. A plain uint4 or float4 read
// whose elements are each used on their own is split by the compiler into
// 2- or 4-byte loads (seen in the PTX of the first kernel's stage-2
// depthwise: 12 loads per tap instead of 3), which floods the shared-memory
// pipe. Volatile, as CUTLASS's shared loads are, so it stays behind barriers.
__device__ __forceinline__ uint4 load_shared16(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(shared_address(p)));
  return v;
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&v)[8]) {
  return make_uint4(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]),
                    pack2<T>(v[6], v[7]));
}

// ---- A tile: depthwise results in the GEMM's column order ----------------------

// Writes channels c0 .. c0+7 (c0 a multiple of 8) of one A row. Within each
// group of 32 channels, lane t of a quad reads channels 8t .. 8t+7 of the
// weight in one load; the mma k-steps want them at columns 2t, 2t+1 (b0),
// 2t+8, 2t+9 (b1) of the first k16 step and the same of the second.
template <typename T>
__device__ __forceinline__ void store_a8(T* row, int c0, const float (&v)[8]) {
  T* p = row + (c0 & ~31) + 2 * ((c0 & 31) >> 3);
#pragma unroll
  for (int i = 0; i < 4; ++i) *reinterpret_cast<uint32_t*>(p + 8 * i) = pack2<T>(v[2 * i], v[2 * i + 1]);
}

// Channels c0 .. c0+7 of one A row in channel order, as one 16-byte unit:
// store_a8's inverse.
template <typename T>
__device__ __forceinline__ uint4 load_a8(const T* row, int c0) {
  const auto* p = reinterpret_cast<const uint32_t*>(row + (c0 & ~31) + 2 * ((c0 & 31) >> 3));
  return make_uint4(p[0], p[4], p[8], p[12]);
}

// ---- GEMM ------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* shared) {
  const uint32_t address = shared_address(shared);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// The same four 8 x 8 matrices, each transposed: lane 4g + t receives
// elements (2t, g) and (2t + 1, g) of each, where ldmatrix_x4 gives (g, 2t)
// and (g, 2t + 1): an mma operand read from a tile stored the other way.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* shared) {
  const uint32_t address = shared_address(shared);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// Two transposed 8 x 8 matrices (lanes 0-15 give the row addresses).
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* shared) {
  const uint32_t address = shared_address(shared);
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(address));
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// m16n8k8, d = a b + c with c left as it is: the stage-1 pointwise step,
// whose K (the image channels, at most 8) fits one k8 step, starts from the
// bias this way without copying it into the accumulators. A lane's c is
// columns 2t, 2t + 1 of rows g and g + 8, so the same two bias values
// twice: kept in shared memory as {b0, b1, b0, b1}, one 16-byte load.
template <typename T>
__device__ __forceinline__ void mma_1688(float (&d)[4], const uint32_t (&a)[2], uint32_t b, const float4& c) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%7, %8, %9, %10};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b), "f"(c.x), "f"(c.y), "f"(c.z), "f"(c.w));
  } else {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%7, %8, %9, %10};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b), "f"(c.x), "f"(c.y), "f"(c.z), "f"(c.w));
  }
}

// d += a b for m16n8k8: the depthwise taps' diagonal mma (diagonal_tap).
template <typename T>
__device__ __forceinline__ void mma_1688(float (&d)[4], const uint32_t (&a)[2], uint32_t b) {
  mma_1688<T>(d, a, b, make_float4(d[0], d[1], d[2], d[3]));
}

// Four 8 x 8 matrices of 16-bit elements to shared memory from mma
// accumulator fragments: lane 4g + t's r[i] holds elements (g, 2t), (g, 2t + 1)
// of matrix i, whose row j goes to the address lane 8i + j gives. One
// instruction where 4-byte stores take sixteen; sm_90 and later only.
__device__ __forceinline__ void stmatrix_x4(void* shared, const uint32_t (&r)[4]) {
  const uint32_t address = shared_address(shared);
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :
               : "r"(address), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// ---- depthwise taps on the tensor cores ---------------------------------------
//
// A depthwise tap scales each channel by its own weight: as a matrix product,
// a diagonal B. One m16n8k8 mma with a diagonal B applies a tap to 16 pixels x
// 8 channels in float (one nonzero product per output, each exact, summed in
// float), where the CUDA cores spend an unpack and an FMA per value. Lane
// (group g, quad q) of a warp holds pixels g and g + 8 of the warp's 16 and
// channels 8q .. 8q + 7 of its 32, each pixel's as one 16-byte load, so a
// lane's loads, taps and results are whole 16-byte units. Step t (0..3) of a
// tap multiplies word t of each pixel (channels 8q + 2t, 8q + 2t + 1): a
// lane's A and D elements are then the same channels, and its B element
// (rows 2q, 2q + 1, column g) is word t of the tap's 16 bytes for those
// channels, kept only where the diagonal crosses it (g = 2q: the low half,
// g = 2q + 1: the high half). Zeros multiply the other channels, so a
// non-finite input turns 7 other channels of its pixel into NaN.

// The lane's B mask (see above).
__device__ __forceinline__ uint32_t diagonal_mask() {
  const int group = threadIdx.x % 32 / 4, quad = threadIdx.x % 4;
  return group / 2 != quad ? 0u : group % 2 ? 0xffff0000u : 0x0000ffffu;
}

// d[t] = {pixel 0's channels 2t, 2t + 1, pixel 1's} of the lane's 8, starting at bias.
__device__ __forceinline__ void diagonal_start(float (&d)[4][4], const float (&bias)[8]) {
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    d[t][0] = d[t][2] = bias[2 * t];
    d[t][1] = d[t][3] = bias[2 * t + 1];
  }
}

// d += tap x (pixel 0, pixel 1), each the lane's 8 channels in T.
template <typename T>
__device__ __forceinline__ void diagonal_tap(float (&d)[4][4], const uint4& pixel0, const uint4& pixel1,
                                             const uint4& tap, uint32_t mask) {
  const uint32_t p0[4] = {pixel0.x, pixel0.y, pixel0.z, pixel0.w};
  const uint32_t p1[4] = {pixel1.x, pixel1.y, pixel1.z, pixel1.w};
  const uint32_t w[4] = {tap.x, tap.y, tap.z, tap.w};
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const uint32_t a[2] = {p0[t], p1[t]};
    mma_1688<T>(d[t], a, w[t] & mask);
  }
}

// The lane's two pixels' 8 channels, in channel order.
__device__ __forceinline__ void diagonal_result(const float (&d)[4][4], float (&pixel0)[8], float (&pixel1)[8]) {
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    pixel0[2 * t] = d[t][0];
    pixel0[2 * t + 1] = d[t][1];
    pixel1[2 * t] = d[t][2];
    pixel1[2 * t + 1] = d[t][3];
  }
}

// 16 bytes of global memory (read-only for the kernel's lifetime) if `pred`,
// else zeros: one predicated load, so a test of the address never becomes a
// branch around the load (which costs a reconvergence point per load and
// keeps the compiler from issuing the next load before this one is used).
__device__ __forceinline__ uint4 load_global16_if(const void* p, bool pred) {
  uint4 v;
  asm("{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %5, 0;\n"
      "  mov.b32 %0, 0;\n"
      "  mov.b32 %1, 0;\n"
      "  mov.b32 %2, 0;\n"
      "  mov.b32 %3, 0;\n"
      "  @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      "}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "r"(static_cast<int>(pred)));
  return v;
}

// The pointwise weight [Cout, Cin] as the GEMM's B operand.
template <typename T>
struct PointwiseWeight {
  const T* weight;
  const T* bias;
  int in_channels, out_channels;
  bool vector;  // Cin % 8 == 0 and 16-byte aligned: one load per fragment

  // Input channels k .. k+7 of output channel n, element by element; zeros
  // past either extent. The path for weights that are not `vector`.
  __device__ __forceinline__ uint4 load_elements(int n, int k) const {
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      v[e] = n < out_channels && k + e < in_channels
                 ? static_cast<float>(weight[static_cast<int64_t>(n) * in_channels + k + e])
                 : 0.0f;
    }
    return pack8<T>(v);  // exact: the values are already in T
  }
};

// k-groups of B fragments a warp keeps in flight ahead of the one it
// multiplies: B comes from L2, whose latency is several times one k-group's
// mma work; the 64 rows' accumulators leave registers for no more.
constexpr int kBDepth = 2;

// out_tile[row][n] = A[row] . weight[n] + bias[n] in T for the block's
// kTileRows rows and the columns of n8 tiles tile_begin .. tile_end - 1:
// all of them, or with Split a part's (write_tile applies the activation).
// Each warp takes NTiles column tiles per pass (kNTiles, or fewer where a
// kernel's registers hold fewer accumulators); each lane's B rows (one per
// column tile) are fixed for a pass, so their addresses and bounds are
// computed once, and its loads run kBDepth k-groups ahead of the multiplies
// in a ring of registers.
template <typename T, bool Vector, bool Split, int NTiles>
__device__ void gemm_tile(const T* a_tile, int a_stride, int k_padded, const PointwiseWeight<T>& pw, T* out_tile,
                          int out_stride, int tile_begin, int tile_end) {
  constexpr int kDepth = Vector ? kBDepth + 1 : 1;  // the element path: no ring (rare; registers)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int group = lane / 4, quad = lane % 4;
  const int k_groups = k_padded / kChannelGroup;
  const T* a_lane = a_tile + (lane % 16) * a_stride + (lane / 16) * 8;
  for (int tile0 = tile_begin + warp * NTiles; tile0 < tile_end; tile0 += warps * NTiles) {
    // Element offsets of the lane's B rows (the weight has fewer than 2^31
    // elements: a block's shared memory holds rows of its input and output
    // widths, so neither passes a few thousand).
    int b_row[NTiles];
#pragma unroll
    for (int j = 0; j < NTiles; ++j) b_row[j] = ((tile0 + j) * 8 + group) * pw.in_channels + quad * 8;
    auto load_b = [&](int j, int kg) {
      const int k = kg * kChannelGroup + quad * 8;
      if constexpr (Vector) {
        const bool live =
            (!Split || tile0 + j < tile_end) && (tile0 + j) * 8 + group < pw.out_channels && k < pw.in_channels;
        return load_global16_if(pw.weight + (b_row[j] + kg * kChannelGroup), live);
      } else {
        return pw.load_elements((tile0 + j) * 8 + group, k);
      }
    };
    uint4 ring[kDepth][NTiles];
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
#pragma unroll
      for (int j = 0; j < NTiles; ++j) ring[d][j] = load_b(j, d);  // zeros past K
    }
    // The accumulators start at the bias (columns 2 quad, 2 quad + 1 of each tile).
    float acc[kRowGroups][NTiles][4];
#pragma unroll
    for (int j = 0; j < NTiles; ++j) {
      const int n = (tile0 + j) * 8 + 2 * quad;
      const float bias0 = n < pw.out_channels ? static_cast<float>(pw.bias[n]) : 0.0f;
      const float bias1 = n + 1 < pw.out_channels ? static_cast<float>(pw.bias[n + 1]) : 0.0f;
#pragma unroll
      for (int m = 0; m < kRowGroups; ++m) {
        acc[m][j][0] = acc[m][j][2] = bias0;
        acc[m][j][1] = acc[m][j][3] = bias1;
      }
    }
    for (int kg0 = 0; kg0 < k_groups; kg0 += kDepth) {
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        const int kg = kg0 + d;
        if (kg >= k_groups) break;
#pragma unroll
        for (int step = 0; step < 2; ++step) {
          uint32_t a[kRowGroups][4];
#pragma unroll
          for (int m = 0; m < kRowGroups; ++m) {
            ldmatrix_x4(a[m], a_lane + m * 16 * a_stride + kg * kChannelGroup + step * 16);
          }
#pragma unroll
          for (int m = 0; m < kRowGroups; ++m) {
#pragma unroll
            for (int j = 0; j < NTiles; ++j) {
              mma_16816<T>(acc[m][j], a[m], step ? ring[d][j].z : ring[d][j].x, step ? ring[d][j].w : ring[d][j].y);
            }
          }
        }
        // This slot's next k-group, kDepth ahead, where there is one: past
        // the last, the refill's address and bounds would cost as much as a
        // load (lumenbridge-base's first kernel, a K of three groups, refills nothing).
        if (kg + kDepth < k_groups) {
#pragma unroll
          for (int j = 0; j < NTiles; ++j) ring[d][j] = load_b(j, kg + kDepth);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < NTiles; ++j) {
      const int n = (tile0 + j) * 8 + 2 * quad;
      if (tile0 + j >= tile_end) continue;
#pragma unroll
      for (int m = 0; m < kRowGroups; ++m) {
        const int row = m * 16 + group;
        *reinterpret_cast<uint32_t*>(out_tile + row * out_stride + n) = pack2<T>(acc[m][j][0], acc[m][j][1]);
        *reinterpret_cast<uint32_t*>(out_tile + (row + 8) * out_stride + n) = pack2<T>(acc[m][j][2], acc[m][j][3]);
      }
    }
  }
}

// ---- epilogue: the block's outputs to device memory ----------------------------

// Where a block writes, and what it does on the way: the intermediate stage
// output (NHWC rows) after the `activated` activation, or the tokens (rows
// for NLC / NHWC, planes for NCHW), with the token LayerNorm when
// `norm_weight` is set. For tokenize_for_training a stage also writes its
// output before the activation or the norm into `saved_output` (rows of
// `channels`), which the backward would otherwise recompute.
template <typename T>
struct TileOutput {
  T* out;
  T* saved_output;  // tokenize_for_training's stages after the first; else null
  int channels;
  int64_t plane;  // output pixels per image, for NCHW
  bool planes;    // NCHW tokens
  bool vector;    // rows of 16-byte-aligned multiples of 8 channels (the norm's tensors aligned too)
  int parts;      // blocks a tile's columns are split between (a cluster of them from sm_90)
  int columns;    // of a part: channels / parts, a multiple of 8 where parts > 1
  Divisor units;  // of a part's row in the row layouts' loops: 16-byte units if vector, else elements
  bool activated;
  ActivationForm act;
  const T* norm_weight;
  const T* norm_bias;
  float eps;

  // The columns a block writes: part `part`'s with Split, else all of them.
  template <bool Split>
  __device__ int first_column(int part) const {
    return Split ? part * columns : 0;
  }
  template <bool Split>
  __device__ int width() const {
    return Split ? columns : channels;
  }
};

// What the parts of a cluster send each other during a tile: the other
// parts' shares of A, and their rows' statistics. Each arrives by st.async
// into the receiving block's shared memory, counted in bytes on one of its
// mbarriers (set up for one arrival: its own thread 0's, which says how
// many bytes to expect), and the receiver waits for that barrier's phase of
// the tile, `parity`. A cluster barrier would order every memory access of
// every part instead (a MEMBAR.ALL.GPU and an invalidation of L1 each).
struct Exchanges {
  uint64_t shares, statistics;  // mbarriers
  uint32_t parity;              // of the block's current tile: 0, 1, 0, ...
};

// Shared-memory bookkeeping of one block: each row's flattened output pixel
// index (or -1 past the edge) and, with a token norm, its mean and 1/std,
// and where a cluster of parts shares a tile, every part's mean and sum of
// squared deviations of the row over its own columns, which each part
// writes into every part's copy, and the exchanges' barriers.
struct RowInfo {
  int64_t pixel[kTileRows];
  float mean[kTileRows];
  float rstd[kTileRows];
  Exchanges exchanges;
  // Last: a kernel whose tiles never split lends it to A. Sent 16 bytes at a time (row_statistics).
  alignas(16) float part_stats[kMaxColumnParts][2][kTileRows];
};

// Whether a kernel's split tiles run as a thread-block cluster of their
// parts: wherever its code is sm_90's (the host asks the runtime the same:
// compiled_for_sm90 in tokenize_fused.cu). Elsewhere no tile splits in the
// first kernel, and each part of a stage kernel's tile computes all of A.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
template <bool Split>
constexpr bool kClusteredSplit = Split;
#else
template <bool Split>
constexpr bool kClusteredSplit = false;
#endif

// The thread-block cluster of a tile's parts (the host launches clusters
// only on sm_90 and later). A barrier across its blocks in two steps:
// arrive, without ordering memory accesses (where a block starts: another
// block's shared memory may be written only once that block has started and
// set up its barriers) or after them (its reads of its shared memory done
// before the others' next writes), and later wait.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.aligned;" ::: "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#else
  __trap();
#endif
}

// The address of `local` in the shared memory of the cluster's block `rank`.
__device__ __forceinline__ uint32_t cluster_address(const void* local, int rank) {
  uint32_t remote = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(local)), "r"(rank));
#else
  __trap();
#endif
  return remote;
}

// Where a block starts: thread 0 sets up its exchange barriers (the fence
// makes them ready for the other parts' stores), then every thread arrives
// at the cluster barrier, whose wait comes before the block's first send.
__device__ __forceinline__ void join_exchanges(Exchanges& e) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&e.shares)) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&e.statistics)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_arrive_relaxed();
#else
  __trap();
#endif
}

// 16 bytes into `remote`, another block's shared memory (cluster_address),
// counted on that block's barrier `remote_barrier`.
__device__ __forceinline__ void send16(uint32_t remote, const uint4& v, uint32_t remote_barrier) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                   remote),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(remote_barrier)
               : "memory");
#else
  __trap();
#endif
}

// Waits until this tile's `bytes` from the other parts have landed in this
// block (thread 0 arrives, expecting them; every thread waits for the phase).
// The wait acquires at cluster scope: the stores' completion is released by
// the other blocks.
__device__ __forceinline__ void receive(uint64_t& barrier, uint32_t bytes, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t address = shared_address(&barrier);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(address), "r"(bytes) : "memory");
  }
  asm volatile(
      "{\n"
      "  .reg .pred done;\n"
      "  waiting:\n"
      "  mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "  @!done bra waiting;\n"
      "}\n" ::"r"(address),
      "r"(parity)
      : "memory");
#else
  __trap();
#endif
}

// Rows whose statistics a warp sums together, so that their shared reads
// and shuffles overlap (one row at a time, each waited for the last: ncu put
// 14% of the last stage's time in the statistics, mostly short scoreboard
// and wait). 8- and 16-warp blocks give every warp the same number of rows.
constexpr int kRowsTogether = 4;
static_assert(kTileRows % kRowsTogether == 0, "a warp's rows lie inside the tile");

// A lane's shares of the sums of rows r0 .. r0 + kRowsTogether - 1 over
// columns c0 .. c1 - 1 (c0 a multiple of 8), or if Centered of their squared
// deviations from mean[i]: whole 16-byte units where the rows have them
// (rows start 16-byte aligned), then elements. Each row's share is summed
// in the same order as one row alone would be.
template <bool Centered, typename T>
__device__ __forceinline__ void lane_row_sums(const T* tile, int stride, int r0, int c0, int c1, int lane,
                                              const float (&mean)[kRowsTogether], float (&sum)[kRowsTogether]) {
  const int vector_end = c0 + (c1 - c0) / 8 * 8;
#pragma unroll
  for (int i = 0; i < kRowsTogether; ++i) sum[i] = 0.0f;
  for (int c = c0 + lane * 8; c < vector_end; c += 32 * 8) {
    uint4 units[kRowsTogether];
#pragma unroll
    for (int i = 0; i < kRowsTogether; ++i) units[i] = load_shared16(tile + (r0 + i) * stride + c);
#pragma unroll
    for (int i = 0; i < kRowsTogether; ++i) {
      float v[8];
      unpack8<T>(units[i], v);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum[i] += Centered ? (v[e] - mean[i]) * (v[e] - mean[i]) : v[e];
    }
  }
  for (int c = vector_end + lane; c < c1; c += 32) {
#pragma unroll
    for (int i = 0; i < kRowsTogether; ++i) {
      const float v = static_cast<float>(tile[(r0 + i) * stride + c]);
      sum[i] += Centered ? (v - mean[i]) * (v - mean[i]) : v;
    }
  }
}

// Each value summed over the warp's lanes, the shuffles of all of them interleaved.
template <int N>
__device__ __forceinline__ void warp_sums(float (&values)[N]) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
#pragma unroll
    for (int i = 0; i < N; ++i) values[i] += __shfl_xor_sync(0xffffffffu, values[i], offset);
  }
}

// Two passes over each row from shared memory, as PyTorch's LayerNorm does in
// float from the rounded pointwise output; with Split, the same two passes
// over each part's columns, combined across the cluster's parts. Returns
// behind a barrier.
template <typename T, bool Split>
__device__ void row_statistics(const T* tile, int stride, const TileOutput<T>& o, int part, RowInfo& rows,
                               int clock_kernel) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int c0 = o.template first_column<Split>(part), width = o.template width<Split>(), c1 = c0 + width;
  // With Split, one exchange across the cluster: each part writes its rows'
  // mean and squared deviations over its own columns into every part's
  // part_stats (Exchanges), and every part combines them in rank order
  // (Chan's formula for parts of equal width), so all parts get the same
  // statistics. No part still reads the last tile's: the kernel's exchange
  // of A came after a barrier that each part arrived at once it had read them.
  for (int r0 = warp * kRowsTogether; r0 < kTileRows; r0 += warps * kRowsTogether) {
    const float uncentered[kRowsTogether] = {};
    float mean[kRowsTogether], deviations[kRowsTogether];
    lane_row_sums<false>(tile, stride, r0, c0, c1, lane, uncentered, mean);
    warp_sums(mean);  // every lane gets the totals
#pragma unroll
    for (int i = 0; i < kRowsTogether; ++i) mean[i] /= width;
    lane_row_sums<true>(tile, stride, r0, c0, c1, lane, mean, deviations);
    warp_sums(deviations);
    if constexpr (!Split) {
#pragma unroll
      for (int i = 0; i < kRowsTogether; ++i) {
        if (lane == 0 && rows.pixel[r0 + i] >= 0) {
          rows.mean[r0 + i] = mean[i];
          rows.rstd[r0 + i] = rsqrtf(deviations[i] / o.channels + o.eps);
        }
      }
    } else if (lane == part) {  // lane k writes part k's copy
#pragma unroll
      for (int i = 0; i < kRowsTogether; ++i) {
        rows.part_stats[part][0][r0 + i] = mean[i];
        rows.part_stats[part][1][r0 + i] = deviations[i];
      }
    } else if (lane < o.parts) {
      static_assert(kRowsTogether == 4, "a row group's statistics go as one 16-byte store");
      float* stats = &rows.part_stats[part][0][r0];
      const uint32_t barrier = cluster_address(&rows.exchanges.statistics, lane);
      send16(cluster_address(stats, lane), make_uint4(__float_as_uint(mean[0]), __float_as_uint(mean[1]),
                                                      __float_as_uint(mean[2]), __float_as_uint(mean[3])),
             barrier);
      send16(cluster_address(stats + kTileRows, lane),
             make_uint4(__float_as_uint(deviations[0]), __float_as_uint(deviations[1]),
                        __float_as_uint(deviations[2]), __float_as_uint(deviations[3])),
             barrier);
    }
  }
  if constexpr (Split) {
    __syncthreads();  // this part's own statistics
    phase_mark(clock_kernel, kOwnStatistics);
    constexpr uint32_t kBytesFromEachPart = 2 * kTileRows * sizeof(float);
    receive(rows.exchanges.statistics, (o.parts - 1) * kBytesFromEachPart, rows.exchanges.parity);
    for (int r = threadIdx.x; r < kTileRows; r += blockDim.x) {
      if (rows.pixel[r] < 0) continue;
      float mean = 0.0f;
      for (int p = 0; p < o.parts; ++p) mean += rows.part_stats[p][0][r];
      mean /= o.parts;
      float deviations = 0.0f;
      for (int p = 0; p < o.parts; ++p) {
        const float shift = rows.part_stats[p][0][r] - mean;
        deviations += rows.part_stats[p][1][r] + width * shift * shift;
      }
      rows.mean[r] = mean;
      rows.rstd[r] = rsqrtf(deviations / o.channels + o.eps);
    }
  }
  __syncthreads();
  phase_mark(clock_kernel, kStatistics);
}

// Writes the block's tile, or with Split its part of the columns, (after
// the GEMM, behind a barrier) to device memory.
template <typename T, bool Split>
__device__ void write_tile(const T* tile, int stride, const TileOutput<T>& o, int part, RowInfo& rows,
                           int clock_kernel) {
  const bool norm = o.norm_weight != nullptr;
  const int column0 = o.template first_column<Split>(part), columns = o.template width<Split>();
  if (norm) row_statistics<T, Split>(tile, stride, o, part, rows, clock_kernel);
  // One value of the tile as written: normed, activated (act of a value in
  // the low half of a pair; the high half's result is unused) or as it is.
  auto transform = [&](T value, int r, int c) {
    const float v = static_cast<float>(value);
    if (norm) {
      return static_cast<T>((v - rows.mean[r]) * rows.rstd[r] * static_cast<float>(o.norm_weight[c]) +
                            static_cast<float>(o.norm_bias[c]));
    }
    if (!o.activated) return value;
    return T(static_cast<uint16_t>(activate_pair<T>(v, 0.0f, o.act) & 0xffffu), T::from_bits());
  };
  if (o.planes) {
    // The saved rows first, in row order (the planes' order below would
    // scatter their stores a row apart), 16 bytes at a time where vector.
    if (o.saved_output != nullptr) {
      for (GridCursor at(o.units); at.row < kTileRows; at.advance()) {
        const int64_t pixel = rows.pixel[at.row];
        if (pixel < 0) continue;
        if (o.vector) {
          const int c = column0 + at.column * 8;
          *reinterpret_cast<uint4*>(o.saved_output + pixel * o.channels + c) =
              *reinterpret_cast<const uint4*>(tile + at.row * stride + c);
        } else {
          const int c = column0 + at.column;
          o.saved_output[pixel * o.channels + c] = tile[at.row * stride + c];
        }
      }
    }
    // Consecutive threads take consecutive pixels of one channel plane.
    for (int item = threadIdx.x; item < kTileRows * columns; item += blockDim.x) {
      const int r = item % kTileRows, c = column0 + item / kTileRows;
      const int64_t pixel = rows.pixel[r];
      if (pixel < 0) continue;
      const int64_t image = pixel / o.plane, offset = pixel % o.plane;
      o.out[(image * o.channels + c) * o.plane + offset] = transform(tile[r * stride + c], r, c);
    }
  } else if (o.vector && !norm) {
    // Rows of whole 16-byte units, activated in pairs.
    for (GridCursor at(o.units); at.row < kTileRows; at.advance()) {
      const int r = at.row, c = column0 + at.column * 8;
      const int64_t pixel = rows.pixel[r];
      if (pixel < 0) continue;
      uint4 chunk = *reinterpret_cast<const uint4*>(tile + r * stride + c);
      if (o.saved_output != nullptr) *reinterpret_cast<uint4*>(o.saved_output + pixel * o.channels + c) = chunk;
      if (o.activated) {
        chunk = make_uint4(activate_packed<T>(chunk.x, o.act), activate_packed<T>(chunk.y, o.act),
                           activate_packed<T>(chunk.z, o.act), activate_packed<T>(chunk.w, o.act));
      }
      *reinterpret_cast<uint4*>(o.out + pixel * o.channels + c) = chunk;
    }
  } else if (o.vector) {
    // Normed rows of whole 16-byte units. A thread takes one unit of columns
    // at a time, loads its 8 norm weights and biases once (16 bytes at a
    // time: o.vector covers their alignment), and walks rows: `walkers`
    // threads share a unit where a row has fewer units than the block has
    // threads (the rest of the block idles: 32 of 512 threads at 768
    // channels), and a thread takes several units in turn where it has more.
    const int units = o.units.value, walkers = max(1, static_cast<int>(blockDim.x) / units);
    for (int slot = threadIdx.x; slot < walkers * units; slot += blockDim.x) {
      const int first_row = o.units.quotient(slot), c = column0 + (slot - first_row * units) * 8;
      float weight[8], bias[8];
      unpack8<T>(__ldg(reinterpret_cast<const uint4*>(o.norm_weight + c)), weight);
      unpack8<T>(__ldg(reinterpret_cast<const uint4*>(o.norm_bias + c)), bias);
      for (int r = first_row; r < kTileRows; r += walkers) {
        const int64_t pixel = rows.pixel[r];
        if (pixel < 0) continue;
        const uint4 chunk = *reinterpret_cast<const uint4*>(tile + r * stride + c);
        if (o.saved_output != nullptr) *reinterpret_cast<uint4*>(o.saved_output + pixel * o.channels + c) = chunk;
        float v[8];
        unpack8<T>(chunk, v);
        const float mean = rows.mean[r], rstd = rows.rstd[r];
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = (v[e] - mean) * rstd * weight[e] + bias[e];
        *reinterpret_cast<uint4*>(o.out + pixel * o.channels + c) = pack8<T>(v);
      }
    }
  } else {
    for (GridCursor at(o.units); at.row < kTileRows; at.advance()) {
      const int r = at.row, c = column0 + at.column;
      const int64_t pixel = rows.pixel[r];
      if (pixel < 0) continue;
      const T value = tile[r * stride + c];
      if (o.saved_output != nullptr) o.saved_output[pixel * o.channels + c] = value;
      o.out[pixel * o.channels + c] = transform(value, r, c);
    }
  }
}

}  // namespace fused
}  // namespace cuda
}  // namespace lumenbridge

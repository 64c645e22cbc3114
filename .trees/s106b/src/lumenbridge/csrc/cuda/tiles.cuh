// Shared-memory tiles with full halos for the one-tile-per-step NCHW kernels
// (the stride-2 input gradient and the weight gradient); the other kernels
// use the pipelined tiles of pipeline.cuh and nhwc_tiles.cuh.
//
// A tile is the window of input rows [y0, y0 + ROWS) and columns
// [x0, x0 + COLS) of one plane. Every cell of it is written: cells outside
// the image hold zero, which is the convolution's zero padding, so the
// compute that follows needs no bounds checks at all.
//
// Stride-2 readers touch every other column; storing even and odd columns in
// separate halves (`Deinterleave`) makes those reads consecutive in shared
// memory, so a warp hits distinct banks.
#pragma once

#include "common.cuh"

namespace lumenbridge {
namespace cuda {

__host__ __device__ constexpr int round_up(int a, int b) { return ceil_div(a, b) * b; }

// NCHW: a ROWS x COLS window of one plane, stored as float rows of kPitch.
// Loads are VEC-wide and VEC-aligned, so the stored window starts `lead`
// (0 .. VEC - 1) columns left of the requested x0: logical column j of the
// window is stored at column(lead + j). The caller guarantees W % VEC == 0,
// so each chunk lies wholly inside or outside a row and is stored whole.
// TwoRowWarps pads rows so the two rows a 16-wide warp reads sit 16 banks apart.
template <int ROWS, int COLS, int VEC, bool Deinterleave, bool TwoRowWarps = false>
struct PlaneTile {
  static constexpr int kStoreW = round_up(COLS + VEC - 1, VEC);
  static constexpr int kChunks = kStoreW / VEC;
  static constexpr int kPairs = VEC > 1 ? VEC / 2 : 1;
  static constexpr int kHalf = Deinterleave ? round_up(ceil_div(kStoreW, 2), kPairs) : 0;
  static constexpr int kWidth = Deinterleave ? 2 * kHalf : kStoreW;
  static constexpr int kPitch = TwoRowWarps ? kWidth + (48 - kWidth % 32) % 32 : kWidth;
  static constexpr int kFloats = ROWS * kPitch;

  __device__ __forceinline__ static int column(int j) {
    return Deinterleave ? (j & 1) * kHalf + (j >> 1) : j;
  }

  template <typename T, int THREADS>
  __device__ __forceinline__ static int load(float* __restrict__ tile, const T* __restrict__ plane,
                                             int H, int W, int y0, int x0, int tid) {
    constexpr int kItems = ROWS * kChunks;
    const int lead = ((x0 % VEC) + VEC) % VEC;
    const int xs = x0 - lead;
    // Unrolled in groups of 8: enough loads in flight without exhausting registers.
#pragma unroll 8
    for (int k = 0; k < ceil_div(kItems, THREADS); ++k) {
      const int item = tid + k * THREADS;
      if (kItems % THREADS != 0 && item >= kItems) break;
      const int r = item / kChunks;
      const int q = item - r * kChunks;
      const int gy = y0 + r;
      const int gx = xs + q * VEC;
      Vec<T, VEC> v = zero_vec<T, VEC>();
      if (gy >= 0 && gy < H && gx >= 0 && gx < W) {
        v = load_vec<T, VEC>(plane + static_cast<int64_t>(gy) * W + gx);
      }
      float* row = tile + r * kPitch;
      if constexpr (Deinterleave && VEC > 1) {
        // Even columns of the chunk go to the first half, odd to the second.
        Vec<float, kPairs> even, odd;
#pragma unroll
        for (int e = 0; e < kPairs; ++e) {
          even.v[e] = static_cast<float>(v.v[2 * e]);
          odd.v[e] = static_cast<float>(v.v[2 * e + 1]);
        }
        store_vec<float, kPairs>(row + q * kPairs, even);
        store_vec<float, kPairs>(row + kHalf + q * kPairs, odd);
      } else if constexpr (Deinterleave) {
        row[column(q)] = static_cast<float>(v.v[0]);
      } else {
        Vec<float, VEC> f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) f.v[e] = static_cast<float>(v.v[e]);
        store_vec<float, VEC>(row + q * VEC, f);
      }
    }
    return lead;
  }
};

}  // namespace cuda
}  // namespace lumenbridge

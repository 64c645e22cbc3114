// Shared-memory tiles with full halos, for both layouts.
//
// A tile is the window of input rows [y0, y0 + ROWS) and columns
// [x0, x0 + COLS) of one image (NHWC: and a slab of channels). Every cell of
// it is written: cells outside the image hold zero, which is the convolution's
// zero padding, so the compute that follows needs no bounds checks at all.
//
// Stride-2 readers touch every other column; storing even and odd columns in
// separate halves (`Deinterleave`) makes those reads consecutive in shared
// memory, so a warp hits distinct banks.
#pragma once

#include "common.cuh"

namespace lumenbridge {
namespace cuda {

// Physical column of logical column j in a tile row of COLS columns.
template <int COLS, bool Deinterleave>
struct ColumnMap {
  static constexpr int kHalf = (COLS + 1) / 2;
  static constexpr int kWidth = Deinterleave ? 2 * kHalf : COLS;
  __device__ __forceinline__ static int phys(int j) {
    return Deinterleave ? (j & 1) * kHalf + (j >> 1) : j;
  }
};

// NCHW: one plane, ROWS x COLS window, stored as float rows of PITCH.
// Global loads are VEC-wide and VEC-aligned: the first chunk starts up to
// VEC - 1 columns left of x0 and those leading cells are dropped. The caller
// guarantees W % VEC == 0, so every chunk is wholly inside or outside a row.
template <typename T, int ROWS, int COLS, int PITCH, int VEC, bool Deinterleave, int THREADS>
__device__ __forceinline__ void load_plane_tile(float* __restrict__ tile,
                                                const T* __restrict__ plane, int H, int W,
                                                int y0, int x0, int tid) {
  using Map = ColumnMap<COLS, Deinterleave>;
  constexpr int kChunks = ceil_div(COLS + VEC - 1, VEC);
  constexpr int kItems = ROWS * kChunks;
  const int lead = ((x0 % VEC) + VEC) % VEC;
  // Unrolled in groups of 8: enough loads in flight without exhausting registers.
#pragma unroll 8
  for (int k = 0; k < ceil_div(kItems, THREADS); ++k) {
    const int item = tid + k * THREADS;
    if (kItems % THREADS != 0 && item >= kItems) break;
    const int r = item / kChunks;
    const int q = item - r * kChunks;
    const int gy = y0 + r;
    const int gx = x0 - lead + q * VEC;
    Vec<T, VEC> v = zero_vec<T, VEC>();
    if (gy >= 0 && gy < H && gx >= 0 && gx < W) {
      v = load_vec<T, VEC>(plane + static_cast<int64_t>(gy) * W + gx);
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const int j = q * VEC + e - lead;
      if (j >= 0 && j < COLS) tile[r * PITCH + Map::phys(j)] = static_cast<float>(v.v[e]);
    }
  }
}

// NHWC: pixels of the window hold a slab of CV * VEC channels starting at c0,
// stored in the input dtype as [ROWS][phys column][CV * VEC]. Eight threads
// move one pixel's slab, so each group of them reads contiguous memory.
template <typename T, int ROWS, int COLS, int CV, int VEC, bool Deinterleave, int THREADS>
__device__ __forceinline__ void load_pixel_tile(T* __restrict__ tile, const T* __restrict__ image,
                                                int H, int W, int C, int y0, int x0, int c0,
                                                int tid) {
  using Map = ColumnMap<COLS, Deinterleave>;
  constexpr int kSlab = CV * VEC;
  constexpr int kItems = ROWS * COLS * CV;
  // Unrolled in groups of 8: enough loads in flight without exhausting registers.
#pragma unroll 8
  for (int k = 0; k < ceil_div(kItems, THREADS); ++k) {
    const int item = tid + k * THREADS;
    if (kItems % THREADS != 0 && item >= kItems) break;
    const int pixel = item / CV;
    const int cv = item - pixel * CV;
    const int r = pixel / COLS;
    const int j = pixel - r * COLS;
    const int gy = y0 + r;
    const int gx = x0 + j;
    const int c = c0 + cv * VEC;
    Vec<T, VEC> v = zero_vec<T, VEC>();
    if (gy >= 0 && gy < H && gx >= 0 && gx < W && c < C) {
      v = load_vec<T, VEC>(image + (static_cast<int64_t>(gy) * W + gx) * C + c);
    }
    store_vec<T, VEC>(tile + (r * Map::kWidth + Map::phys(j)) * kSlab + cv * VEC, v);
  }
}

}  // namespace cuda
}  // namespace lumenbridge

// Pass 1 of the deterministic depthwise weight gradients
// (depthwise_backward_weight.cu, depthwise_backward_both.cu): how the tiles
// are split between blocks, and how a block's per-thread sums become its
// partial sums [C, chunks, K * K + 1] for pass 2 (partial_sums.cuh). The
// pointwise backward kernels (pointwise_backward_narrow.cu, _wide.cu) split
// their rows with tiles_per_block too.
#pragma once

#include "common.cuh"
#include "nhwc_tiles.cuh"

namespace lumenbridge {
namespace cuda {

// Tiles per block in pass 1: at least 8, enough to amortize a block's final
// reduction, and more for large problems, aiming at a fixed block count:
//   NCHW (one tile at a time): about 1024 blocks per channel.
//   NHWC (pipelined): about 264 blocks over all slabs, one wave at two blocks
//     per SM on the H200, so each block's pipeline runs long. Measured best
//     of 264 to 4224 blocks on every benchmark shape (benchmarks/NOTES.md).
constexpr int64_t kMinTilesPerBlock = 8, kNchwBlocksPerChannel = 1024, kNhwcBlocks = 264;

// Tiles a block takes when `groups` channels or slabs of `items` tiles each
// share `target_blocks` blocks: at least kMinTilesPerBlock, at most all of a
// group's tiles (so it fits an int when items does).
inline int tiles_per_block(int64_t items, int64_t groups, int64_t target_blocks) {
  return static_cast<int>(
      std::max(kMinTilesPerBlock, std::min(items, ceil_div64(items * groups, target_blocks))));
}

// How pass 1 splits one channel's (or slab's) work: `items` tiles over the
// batch, in `chunks` runs of `tiles_per_block`. A function of the shape alone.
struct WorkSplit {
  int tiles_x, tiles_y, tiles_per_block;
  int64_t items, chunks;
};

// `groups` channels or slabs share `target_blocks` blocks.
template <typename Tile>
WorkSplit split_work(const DepthwiseProblem& p, int64_t groups, int64_t target_blocks) {
  WorkSplit split;
  split.tiles_x = ceil_div(static_cast<int>(p.Wo), Tile::kOutW);
  split.tiles_y = ceil_div(static_cast<int>(p.Ho), Tile::kOutH);
  split.items = p.N * split.tiles_x * split.tiles_y;
  TORCH_CHECK(split.items <= std::numeric_limits<int32_t>::max(),
              "LumenBridge: batch too large for one weight-gradient launch (", text(split.items),
              " tiles)");
  split.tiles_per_block = tiles_per_block(split.items, groups, target_blocks);
  split.chunks = ceil_div64(split.items, split.tiles_per_block);
  return split;
}

// Sums each thread's SUMS sums over a block of kThreads threads that all
// work on channel c, in a fixed order (a warp's xor tree, then the warps in
// turn through `warp_sums`), and stores the block's partials: the
// one-channel blocks of the NCHW weight kernel (depthwise_backward_weight.cu)
// and of the images' stage (images_stage.cu). `thread` counts from 0 in the
// block, in the caller's own index type (int, or threadIdx's unsigned), so
// each caller's index arithmetic stays what it was.
template <int SUMS, typename Thread>
__device__ __forceinline__ void store_channel_partials(const float (&acc)[SUMS],
                                                       float (&warp_sums)[kThreads / 32][SUMS], Thread thread, int c,
                                                       int chunk, int chunks, float* partials) {
  static_assert(SUMS <= kThreads, "a thread a sum in the last step");
  const int warp = thread / 32, lane = thread % 32;
#pragma unroll
  for (int i = 0; i < SUMS; ++i) {
    const float s = warp_sum(acc[i]);
    if (lane == 0) warp_sums[warp][i] = s;
  }
  __syncthreads();
  if (thread < SUMS) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w][thread];
    partials[(static_cast<int64_t>(c) * chunks + chunk) * SUMS + thread] = total;
  }
}

// Sums the per-thread sums acc[sum][channel] of WARPS warps over the pixels
// they cover, in a fixed order: across the lanes of a warp that share
// channels (a fixed xor tree: lane = pixel * 8 + channel thread), then across
// the warps through `sums` (shared, WARPS * SUMS * 32 floats), and stores the
// block's partials. `thread` counts from 0 within the WARPS warps; `sync()` is
// a barrier among them.
template <int WARPS, int SUMS, int L, typename Sync>
__device__ __forceinline__ void store_slab_partials(const float (&acc)[SUMS][L], float* sums, int thread, int c0,
                                                    int C, int chunk, int chunks, float* partials, Sync&& sync) {
  constexpr int kSlab = NhwcLanes::kSlab;
  static_assert(NhwcLanes::kChannelThreads == 8 && L == NhwcLanes::kLane, "lanes as nhwc_tiles.cuh lays them out");
  const int warp = thread / 32, lane = thread % 32;
#pragma unroll
  for (int i = 0; i < SUMS; ++i) {
#pragma unroll
    for (int e = 0; e < L; ++e) {
      float value = acc[i][e];
      value += __shfl_xor_sync(0xffffffffu, value, 8);
      value += __shfl_xor_sync(0xffffffffu, value, 16);
      if (lane < NhwcLanes::kChannelThreads) sums[(warp * SUMS + i) * kSlab + lane * L + e] = value;
    }
  }
  sync();
  for (int k = thread; k < SUMS * kSlab; k += WARPS * 32) {
    const int i = k / kSlab, ch = k % kSlab;
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total += sums[(w * SUMS + i) * kSlab + ch];
    if (c0 + ch < C) partials[(static_cast<int64_t>(c0 + ch) * chunks + chunk) * SUMS + i] = total;
  }
}

}  // namespace cuda
}  // namespace lumenbridge

// Persistent, multi-buffered tile pipelines for the forward kernels, the
// NHWC stride-2 input gradient, the NHWC weight gradient, the kernel that
// computes both gradients at stride 2 and the images' stage's pointwise
// backward.
//
// A block stays resident and walks its share of the tiles. While it computes
// tile i from one shared-memory buffer, asynchronous copies fill the others
// with the next tiles, so global-memory latency hides behind compute. Per
// tile there is exactly one barrier: it both publishes the tile that just
// landed and tells every thread that the previous tile's buffer is free.
#pragma once

#include <c10/cuda/CUDAFunctions.h>

#include <array>
#include <atomic>

#include "common.cuh"

namespace lumenbridge {
namespace cuda {

// Copies one chunk of CHUNK elements from global to shared memory, or writes
// zeros when `inside` is false (the convolution's padding). Chunks of 4, 8 or
// 16 bytes go through cp.async, whose zero-fill form needs no branch; a 2-byte
// chunk (a lone half) is a plain load and store. `src` must be a valid address
// even when `inside` is false; it is not read then.
template <typename T, int CHUNK>
__device__ __forceinline__ void copy_chunk_async(T* dst, const T* src, bool inside) {
  constexpr int kBytes = CHUNK * static_cast<int>(sizeof(T));
  static_assert(kBytes == 2 || kBytes == 4 || kBytes == 8 || kBytes == 16, "unsupported chunk");
  if constexpr (kBytes == 2) {
    *dst = inside ? *src : T(0.0f);
  } else {
    const unsigned shared = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    const int src_bytes = inside ? kBytes : 0;
    if constexpr (kBytes == 16) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(src),
                   "r"(src_bytes));
    } else {
      asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(shared), "l"(src),
                   "n"(kBytes), "r"(src_bytes));
    }
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most PENDING of this thread's most recent copy groups are
// still in flight.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait_pending() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// Global chunk widths the tile loaders are compiled for: a full 16-byte
// vector, half of one, or one element. `chunk_width` picks the widest that
// divides the contiguous extent and keeps the pointer aligned.
template <typename T>
struct ChunkWidths {
  static constexpr int kFull = 16 / sizeof(T), kHalf = kFull / 2;
};

template <typename T>
int chunk_width(int64_t extent, const void* base) {
  for (int width : {ChunkWidths<T>::kFull, ChunkWidths<T>::kHalf}) {
    if (vector_width<T>(width, extent, {base}) == width) return width;
  }
  return 1;
}

// Runs `body` with std::integral_constant<int, CHUNK> for the runtime width
// from chunk_width; the branch is uniform across the grid.
template <typename T, typename Body>
__device__ __forceinline__ void dispatch_chunk(int width, Body&& body) {
  if (width == ChunkWidths<T>::kFull) {
    body(std::integral_constant<int, ChunkWidths<T>::kFull>{});
  } else if (width == ChunkWidths<T>::kHalf) {
    body(std::integral_constant<int, ChunkWidths<T>::kHalf>{});
  } else {
    body(std::integral_constant<int, 1>{});
  }
}

// A position in a mixed-radix space of tiles (digit 0 varies fastest; the last
// digit, the image, is unbounded). A cursor advances by a fixed step, added
// digit by digit with carries: no division in the loop.
template <int D>
struct TileSpace {
  int radix[D];  // extent of each digit (the last is the batch)
  int step[D];   // the step written in this radix
};

template <int D>
struct TileCursor {
  int digit[D];

  __device__ __forceinline__ explicit TileCursor(int64_t index, const TileSpace<D>& space) {
#pragma unroll
    for (int d = 0; d < D - 1; ++d) {
      digit[d] = static_cast<int>(index % space.radix[d]);
      index /= space.radix[d];
    }
    digit[D - 1] = static_cast<int>(index);
  }

  __device__ __forceinline__ void advance(const TileSpace<D>& space) {
    int carry = 0;
#pragma unroll
    for (int d = 0; d < D - 1; ++d) {
      digit[d] += space.step[d] + carry;
      carry = digit[d] >= space.radix[d];
      digit[d] -= carry ? space.radix[d] : 0;
    }
    digit[D - 1] += space.step[D - 1] + carry;
  }
};

// Tile buffers per block: three where a tile is at most 24 KB, so two tiles
// are in flight while one is computed (measured no slower than two, within
// noise: benchmarks/NOTES.md step 7); two for larger tiles, so several blocks
// still fit an SM.
constexpr int pipeline_stages(size_t tile_bytes) { return tile_bytes <= 24 * 1024 ? 3 : 2; }

// The pipeline itself: `count` tiles, the first at index `first`, each next
// one space.step further. STAGES tile buffers of `elems` elements: tiles
// i + 1 .. i + STAGES - 1 are in flight while tile i is computed.
//   load(buffer, cursor)     issues the asynchronous copies of one tile
//   landed(buffer)           this thread's own copies of the tile, complete,
//                            before the barrier publishes the tile (an in-place
//                            transform of them needs no second barrier)
//   prepare(cursor)          per-tile setup that may start early (e.g. taps);
//                            also called once past the last tile (digits stay in range)
//   compute(buffer, cursor)  computes one tile from shared memory
template <int STAGES, int D, typename T, typename Load, typename Landed, typename Prepare, typename Compute>
__device__ __forceinline__ void run_tile_pipeline(const TileSpace<D>& space, int64_t first, int count,
                                                  T* buffers, int elems, Load&& load, Landed&& landed,
                                                  Prepare&& prepare, Compute&& compute) {
  static_assert(STAGES >= 2, "double buffering at least");
  TileCursor<D> at(first, space), ahead = at;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < count) load(buffers + s * elems, ahead);
    cp_async_commit();  // empty groups keep the count uniform
    ahead.advance(space);
  }
  prepare(at);
  int stage = 0;
  for (int i = 0; i < count; ++i) {
    cp_async_wait_pending<STAGES - 2>();
    landed(buffers + stage * elems);
    // The one barrier per tile: tile i has landed for every thread, and every
    // thread is done with tile i - 1, whose buffer now takes tile i + STAGES - 1.
    __syncthreads();
    const int free_stage = stage == 0 ? STAGES - 1 : stage - 1;
    if (i + STAGES - 1 < count) load(buffers + free_stage * elems, ahead);
    cp_async_commit();
    ahead.advance(space);
    compute(buffers + stage * elems, at);
    at.advance(space);
    prepare(at);
    stage = stage + 1 == STAGES ? 0 : stage + 1;
  }
}

// A landed or prepare step that does nothing.
struct NoStep {
  template <typename... Args>
  __device__ __forceinline__ void operator()(Args&&...) const {}
};

// Tiles a persistent block walks: indices blockIdx.x, blockIdx.x + gridDim.x,
// ... below `total`.
__device__ __forceinline__ int persistent_tile_count(int64_t total) {
  return static_cast<int>((total - 1 - blockIdx.x) / gridDim.x + 1);
}

// The grid that keeps every SM full for one wave: resident blocks per SM
// (from the occupancy calculator) times the SM count, and never more blocks
// than tiles. `multiple` rounds it down to a multiple, so the fastest digit of
// a block's tiles never changes when step[0] is 0. KERNEL is a template
// argument so that each kernel (its own block size and shared memory) keeps
// its own cached count per device.
template <auto KERNEL>
int64_t persistent_blocks(int threads, size_t shared_bytes, int64_t tiles, int64_t multiple) {
  static std::array<std::atomic<int>, 64> resident_per_device{};  // blocks per SM times SMs
  const int device = c10::cuda::current_device();
  int resident = device < 64 ? resident_per_device[device].load() : 0;
  if (resident == 0) {
    int per_sm = 0, sms = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, KERNEL, threads,
                                                                  shared_bytes));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    TORCH_CHECK(per_sm > 0, "LumenBridge: internal error: a tiled kernel cannot be resident");
    resident = per_sm * sms;
    if (device < 64) resident_per_device[device].store(resident);
  }
  const int64_t blocks = std::min<int64_t>(tiles, resident);
  return std::max<int64_t>(multiple, blocks / multiple * multiple);
}

// The TileSpace for `radix` (last digit: the batch) with steps of `step` tiles.
template <int D>
TileSpace<D> tile_space(const std::array<int64_t, D>& radix, int64_t step) {
  TileSpace<D> space;
  int64_t rest = step;
  for (int d = 0; d < D; ++d) {
    // Digits stay below radix + step, which must fit an int.
    TORCH_CHECK(radix[d] + step <= std::numeric_limits<int32_t>::max(),
                "LumenBridge: problem too large for one CUDA launch (extent ", text(radix[d]), ")");
    space.radix[d] = static_cast<int>(radix[d]);
    space.step[d] = static_cast<int>(d < D - 1 ? rest % radix[d] : rest);
    rest /= radix[d];
  }
  return space;
}

}  // namespace cuda
}  // namespace lumenbridge

// NHWC tile geometry and loader shared by the forward, stride-2 input-gradient,
// weight-gradient and both-gradients kernels.
//
// Threads run along channels, four each (one 16-byte fp32 or 8-byte half
// shared read per pixel), so eight threads cover a pixel's slab of 32
// channels. The other threads tile the output plane: each computes V adjacent
// pixels in each of R rows. Pixel columns in shared memory are stored
// de-interleaved (column j at (j mod WAYS) * span + j / WAYS), so the threads
// of a warp that step WAYS pixels apart read adjacent pixels and hit distinct
// banks.
#pragma once

#include "activation.cuh"
#include "packed_activation.cuh"
#include "pipeline.cuh"

namespace lumenbridge {
namespace cuda {

// ROWS x COLS pixels of a slab of SLAB channels, as [row][column][channel].
template <int ROWS, int COLS, int WAYS, int SLAB>
struct PixelWindow {
  static constexpr int kRows = ROWS, kCols = COLS, kSlab = SLAB;
  static constexpr int kSpan = ceil_div(COLS, WAYS);
  static constexpr int kRowPixels = WAYS * kSpan;
  static constexpr int kElems = ROWS * kRowPixels * SLAB;
  __host__ __device__ static constexpr unsigned column(unsigned j) { return (j % WAYS) * kSpan + j / WAYS; }
};

// The channel lanes every NHWC tile shares: four channels per thread, eight
// threads per 32-channel slab (the unit load_pixel_window copies).
struct NhwcLanes {
  static constexpr int kLane = 4, kChannelThreads = 8, kSlab = kLane * kChannelThreads;
};

template <int K, int S>
struct NhwcTile : NhwcLanes {
  static constexpr int kSX = S == 1 ? 4 : 8, kSY = 8 * 4 / kSX;
  static constexpr int kV = S == 1 ? 2 : 1, kRows = 2;
  static constexpr int kThreads = kChannelThreads * kSX * kSY;
  static constexpr int kOutW = kSX * kV, kOutH = kSY * kRows;
  static constexpr int kPad = K / 2;
  // The input window of an output tile, halo included.
  using Input = PixelWindow<(kOutH - 1) * S + K, (kOutW - 1) * S + K, kV * S, kSlab>;
  // The output tile itself (the weight gradient reads grad_output through it).
  using Output = PixelWindow<kOutH, kOutW, kV, kSlab>;

  // A thread's place in the tile: its four channels (lane_c) and the V x R
  // output pixels at column sx, row sy of the thread grid.
  struct Thread {
    int lane_c, sx, sy;
    __device__ explicit Thread(int tid)
        : lane_c(tid % kChannelThreads), sx((tid / kChannelThreads) % kSX),
          sy(tid / (kChannelThreads * kSX)) {}
    // Where this thread's input window (first row, first column, its
    // channels) starts in an Input tile. Column sx * V * S + o of the window is
    // stored at Input::column(o) + sx, since V * S is the de-interleaving factor.
    __device__ int input_window() const {
      return (sy * kRows * S * Input::kRowPixels + sx) * kSlab + lane_c * kLane;
    }
  };

  // This thread's channels of pixel (row, column) of its input window.
  template <typename T>
  __device__ static Vec<T, kLane> input_pixel(const T* window, int row, int column) {
    return load_vec<T, kLane>(window + (row * Input::kRowPixels + Input::column(column)) * kSlab);
  }
};

// Calls visit(r, j, q) for each chunk of a Window this thread moves: pixel
// (r, j) of the window, chunk q of its slab. THREADS is a multiple of the
// chunks per pixel, so each thread always moves the same chunk of its pixels.
// UNROLL chunks' addresses are in flight at once. A thread's pixels are
// kPixelStep apart in the window's row-major order, so (r, j) steps by a whole
// number of rows and columns, with one carry from column to row, rather than
// being divided out of the pixel's index at each chunk.
template <typename Window, int THREADS, int CHUNK, int UNROLL = 4, typename Visit>
__device__ __forceinline__ void for_each_own_chunk(int tid, Visit&& visit) {
  constexpr unsigned kChunksPerPixel = Window::kSlab / CHUNK;
  constexpr unsigned kPixelStep = THREADS / kChunksPerPixel;
  constexpr unsigned kRowStep = kPixelStep / Window::kCols, kColumnStep = kPixelStep % Window::kCols;
  static_assert(THREADS % kChunksPerPixel == 0, "a thread's chunk must not change");
  const unsigned q = tid % kChunksPerPixel, first = tid / kChunksPerPixel;
  unsigned j = first % Window::kCols;
#pragma unroll UNROLL
  for (unsigned r = first / Window::kCols; r < Window::kRows; r += kRowStep) {
    visit(r, j, q);
    if constexpr (kColumnStep != 0) {
      j += kColumnStep;
      if (j >= Window::kCols) {
        j -= Window::kCols;
        ++r;
      }
    }
  }
}

// Where chunk q of window pixel (r, j) lies in a tile.
template <typename Window, int CHUNK>
__device__ __forceinline__ unsigned chunk_offset(unsigned r, unsigned j, unsigned q) {
  return (r * Window::kRowPixels + Window::column(j)) * Window::kSlab + q * CHUNK;
}

// Copies the Window whose top-left pixel is (y0, x0), channels [c0, c0 + 32),
// of one H x W image of C channels whose pixels lie `pitch` >= C elements
// apart into `tile`; pixels and channels outside the image are zero-filled.
template <typename Window, int THREADS, int CHUNK, int UNROLL = 4, typename T>
__device__ __forceinline__ void load_pixel_window(T* __restrict__ tile, const T* __restrict__ image,
                                                  int H, int W, int C, int pitch, int y0, int x0, int c0,
                                                  int tid) {
  // A row of an image may pass 2^32 elements. The offset is unsigned: it is
  // used only inside the image, where each of its terms is nonnegative, and
  // unsigned products cost fewer instructions than signed 64-bit ones.
  const uint64_t row_pitch = static_cast<uint64_t>(static_cast<unsigned>(W)) * static_cast<unsigned>(pitch);
  for_each_own_chunk<Window, THREADS, CHUNK, UNROLL>(tid, [&](unsigned r, unsigned j, unsigned q) {
    const int c = c0 + static_cast<int>(q * CHUNK);
    const int gy = y0 + static_cast<int>(r), gx = x0 + static_cast<int>(j);
    const bool inside = static_cast<unsigned>(gy) < static_cast<unsigned>(H) &&
                        static_cast<unsigned>(gx) < static_cast<unsigned>(W) && c < C;
    const uint64_t offset = static_cast<unsigned>(gy) * row_pitch +
                            static_cast<uint64_t>(static_cast<unsigned>(gx)) * static_cast<unsigned>(pitch) +
                            static_cast<unsigned>(c);
    copy_chunk_async<T, CHUNK>(tile + chunk_offset<Window, CHUNK>(r, j, q), image + (inside ? offset : 0), inside);
  });
}

// The same from a dense image (pixels C elements apart).
template <typename Window, int THREADS, int CHUNK, int UNROLL = 4, typename T>
__device__ __forceinline__ void load_pixel_window(T* __restrict__ tile, const T* __restrict__ image,
                                                  int H, int W, int C, int y0, int x0, int c0, int tid) {
  load_pixel_window<Window, THREADS, CHUNK, UNROLL>(tile, image, H, W, C, C, y0, x0, c0, tid);
}

// The activation a depthwise kernel applies to its input tile (the composed
// backward's x = act(pre)): bf16 and fp16 in the fused kernels' packed form
// (activate_packed, about 4.5 instructions a value; the exact erf form cost
// more than the pass it replaced, benchmarks/NOTES.md step 22), float in
// ATen's exact form.
using InputActivation = PackedActivation;

// Applies the activation in place to the chunks this thread copied with
// load_pixel_window, rounding to T. A thread sees its own asynchronous
// copies once it has waited for them, so this runs before the barrier that
// publishes the tile. Zero fill stays zero: act(0) = 0.
template <typename Window, int THREADS, int CHUNK, typename T>
__device__ __forceinline__ void activate_own_chunks(T* tile, int tid, const InputActivation& act) {
  if (act.kind == Activation::NONE) return;
  for_each_own_chunk<Window, THREADS, CHUNK>(tid, [&](unsigned r, unsigned j, unsigned q) {
    T* chunk = tile + chunk_offset<Window, CHUNK>(r, j, q);
    Vec<T, CHUNK> v = load_vec<T, CHUNK>(chunk);
    if constexpr (std::is_same_v<T, float>) {
      dispatch_activation(act.kind, [&](auto a) {
#pragma unroll
        for (int e = 0; e < CHUNK; ++e) v.v[e] = activation_value<decltype(a)::value>(v.v[e]);
      });
    } else if constexpr (CHUNK == 1) {
      const uint32_t pair = activate_pair<T>(static_cast<float>(v.v[0]), 0.0f, act.form);
      v.v[0] = *reinterpret_cast<const T*>(&pair);  // the low half
    } else {
      auto* words = reinterpret_cast<uint32_t*>(v.v);
#pragma unroll
      for (int w = 0; w < CHUNK / 2; ++w) words[w] = activate_packed<T>(words[w], act.form);
    }
    store_vec<T, CHUNK>(chunk, v);
  });
}

}  // namespace cuda
}  // namespace lumenbridge

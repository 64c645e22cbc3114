// Gradient of the depthwise convolution with respect to weight and bias:
//   grad_w[c, i, j] = sum_{n, y, x} grad_out[n, c, y, x] * in[n, c, y*s + i - p, x*s + j - p]
//   grad_b[c]       = sum_{n, y, x} grad_out[n, c, y, x]
//
// Bitwise deterministic: pass 1 gives each block a fixed run of tiles of one
// channel (NCHW) or one 32-channel slab (NHWC) and reduces its partial sums in
// a fixed tree; pass 2 sums the per-block partials in a fixed order
// (partial_sums.cuh). The split depends only on the problem's shape, never on
// timing or the GPU.
//
// NCHW blocks load one tile at a time (tiles.cuh). NHWC blocks run their tiles
// through the forward kernels' pipeline (pipeline.cuh, nhwc_tiles.cuh): each
// tile's input window and grad_output block arrive in shared memory while the
// previous tile is computed. For the composed backward, the NHWC input may
// hold pre-activations: each thread applies the activation before the
// convolution (activated_depthwise.h) to its own copies of the input window
// before the barrier that publishes it.
#include <c10/cuda/CUDAGuard.h>

#include "../activated_depthwise.h"
#include "common.cuh"
#include "nhwc_tiles.cuh"
#include "partial_sums.cuh"
#include "weight_partials.cuh"
#include "tiles.cuh"

namespace lumenbridge {
namespace cuda {
namespace {

// NCHW: 32 x 32 output tiles of one plane, 32 x 8 threads, 4 rows each.
template <int K, int S, int VEC>
struct NchwWeightTile {
  static constexpr int kTX = 32, kTY = kThreads / kTX, kRows = 4;
  static constexpr int kOutW = kTX, kOutH = kTY * kRows;
  static constexpr int kInW = (kOutW - 1) * S + K, kInH = (kOutH - 1) * S + K;
  using Plane = PlaneTile<kInH, kInW, VEC, S == 2>;
};

template <typename T, int K, int S, int VEC>
__global__ void __launch_bounds__(kThreads)
    depthwise_backward_weight_nchw_kernel(const T* __restrict__ grad_output,
                                          const T* __restrict__ input,
                                          float* __restrict__ partials, int C, int H, int W,
                                          int Ho, int Wo, int tiles_x, int tiles_y,
                                          int items, int tiles_per_block, int chunks) {
  using Tile = NchwWeightTile<K, S, VEC>;
  using Plane = typename Tile::Plane;
  constexpr int kSums = K * K + 1;  // taps, then the bias
  __shared__ __align__(16) float tile[Plane::kFloats];
  __shared__ float warp_sums[kThreads / 32][kSums];

  const int chunk = blockIdx.x;
  const int c = blockIdx.y;
  const int tid = threadIdx.y * Tile::kTX + threadIdx.x;
  const int ly0 = threadIdx.y * Tile::kRows;
  const int tiles = tiles_x * tiles_y;

  float acc[kSums];
#pragma unroll
  for (int i = 0; i < kSums; ++i) acc[i] = 0.0f;

  const int first = chunk * tiles_per_block;
  const int last = min(first + tiles_per_block, items);
  for (int item = first; item < last; ++item) {
    const int64_t n = item / tiles;
    const int t = item - static_cast<int>(n) * tiles;
    const int oy0 = (t / tiles_x) * Tile::kOutH, ox0 = (t % tiles_x) * Tile::kOutW;
    const int64_t plane = n * C + c;
    const int ox = ox0 + threadIdx.x;

    // Outputs past the edge contribute zero, which keeps the compute uniform.
    float g[Tile::kRows];
#pragma unroll
    for (int r = 0; r < Tile::kRows; ++r) {
      const int oy = oy0 + ly0 + r;
      g[r] = oy < Ho && ox < Wo
                 ? static_cast<float>(grad_output[plane * Ho * Wo + static_cast<int64_t>(oy) * Wo + ox])
                 : 0.0f;
      acc[K * K] += g[r];
    }
    __syncthreads();  // the previous item's reads of the tile are done
    const int lead = Plane::template load<T, kThreads>(tile, input + plane * H * W, H, W,
                                                        oy0 * S - K / 2, ox0 * S - K / 2, tid);
    __syncthreads();

#pragma unroll
    for (int ir = 0; ir < (Tile::kRows - 1) * S + K; ++ir) {
      const float* row = tile + (ly0 * S + ir) * Plane::kPitch;
      float v[K];
#pragma unroll
      for (int kx = 0; kx < K; ++kx) v[kx] = row[Plane::column(lead + threadIdx.x * S + kx)];
#pragma unroll
      for (int r = 0; r < Tile::kRows; ++r) {
        const int ky = ir - r * S;
        if (ky >= 0 && ky < K) {
#pragma unroll
          for (int kx = 0; kx < K; ++kx) acc[ky * K + kx] = fmaf(g[r], v[kx], acc[ky * K + kx]);
        }
      }
    }
  }

  store_channel_partials<kSums>(acc, warp_sums, tid, c, chunk, chunks, partials);
}

// NHWC: the forward's tile geometry. Each thread accumulates the taps and
// bias of its four channels over the outputs it owns in every tile of the
// block's run, reading each input pixel of its window once per row.
template <typename T, int K, int S>
struct NhwcWeightTile : NhwcTile<K, S> {
  using Input = typename NhwcTile<K, S>::Input;
  using Output = typename NhwcTile<K, S>::Output;
  static constexpr int kSums = K * K + 1;  // taps, then the bias
  static constexpr int kWarps = NhwcTile<K, S>::kThreads / 32;
  static constexpr int kElems = Input::kElems + Output::kElems;
  static constexpr int kStages = pipeline_stages(kElems * sizeof(T));
  static constexpr size_t kPipelineBytes = kStages * kElems * sizeof(T);
  static constexpr size_t kReduceBytes = sizeof(float) * kWarps * kSums * NhwcTile<K, S>::kSlab;
  static constexpr size_t kSharedBytes = kPipelineBytes > kReduceBytes ? kPipelineBytes : kReduceBytes;
};

// Register caps: 128 per thread for 3 x 3 (two 256-thread blocks per SM).
template <typename T, int K, int S>
__global__ void __launch_bounds__(NhwcWeightTile<T, K, S>::kThreads, K == 3 ? 2 : 1)
    depthwise_backward_weight_nhwc_kernel(const T* __restrict__ grad_output,
                                          const T* __restrict__ input,
                                          float* __restrict__ partials, int C, int H, int W,
                                          int Ho, int Wo, int input_chunk, int grad_chunk,
                                          const InputActivation input_activation, TileSpace<3> space,
                                          int items, int tiles_per_block, int chunks) {
  using Tile = NhwcWeightTile<T, K, S>;
  using Input = typename Tile::Input;
  using Output = typename Tile::Output;
  constexpr int V = Tile::kV, R = Tile::kRows, L = Tile::kLane, kSums = Tile::kSums;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* const buffers = reinterpret_cast<T*>(shared_bytes);
  const int tid = threadIdx.x;
  const typename Tile::Thread me(tid);
  const int chunk = blockIdx.x;
  const int c0 = static_cast<int>(blockIdx.y) * Tile::kSlab;

  // Digits: tile column, tile row, image.
  auto load = [&](T* tile, const TileCursor<3>& t) {
    const int oy0 = t.digit[1] * Tile::kOutH, ox0 = t.digit[0] * Tile::kOutW;
    const int64_t n = t.digit[2];
    dispatch_chunk<T>(input_chunk, [&](auto width) {
      load_pixel_window<Input, Tile::kThreads, decltype(width)::value>(
          tile, input + n * H * W * C, H, W, C, oy0 * S - Tile::kPad, ox0 * S - Tile::kPad, c0, tid);
    });
    // Outputs past the edge are zero-filled, so they add nothing.
    dispatch_chunk<T>(grad_chunk, [&](auto width) {
      load_pixel_window<Output, Tile::kThreads, decltype(width)::value>(
          tile + Input::kElems, grad_output + n * Ho * Wo * C, Ho, Wo, C, oy0, ox0, c0, tid);
    });
  };

  auto landed = [&](T* tile) {
    dispatch_chunk<T>(input_chunk, [&](auto width) {
      activate_own_chunks<Input, Tile::kThreads, decltype(width)::value>(tile, tid, input_activation);
    });
  };

  float acc[kSums][L];
#pragma unroll
  for (int i = 0; i < kSums; ++i) {
#pragma unroll
    for (int e = 0; e < L; ++e) acc[i][e] = 0.0f;
  }
  auto compute = [&](const T* tile, const TileCursor<3>&) {
    float g[R][V][L];
    const T* grad = tile + Input::kElems + me.lane_c * L;
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const Vec<T, L> value = load_vec<T, L>(
            grad + ((me.sy * R + r) * Output::kRowPixels + Output::column(me.sx * V + v)) * Tile::kSlab);
#pragma unroll
        for (int e = 0; e < L; ++e) {
          g[r][v][e] = static_cast<float>(value.v[e]);
          acc[K * K][e] += g[r][v][e];
        }
      }
    }
    const T* window = tile + me.input_window();
#pragma unroll
    for (int ir = 0; ir < (R - 1) * S + K; ++ir) {
#pragma unroll
      for (int o = 0; o < (V - 1) * S + K; ++o) {
        const Vec<T, L> pixel = Tile::input_pixel(window, ir, o);
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
          for (int v = 0; v < V; ++v) {
            const int ky = ir - r * S, kx = o - v * S;  // compile-time once unrolled
            if (ky >= 0 && ky < K && kx >= 0 && kx < K) {
#pragma unroll
              for (int e = 0; e < L; ++e) {
                acc[ky * K + kx][e] = fmaf(g[r][v][e], static_cast<float>(pixel.v[e]), acc[ky * K + kx][e]);
              }
            }
          }
        }
      }
    }
  };
  const int first = chunk * tiles_per_block;  // items fits an int (split_work)
  run_tile_pipeline<Tile::kStages>(space, first, min(tiles_per_block, items - first), buffers,
                                   Tile::kElems, load, landed, NoStep{}, compute);

  // The tile buffers are no longer needed: the sums go through them.
  cp_async_wait_pending<0>();
  __syncthreads();
  store_slab_partials<Tile::kWarps>(acc, reinterpret_cast<float*>(shared_bytes), tid, c0, C, chunk, chunks,
                                    partials, [] { __syncthreads(); });
}

// `input_activation` is the NHWC kernel's; the entry point runs ATen's form
// before the NCHW kernels instead.
template <typename T, int K, int S>
void launch_pass1(const at::Tensor& grad_output, const at::Tensor& input, Activation input_activation,
                  float* partials, const WorkSplit& split, const DepthwiseProblem& p, cudaStream_t stream) {
  const T* go = grad_output.const_data_ptr<T>();
  const T* in = input.const_data_ptr<T>();
  const int chunks = static_cast<int>(split.chunks);
  if (p.layout == Layout::NCHW) {
    const int vec = vector_width<T>(4, p.W, {in});
    dispatch_vector_width<4>(vec, [&](auto v) {
      using Tile = NchwWeightTile<K, S, decltype(v)::value>;
      depthwise_backward_weight_nchw_kernel<T, K, S, decltype(v)::value>
          <<<dim3(grid_x(split.chunks), grid_y(p.C, "channels")), dim3(Tile::kTX, Tile::kTY), 0,
             stream>>>(go, in, partials, p.C, p.H, p.W, p.Ho, p.Wo, split.tiles_x, split.tiles_y,
                       static_cast<int>(split.items), split.tiles_per_block, chunks);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  } else {
    using Tile = NhwcWeightTile<T, K, S>;
    auto kernel = depthwise_backward_weight_nhwc_kernel<T, K, S>;
    allow_shared_bytes(kernel, Tile::kSharedBytes);
    const int64_t slabs = ceil_div64(p.C, Tile::kSlab);
    const TileSpace<3> space = tile_space<3>({split.tiles_x, split.tiles_y, p.N}, 1);
    kernel<<<dim3(grid_x(split.chunks), grid_y(slabs, "channel slabs")), Tile::kThreads,
             Tile::kSharedBytes, stream>>>(
        go, in, partials, static_cast<int>(p.C), static_cast<int>(p.H), static_cast<int>(p.W),
        static_cast<int>(p.Ho), static_cast<int>(p.Wo), chunk_width<T>(p.C, in),
        chunk_width<T>(p.C, go), InputActivation{input_activation, activation_form<T>(input_activation)}, space,
        static_cast<int>(split.items), split.tiles_per_block, chunks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> activated_depthwise_backward_weight(const at::Tensor& grad_output,
                                                                       const at::Tensor& pre,
                                                                       const DepthwiseProblem& p,
                                                                       Activation activation) {
  if (p.layout == Layout::NCHW && activation != Activation::NONE) {
    return activated_depthwise_backward_weight(grad_output, activate(pre, activation), p, Activation::NONE);
  }
  check_extents_fit_int(p);
  const c10::cuda::CUDAGuard guard(pre.device());
  const auto options = pre.options();
  at::Tensor grad_weight = new_output({p.C, 1, p.K, p.K}, options, at::MemoryFormat::Contiguous);
  at::Tensor grad_bias = new_output({p.C}, options, at::MemoryFormat::Contiguous);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int taps = static_cast<int>(p.K * p.K);
  LUMENBRIDGE_DISPATCH_CUDA_TYPES(pre.scalar_type(), "lumenbridge_depthwise_backward_weight", [&] {
    using T = scalar_t;
    dispatch_kernel_size(p.K, [&](auto k) {
      dispatch_stride(p.stride, [&](auto s) {
        constexpr int K = decltype(k)::value, S = decltype(s)::value;
        using NhwcWeight = NhwcWeightTile<T, K, S>;
        const WorkSplit split =
            p.layout == Layout::NCHW
                ? split_work<NchwWeightTile<K, S, 1>>(p, 1, kNchwBlocksPerChannel)
                : split_work<NhwcWeight>(p, ceil_div64(p.C, NhwcWeight::kSlab), kNhwcBlocks);
        // An empty batch has no chunks: one zero partial keeps pass 2 uniform.
        const int64_t chunks = std::max<int64_t>(split.chunks, 1);
        at::Tensor partials = at::zeros({p.C, chunks, taps + 1}, options.dtype(at::kFloat));
        if (split.chunks > 0) {
          launch_pass1<T, K, S>(grad_output, pre, activation, partials.mutable_data_ptr<float>(), split,
                                p, stream);
        }
        // Pass 2: each channel's taps, then its bias.
        sum_partials<T>(partials.const_data_ptr<float>(), p.C, chunks, taps + 1,
                        {grad_weight.mutable_data_ptr<T>(), grad_bias.mutable_data_ptr<T>(), taps, 1}, stream);
      });
    });
  });
  return {grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> depthwise_backward_weight(const at::Tensor& grad_output,
                                                             const at::Tensor& input,
                                                             const DepthwiseProblem& p) {
  return activated_depthwise_backward_weight(grad_output, input, p, Activation::NONE);
}

}  // namespace cuda
}  // namespace lumenbridge

// Both gradients of an NHWC stride-2 depthwise convolution whose input is
// x = act(pre), as the composed backward needs them for every stage after
// the first: the gradient of pre and the weight and bias gradients, in one
// pass over pre and grad_output (the two kernels of depthwise_backward_input.cu
// and depthwise_backward_weight.cu each read both).
//
// A tile is 8 x 8 quads of one image and a 32-channel slab: the 16 x 16 input
// pixels the quads cover, and the 8 x 8 outputs at the same indices (at
// stride 2 with K odd, Ho = ceil(H / 2)). Its shared window holds grad_output
// over the quads' reach, pre over every input pixel the tile's outputs read
// (which includes the quads' own pixels), and x = act(pre) over the same
// pixels, computed once as the tile lands. Each thread computes the gradient
// of pre at its quads (as depthwise_backward_input.cu does, with the slope
// read from pre; the taps come from shared memory, so that registers hold
// the weight sums across tiles), then adds its outputs' terms to the taps'
// and bias's sums.
// The weight sums are deterministic as depthwise_backward_weight.cu's: each
// block takes a fixed run of tiles (weight_partials.cuh) and pass 2 sums the
// blocks in a fixed order (partial_sums.cuh).
#include <c10/cuda/CUDAGuard.h>

#include "../activated_depthwise.h"
#include "common.cuh"
#include "nhwc_tiles.cuh"
#include "partial_sums.cuh"
#include "quad_tiles.cuh"
#include "weight_partials.cuh"

namespace lumenbridge {
namespace cuda {
namespace {

template <typename T, int K>
struct BothGradientsTile : NhwcLanes {
  using Reach = QuadReach<K>;
  static constexpr int kPad = K / 2;
  static constexpr int kOutW = 8, kOutH = 8;  // quads, and outputs, per tile (weight_partials.cuh's split)
  static constexpr int kRows = 2;             // quad (and output) rows per thread
  static constexpr int kThreads = kChannelThreads * kOutW * (kOutH / kRows);
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kSums = K * K + 1;  // taps, then the bias
  using Grad = PixelWindow<kOutH + Reach::kSpan, kOutW + Reach::kSpan, 1, kSlab>;
  // Input rows 2 * y0 - kPad .. 2 * (y0 + kOutH - 1) - kPad + K - 1 for the
  // outputs; the quads' own 2 * y0 .. 2 * y0 + 2 * kOutH - 1 lie inside them.
  static constexpr int kInExtent = (kOutH - 1) * 2 + K;
  static_assert(kPad + 2 * kOutH <= kInExtent, "the quads' pixels inside the window");
  // Columns de-interleaved by two: threads a quad apart read adjacent pixels.
  using Input = PixelWindow<kInExtent, kInExtent, 2, kSlab>;
  static constexpr int kPreAt = Grad::kElems, kXAt = kPreAt + Input::kElems;
  static constexpr int kElems = kXAt + Input::kElems;
  static constexpr int kStages = pipeline_stages(kElems * sizeof(T));
  static constexpr size_t kPipelineBytes = kStages * kElems * sizeof(T);
  // The sums go through the tile buffers once the pipeline is done.
  static constexpr size_t kReduceBytes = sizeof(float) * kWarps * kSums * kSlab;
  static constexpr size_t kSharedBytes = kPipelineBytes > kReduceBytes ? kPipelineBytes : kReduceBytes;
  // The taps, in float, beside the dynamic buffers.
  static constexpr size_t kTapBytes = sizeof(float) * K * K * kSlab;
  static constexpr size_t kBlockBytes = kSharedBytes + kTapBytes;
  // Where the window does not fit an sm_90 block (fp32 at K = 7), or where a
  // thread's K * K + 1 sums of four channels would not fit in registers beside
  // the input gradient's work (K = 7: 200), the two kernels run instead; so
  // they do on a device with less shared memory a block (activated_depthwise_backward).
  static constexpr bool kCovered = kBlockBytes <= static_cast<size_t>(kMaxSharedBytes) && K <= 5;
  // Two blocks an SM (128 registers) where two windows fit: half types at
  // K = 3. Elsewhere one, with the registers the sums need.
  static constexpr int kMinBlocks = K == 3 && 2 * kBlockBytes <= static_cast<size_t>(kMaxSharedBytes) ? 2 : 1;
};

template <typename T, int K>
__global__ void __launch_bounds__(BothGradientsTile<T, K>::kThreads, BothGradientsTile<T, K>::kMinBlocks)
    depthwise_backward_both_s2_nhwc_kernel(const T* __restrict__ grad_output, const T* __restrict__ weight,
                                           const T* __restrict__ pre, T* __restrict__ grad_input,
                                           float* __restrict__ partials, InputActivation activation,
                                           OutputSlope slope, int C, int H, int W, int Ho, int Wo, int grad_chunk,
                                           int pre_chunk, bool vector_stores, TileSpace<3> space, int items,
                                           int tiles_per_block, int chunks) {
  using Tile = BothGradientsTile<T, K>;
  using Grad = typename Tile::Grad;
  using Input = typename Tile::Input;
  using Reach = typename Tile::Reach;
  constexpr int L = Tile::kLane, R = Tile::kRows, kSums = Tile::kSums;
  // One chunk's address at a time: with more in flight, the weight sums
  // spill at K = 3 (128 registers for two blocks an SM).
  constexpr int kLoadUnroll = 1;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  __shared__ __align__(16) float taps[K * K][Tile::kSlab];
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

  // Digits: tile column, tile row, image.
  auto load = [&](T* tile, const TileCursor<3>& t) {
    const int64_t image = t.digit[2];
    const int y0 = t.digit[1] * Tile::kOutH, x0 = t.digit[0] * Tile::kOutW;
    dispatch_chunk<T>(grad_chunk, [&](auto width) {
      load_pixel_window<Grad, Tile::kThreads, decltype(width)::value, kLoadUnroll>(
          tile, grad_output + image * Ho * Wo * C, Ho, Wo, C, y0 + Reach::kMin, x0 + Reach::kMin, c0, tid);
    });
    dispatch_chunk<T>(pre_chunk, [&](auto width) {
      load_pixel_window<Input, Tile::kThreads, decltype(width)::value, kLoadUnroll>(
          tile + Tile::kPreAt, pre + image * H * W * C, H, W, C, 2 * y0 - Tile::kPad, 2 * x0 - Tile::kPad, c0, tid);
    });
  };
  auto landed = [&](T* tile) {
    dispatch_chunk<T>(pre_chunk, [&](auto width) {
      activate_own_chunks<Input, Tile::kThreads, decltype(width)::value>(tile + Tile::kPreAt, tile + Tile::kXAt, tid,
                                                                         activation);
    });
  };

  // The gradient of pre at this thread's quads, with the taps from shared memory.
  auto input_gradient = [&](const T* tile, const TileCursor<3>& t) {
    // A row at a time: unrolled, both rows' taps stay live and the sums spill.
#pragma unroll 1
    for (int q = 0; q < R; ++q) {
      const int la = row0 + q;
      float acc[2][2][L] = {};
      gather_quad<T, K, L, Grad::kRowPixels, Tile::kSlab>(
          tile + (la * Grad::kRowPixels + column) * Tile::kSlab + lane_c * L,
          [&](int i) { return load_vec<float, L>(&taps[i][lane_c * L]); }, acc);
      const int y = 2 * (t.digit[1] * Tile::kOutH + la), x = 2 * (t.digit[0] * Tile::kOutW + column);
      store_quad<true, T, L>(acc, grad_input + static_cast<int64_t>(t.digit[2]) * H * W * C + c, y, x, H, W, C, c,
                             vector_stores, slope,
                             [&](int py, int px) {
                               return tile + Tile::kPreAt +
                                      ((Tile::kPad + 2 * la + py) * Input::kRowPixels +
                                       Input::column(Tile::kPad + 2 * column + px)) *
                                          Tile::kSlab +
                                      lane_c * L;
                             });
    }
  };

  // The taps and bias over output (a, b): x at window rows 2a .. 2a + K - 1
  // (the window starts kPad above the quads' pixels); a thread's R outputs
  // share rows.
  float sums[kSums][L] = {};
  auto weight_sums = [&](const T* tile) {
    float g[R][L];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const Vec<T, L> value = load_vec<T, L>(
          tile + ((row0 + r - Reach::kMin) * Grad::kRowPixels + column - Reach::kMin) * Tile::kSlab + lane_c * L);
#pragma unroll
      for (int e = 0; e < L; ++e) {
        g[r][e] = static_cast<float>(value.v[e]);
        sums[K * K][e] += g[r][e];
      }
    }
    const T* x = tile + Tile::kXAt + lane_c * L;
#pragma unroll
    for (int ir = 0; ir < (R - 1) * 2 + K; ++ir) {
#pragma unroll
      for (int kx = 0; kx < K; ++kx) {
        const Vec<T, L> pixel =
            load_vec<T, L>(x + ((2 * row0 + ir) * Input::kRowPixels + Input::column(2 * column + kx)) * Tile::kSlab);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int ky = ir - 2 * r;  // compile-time once unrolled
          if (ky >= 0 && ky < K) {
#pragma unroll
            for (int e = 0; e < L; ++e) {
              sums[ky * K + kx][e] = fmaf(g[r][e], static_cast<float>(pixel.v[e]), sums[ky * K + kx][e]);
            }
          }
        }
      }
    }
  };

  const int first = chunk * tiles_per_block;  // items fits an int (split_work)
  run_tile_pipeline<Tile::kStages>(space, first, min(tiles_per_block, items - first), buffers, Tile::kElems, load,
                                   landed, NoStep{}, [&](const T* tile, const TileCursor<3>& t) {
                                     input_gradient(tile, t);
                                     weight_sums(tile);
                                   });
  cp_async_wait_pending<0>();
  __syncthreads();
  store_slab_partials<Tile::kWarps>(sums, reinterpret_cast<float*>(shared_bytes), tid, c0, C, chunk, chunks,
                                    partials, [] { __syncthreads(); });
}

template <typename T, int K>
void launch_both(const at::Tensor& grad_output, const at::Tensor& weight, const at::Tensor& pre,
                 Activation activation, at::Tensor& grad_input, float* partials, const WorkSplit& split,
                 const DepthwiseProblem& p, cudaStream_t stream) {
  using Tile = BothGradientsTile<T, K>;
  constexpr auto kernel = depthwise_backward_both_s2_nhwc_kernel<T, K>;
  allow_shared_bytes(kernel, Tile::kSharedBytes);
  const int64_t slabs = ceil_div64(p.C, Tile::kSlab);
  const TileSpace<3> space = tile_space<3>({split.tiles_x, split.tiles_y, p.N}, 1);
  const bool vector_stores = vector_width<T>(Tile::kLane, p.C, {grad_input.data_ptr()}) == Tile::kLane;
  kernel<<<dim3(grid_x(split.chunks), grid_y(slabs, "channel slabs")), Tile::kThreads, Tile::kSharedBytes,
           stream>>>(grad_output.const_data_ptr<T>(), weight.const_data_ptr<T>(), pre.const_data_ptr<T>(),
                     grad_input.mutable_data_ptr<T>(), partials,
                     InputActivation{activation, activation_form<T>(activation)},
                     OutputSlope{activation, gelu_slope_form<T>()}, static_cast<int>(p.C), static_cast<int>(p.H),
                     static_cast<int>(p.W), static_cast<int>(p.Ho), static_cast<int>(p.Wo),
                     chunk_width<T>(p.C, grad_output.const_data_ptr()), chunk_width<T>(p.C, pre.const_data_ptr()),
                     vector_stores, space, static_cast<int>(split.items), split.tiles_per_block,
                     static_cast<int>(split.chunks));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> activated_depthwise_backward(const at::Tensor& grad_output,
                                                                          const at::Tensor& weight,
                                                                          const at::Tensor& pre,
                                                                          const DepthwiseProblem& p,
                                                                          Activation activation) {
  const auto separately = [&] {
    return depthwise_backward_in_two_passes(&activated_depthwise_backward_input, &activated_depthwise_backward_weight,
                                            grad_output, weight, pre, p, activation);
  };
  if (p.stride != 2 || p.layout != Layout::NHWC || p.N * p.H * p.W * p.C == 0) return separately();
  check_extents_fit_int(p);
  const c10::cuda::CUDAGuard guard(pre.device());
  TORCH_INTERNAL_ASSERT(pre.sizes() == at::IntArrayRef({p.N, p.C, p.H, p.W}) &&
                        grad_output.sizes() == at::IntArrayRef({p.N, p.C, p.Ho, p.Wo}) &&
                        pre.is_contiguous(at::MemoryFormat::ChannelsLast) &&
                        grad_output.is_contiguous(at::MemoryFormat::ChannelsLast));
  const auto options = pre.options();
  std::tuple<at::Tensor, at::Tensor, at::Tensor> result;
  LUMENBRIDGE_DISPATCH_CUDA_TYPES(pre.scalar_type(), "lumenbridge_depthwise_backward_both", [&] {
    using T = scalar_t;
    dispatch_kernel_size(p.K, [&](auto k) {
      constexpr int K = decltype(k)::value;
      using Tile = BothGradientsTile<T, K>;
      if constexpr (!Tile::kCovered) {
        result = separately();
      } else if (Tile::kBlockBytes > max_shared_bytes_per_block()) {
        result = separately();
      } else {
        at::Tensor grad_input = new_output({p.N, p.C, p.H, p.W}, options, p.memory_format());
        at::Tensor grad_weight = new_output({p.C, 1, p.K, p.K}, options, at::MemoryFormat::Contiguous);
        at::Tensor grad_bias = new_output({p.C}, options, at::MemoryFormat::Contiguous);
        const WorkSplit split = split_work<Tile>(p, ceil_div64(p.C, Tile::kSlab), kNhwcBlocks);
        at::Tensor partials = at::empty({p.C, split.chunks, Tile::kSums}, options.dtype(at::kFloat));
        const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
        launch_both<T, K>(grad_output, weight, pre, activation, grad_input, partials.mutable_data_ptr<float>(), split,
                          p, stream);
        sum_partials<T>(partials.const_data_ptr<float>(), p.C, split.chunks, Tile::kSums,
                        {grad_weight.mutable_data_ptr<T>(), grad_bias.mutable_data_ptr<T>(), K * K, 1}, stream);
        result = {grad_input, grad_weight, grad_bias};
      }
    });
  });
  return result;
}

}  // namespace cuda
}  // namespace lumenbridge

// Gradient of the depthwise convolution with respect to its input.
//
// Stride 1: the gradient is the forward convolution of grad_output with the
//   kernel flipped in both axes (padding K / 2 is symmetric), so it reuses
//   the forward kernels.
// Stride 2: each input pixel (2a + py, 2b + px) receives only the taps whose
//   parity matches (py, px). A thread computes all four parities of a quad
//   (a, b), so which taps apply is known at compile time and the inner loops
//   stay branch-free. grad_output tiles (with halo) go through shared memory
//   as the forward input tiles do: NCHW one tile per block (tiles.cuh), NHWC
//   through the forward's persistent pipeline (pipeline.cuh).
// For the composed backward (activated_depthwise.h), the NHWC stride-2 kernel
// also multiplies each gradient by the slope of the activation before the
// convolution as it stores it; the other kernels leave that to ATen.
#include <c10/cuda/CUDAGuard.h>

#include "../activated_depthwise.h"
#include "common.cuh"
#include "depthwise_forward.cuh"
#include "nhwc_tiles.cuh"
#include "quad_tiles.cuh"
#include "tiles.cuh"

namespace lumenbridge {
namespace cuda {
namespace {

template <int K, int QX, int QROWS, int QY, int VEC>
struct NchwQuadTile {
  static constexpr int kQuadW = QX, kQuadH = QY * QROWS;
  static constexpr int kInW = kQuadW + QuadReach<K>::kSpan;
  static constexpr int kInH = kQuadH + QuadReach<K>::kSpan;
  using Plane = PlaneTile<kInH, kInW, VEC, false>;
};

template <typename T, int K, int VEC, int OUT_VEC>
__global__ void __launch_bounds__(kThreads)
    depthwise_backward_input_s2_nchw_kernel(const T* __restrict__ grad_output,
                                            const T* __restrict__ weight,
                                            T* __restrict__ grad_input, int C, int H, int W,
                                            int Ho, int Wo, int tiles_x) {
  constexpr int QX = 32, QY = kThreads / QX, QROWS = 2;
  using Tile = NchwQuadTile<K, QX, QROWS, QY, VEC>;
  using Plane = typename Tile::Plane;
  using Reach = QuadReach<K>;
  __shared__ __align__(16) float tile[Plane::kFloats];

  const int by = blockIdx.x / tiles_x;
  const int bx = blockIdx.x - by * tiles_x;
  const int c = blockIdx.y;
  const int64_t plane = static_cast<int64_t>(blockIdx.z) * C + c;
  const int qy0 = by * Tile::kQuadH, qx0 = bx * Tile::kQuadW;

  float w[K * K];
#pragma unroll
  for (int i = 0; i < K * K; ++i) w[i] = static_cast<float>(weight[c * K * K + i]);

  const int lead = Plane::template load<T, kThreads>(
      tile, grad_output + plane * Ho * Wo, Ho, Wo, qy0 + Reach::kMin, qx0 + Reach::kMin,
      threadIdx.y * QX + threadIdx.x);
  __syncthreads();

  T* out = grad_input + plane * H * W;
#pragma unroll
  for (int q = 0; q < QROWS; ++q) {
    const int la = threadIdx.y * QROWS + q;
    const int lb = threadIdx.x;
    float acc[2][2];
#pragma unroll
    for (int py = 0; py < 2; ++py) {
#pragma unroll
      for (int px = 0; px < 2; ++px) {
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < K; ++i) {
          if (!Reach::contributes(py, i)) continue;
          const float* row =
              tile + (la + Reach::offset(py, i) - Reach::kMin) * Plane::kPitch + lead + lb - Reach::kMin;
#pragma unroll
          for (int j = 0; j < K; ++j) {
            if (Reach::contributes(px, j)) sum = fmaf(w[i * K + j], row[Reach::offset(px, j)], sum);
          }
        }
        acc[py][px] = sum;
      }
    }
    const int y = 2 * (qy0 + la), x = 2 * (qx0 + lb);
#pragma unroll
    for (int py = 0; py < 2; ++py) {
      if (y + py >= H) continue;
      T* dst = out + static_cast<int64_t>(y + py) * W + x;
      if (OUT_VEC == 2) {
        if (x < W) {
          Vec<T, 2> pair;
          pair.v[0] = static_cast<T>(acc[py][0]);
          pair.v[1] = static_cast<T>(acc[py][1]);
          store_vec<T, 2>(dst, pair);
        }
      } else {
        if (x < W) dst[0] = static_cast<T>(acc[py][0]);
        if (x + 1 < W) dst[1] = static_cast<T>(acc[py][1]);
      }
    }
  }
}

// NHWC: 8 x 8 quads (16 x 16 input pixels) of one image and a slab of 32
// channels per tile, run through the forward kernels' persistent pipeline
// (pipeline.cuh): each tile's grad_output window, halo included, lands in
// shared memory while the previous tile is computed; with SLOPE, so do the
// tile's 16 x 16 pre-activations, which the stores scale by act'(pre).
// Threads run along channels, four each, then along quad columns, so a
// warp's shared reads cover four adjacent pixels' slabs; each thread owns
// kQRows quads.
template <typename T, int K, bool SLOPE>
struct NhwcQuadTile : NhwcLanes {
  static constexpr int kQX = 8, kQY = 4, kQRows = 2;
  static constexpr int kThreads = kChannelThreads * kQX * kQY;
  static constexpr int kQuadW = kQX, kQuadH = kQY * kQRows;
  using Reach = QuadReach<K>;
  using Grad = PixelWindow<kQuadH + Reach::kSpan, kQuadW + Reach::kSpan, 1, kSlab>;
  using Pre = PixelWindow<2 * kQuadH, 2 * kQuadW, 1, kSlab>;  // after Grad in a tile buffer
  static constexpr int kElems = Grad::kElems + (SLOPE ? Pre::kElems : 0);
  static constexpr int kStages = pipeline_stages(kElems * sizeof(T));
  static constexpr size_t kSharedBytes = kStages * kElems * sizeof(T);
  // Two blocks per SM at K = 3 (the slope's registers would leave one; 12
  // bytes spill instead); larger K would spill hundreds of bytes.
  static constexpr int kMinBlocks = K == 3 ? 2 : 1;
};

template <typename T, int K, bool SLOPE>
__global__ void __launch_bounds__(NhwcQuadTile<T, K, SLOPE>::kThreads, NhwcQuadTile<T, K, SLOPE>::kMinBlocks)
    depthwise_backward_input_s2_nhwc_kernel(const T* __restrict__ grad_output,
                                            const T* __restrict__ weight,
                                            T* __restrict__ grad_input, const T* __restrict__ pre,
                                            Activation slope, int C, int H, int W, int Ho, int Wo,
                                            int chunk, int pre_chunk, bool vector_stores,
                                            TileSpace<4> space, int64_t tiles) {
  using Tile = NhwcQuadTile<T, K, SLOPE>;
  using Grad = typename Tile::Grad;
  using Pre = typename Tile::Pre;
  using Reach = typename Tile::Reach;
  constexpr int L = Tile::kLane;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* const buffers = reinterpret_cast<T*>(shared_bytes);
  const int tid = threadIdx.x;
  const int lane_c = tid % Tile::kChannelThreads;
  const int qx = (tid / Tile::kChannelThreads) % Tile::kQX;
  const int qy = tid / (Tile::kChannelThreads * Tile::kQX);

  // Digits: channel slab, tile column, tile row, image. The grid is a
  // multiple of the slab count, so a block's slab (and its taps) never change.
  const int c0 = static_cast<int>(blockIdx.x % space.radix[0]) * Tile::kSlab;
  const int c = c0 + lane_c * L;
  auto load = [&](T* tile, const TileCursor<4>& t) {
    const int64_t image = t.digit[3];
    dispatch_chunk<T>(chunk, [&](auto width) {
      load_pixel_window<Grad, Tile::kThreads, decltype(width)::value>(
          tile, grad_output + image * Ho * Wo * C, Ho, Wo, C, t.digit[2] * Tile::kQuadH + Reach::kMin,
          t.digit[1] * Tile::kQuadW + Reach::kMin, c0, tid);
    });
    if constexpr (SLOPE) {
      dispatch_chunk<T>(pre_chunk, [&](auto width) {
        load_pixel_window<Pre, Tile::kThreads, decltype(width)::value>(
            tile + Grad::kElems, pre + image * H * W * C, H, W, C, 2 * t.digit[2] * Tile::kQuadH,
            2 * t.digit[1] * Tile::kQuadW, c0, tid);
      });
    }
  };

  float w[K * K][L];
#pragma unroll
  for (int e = 0; e < L; ++e) {
#pragma unroll
    for (int i = 0; i < K * K; ++i) w[i][e] = c + e < C ? static_cast<float>(weight[(c + e) * K * K + i]) : 0.0f;
  }

  auto compute = [&](const T* tile, const TileCursor<4>& t) {
#pragma unroll
    for (int q = 0; q < Tile::kQRows; ++q) {
      const int la = qy * Tile::kQRows + q;
      float acc[2][2][L] = {};
      visit_quad<T, K, L, Grad::kRowPixels, Tile::kSlab>(
          tile + (la * Grad::kRowPixels + qx) * Tile::kSlab + lane_c * L,
          [&](int py, int px, int t, const float(&g)[L]) {
#pragma unroll
            for (int e = 0; e < L; ++e) acc[py][px][e] = fmaf(w[t][e], g[e], acc[py][px][e]);
          });
      const int y = 2 * (t.digit[2] * Tile::kQuadH + la), x = 2 * (t.digit[1] * Tile::kQuadW + qx);
      store_quad<SLOPE, T, L>(acc, grad_input + static_cast<int64_t>(t.digit[3]) * H * W * C + c, y, x, H, W, C, c,
                              vector_stores, slope,
                              [&](int py, int px) {
                                return load_vec<T, L>(tile + Grad::kElems +
                                                      ((2 * la + py) * Pre::kRowPixels + 2 * qx + px) * Tile::kSlab +
                                                      lane_c * L);
                              });
    }
  };
  run_tile_pipeline<Tile::kStages>(space, blockIdx.x, persistent_tile_count(tiles), buffers,
                                   Tile::kElems, load, NoStep{}, NoStep{}, compute);
}

template <typename T, int K>
void launch_s2_nchw(const T* grad_output, const T* weight, T* grad_input,
                    const DepthwiseProblem& p, cudaStream_t stream) {
  constexpr int kQuadW = 32, kQuadH = 2 * (kThreads / 32);
  const int tiles_x = ceil_div(ceil_div(static_cast<int>(p.W), 2), kQuadW);
  const int tiles_y = ceil_div(ceil_div(static_cast<int>(p.H), 2), kQuadH);
  const int vec = vector_width<T>(4, p.Wo, {grad_output});
  const int out_vec = vector_width<T>(2, p.W, {grad_input});
  dispatch_vector_width<4>(vec, [&](auto v) {
    dispatch_vector_width<2>(out_vec, [&](auto ov) {
      for_each_batch_slice(p.N, [&](int64_t n0, unsigned count) {
        const dim3 grid(grid_x(int64_t{tiles_x} * tiles_y), grid_y(p.C, "channels"), count);
        depthwise_backward_input_s2_nchw_kernel<T, K, decltype(v)::value, decltype(ov)::value>
            <<<grid, dim3(32, kThreads / 32), 0, stream>>>(
                grad_output + n0 * p.C * p.Ho * p.Wo, weight, grad_input + n0 * p.C * p.H * p.W,
                p.C, p.H, p.W, p.Ho, p.Wo, tiles_x);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
}

// With `pre` (null when `activation` is NONE) the stores are scaled by act'(pre).
template <typename T, int K>
void launch_s2_nhwc(const T* grad_output, const T* weight, T* grad_input, const T* pre, Activation activation,
                    const DepthwiseProblem& p, cudaStream_t stream) {
  const auto launch = [&](auto slope) {
    using Tile = NhwcQuadTile<T, K, decltype(slope)::value>;
    constexpr auto kernel = depthwise_backward_input_s2_nhwc_kernel<T, K, decltype(slope)::value>;
    allow_shared_bytes(kernel, Tile::kSharedBytes);
    const int64_t slabs = ceil_div64(p.C, Tile::kSlab);
    const int64_t tiles_x = ceil_div64(ceil_div64(p.W, 2), Tile::kQuadW);
    const int64_t tiles_y = ceil_div64(ceil_div64(p.H, 2), Tile::kQuadH);
    const int64_t tiles = slabs * tiles_x * tiles_y * p.N;
    const int64_t blocks = persistent_blocks<kernel>(Tile::kThreads, Tile::kSharedBytes, tiles, slabs);
    const TileSpace<4> space = tile_space<4>({slabs, tiles_x, tiles_y, p.N}, blocks);
    const bool vector_stores = vector_width<T>(Tile::kLane, p.C, {grad_input}) == Tile::kLane;
    kernel<<<grid_x(blocks), Tile::kThreads, Tile::kSharedBytes, stream>>>(
        grad_output, weight, grad_input, pre, activation, static_cast<int>(p.C),
        static_cast<int>(p.H), static_cast<int>(p.W), static_cast<int>(p.Ho), static_cast<int>(p.Wo),
        chunk_width<T>(p.C, grad_output), chunk_width<T>(p.C, pre), vector_stores, space, tiles);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (pre != nullptr) {
    launch(std::true_type{});
  } else {
    launch(std::false_type{});
  }
}

}  // namespace

at::Tensor activated_depthwise_backward_input(const at::Tensor& grad_output, const at::Tensor& weight,
                                              const at::Tensor& pre, const DepthwiseProblem& p,
                                              Activation activation) {
  check_extents_fit_int(p);
  const c10::cuda::CUDAGuard guard(grad_output.device());
  at::Tensor grad_input = new_output({p.N, p.C, p.H, p.W}, grad_output.options(), p.memory_format());
  const bool folded = p.stride == 2 && p.layout == Layout::NHWC && activation != Activation::NONE;
  if (folded) {
    TORCH_INTERNAL_ASSERT(pre.sizes() == grad_input.sizes() && pre.is_contiguous(at::MemoryFormat::ChannelsLast));
  }
  if (grad_input.numel() == 0) return grad_input;
  if (p.stride == 1) {
    // Same extents in and out at stride 1, so the forward problem is this one.
    launch_depthwise_forward(grad_output, weight.flip({2, 3}).contiguous(), at::Tensor(), grad_input, p,
                             Activation::NONE);
  } else {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    LUMENBRIDGE_DISPATCH_CUDA_TYPES(grad_output.scalar_type(), "lumenbridge_depthwise_backward_input", [&] {
      using T = scalar_t;
      const T* go = grad_output.const_data_ptr<T>();
      const T* w = weight.const_data_ptr<T>();
      T* gi = grad_input.mutable_data_ptr<T>();
      dispatch_kernel_size(p.K, [&](auto k) {
        constexpr int K = decltype(k)::value;
        if (p.layout == Layout::NCHW) {
          launch_s2_nchw<T, K>(go, w, gi, p, stream);
        } else {
          launch_s2_nhwc<T, K>(go, w, gi, folded ? pre.const_data_ptr<T>() : nullptr, activation, p, stream);
        }
      });
    });
  }
  if (!folded) activation_backward_(grad_input, pre, activation);
  return grad_input;
}

at::Tensor depthwise_backward_input(const at::Tensor& grad_output, const at::Tensor& weight,
                                    const DepthwiseProblem& p) {
  return activated_depthwise_backward_input(grad_output, weight, at::Tensor(), p, Activation::NONE);
}

}  // namespace cuda
}  // namespace lumenbridge

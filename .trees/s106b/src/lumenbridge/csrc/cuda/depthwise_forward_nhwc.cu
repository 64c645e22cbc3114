// Depthwise K x K forward, NHWC: a persistent pipeline of shared-memory tiles
// with full halos (pipeline.cuh). Per tile: one barrier, then an unrolled,
// branch-free K x K loop that reads only shared memory.
//
// A tile is an OW x OH block of output pixels of one image and a slab of 32
// channels (geometry and loader in nhwc_tiles.cuh). Its input window, halo
// included, is copied into shared memory in the input dtype, with 16-byte
// chunks of channels where C allows; pixels outside the image are
// zero-filled by the copy itself. With an input activation (the composed
// backward's recompute), the input holds pre-activations and each thread
// applies the activation to its own copies of the window before the barrier.
#include "common.cuh"
#include "depthwise_forward.cuh"
#include "nhwc_tiles.cuh"

namespace lumenbridge {
namespace cuda {
namespace {

template <typename T, int K, int S>
struct NhwcForwardTile : NhwcTile<K, S> {
  using Input = typename NhwcTile<K, S>::Input;
  static constexpr int kElems = Input::kElems;
  static constexpr int kStages = pipeline_stages(kElems * sizeof(T));
  static constexpr size_t kSharedBytes = kStages * kElems * sizeof(T);
};

// Register caps: 128 per thread for 3 x 3 (two 256-thread blocks per SM),
// uncapped for the larger kernels' taps (K * K * 4 floats per thread).
template <typename T, int K, int S>
__global__ void __launch_bounds__(NhwcForwardTile<T, K, S>::kThreads, K == 3 ? 2 : 1)
    depthwise_forward_nhwc_kernel(const T* __restrict__ input, const T* __restrict__ weight,
                                  const T* __restrict__ bias, T* __restrict__ output, int C,
                                  int pitch, int H, int W, int Ho, int Wo, int chunk, bool vector_stores,
                                  const InputActivation input_activation, TileSpace<4> space, int64_t tiles) {
  using Tile = NhwcForwardTile<T, K, S>;
  using Input = typename Tile::Input;
  constexpr int V = Tile::kV, R = Tile::kRows, L = Tile::kLane;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* const buffers = reinterpret_cast<T*>(shared_bytes);
  const int tid = threadIdx.x;
  const typename Tile::Thread me(tid);

  // Digits: channel slab, tile column, tile row, image. The grid is a
  // multiple of the slab count, so a block's slab (and its taps) never change.
  const int c0 = static_cast<int>(blockIdx.x % space.radix[0]) * Tile::kSlab;
  const int c = c0 + me.lane_c * L;
  auto load = [&](T* tile, const TileCursor<4>& t) {
    dispatch_chunk<T>(chunk, [&](auto width) {
      load_pixel_window<Input, Tile::kThreads, decltype(width)::value>(
          tile, input + static_cast<int64_t>(t.digit[3]) * H * W * C, H, W, C,
          t.digit[2] * Tile::kOutH * S - Tile::kPad, t.digit[1] * Tile::kOutW * S - Tile::kPad, c0, tid);
    });
  };

  auto landed = [&](T* tile) {
    dispatch_chunk<T>(chunk, [&](auto width) {
      activate_own_chunks<Input, Tile::kThreads, decltype(width)::value>(tile, tid, input_activation);
    });
  };

  float w[K * K][L], b[L];
#pragma unroll
  for (int e = 0; e < L; ++e) {
    const bool real = c + e < C;
#pragma unroll
    for (int i = 0; i < K * K; ++i) w[i][e] = real ? static_cast<float>(weight[(c + e) * K * K + i]) : 0.0f;
    b[e] = real && bias != nullptr ? static_cast<float>(bias[c + e]) : 0.0f;
  }

  auto compute = [&](const T* tile, const TileCursor<4>& t) {
    float acc[R][V][L];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
#pragma unroll
        for (int e = 0; e < L; ++e) acc[r][v][e] = b[e];
      }
    }
    const T* window = tile + me.input_window();
#pragma unroll
    for (int ir = 0; ir < (R - 1) * S + K; ++ir) {
      float x[(V - 1) * S + K][L];
#pragma unroll
      for (int o = 0; o < (V - 1) * S + K; ++o) {
        const Vec<T, L> pixel = Tile::input_pixel(window, ir, o);
#pragma unroll
        for (int e = 0; e < L; ++e) x[o][e] = static_cast<float>(pixel.v[e]);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int ky = ir - r * S;  // compile-time once unrolled: no branch survives
        if (ky >= 0 && ky < K) {
#pragma unroll
          for (int v = 0; v < V; ++v) {
#pragma unroll
            for (int kx = 0; kx < K; ++kx) {
#pragma unroll
              for (int e = 0; e < L; ++e) {
                acc[r][v][e] = fmaf(w[ky * K + kx][e], x[v * S + kx][e], acc[r][v][e]);
              }
            }
          }
        }
      }
    }

    const int64_t image = t.digit[3];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int oy = t.digit[2] * Tile::kOutH + me.sy * R + r;
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const int ox = t.digit[1] * Tile::kOutW + me.sx * V + v;
        if (oy >= Ho || ox >= Wo) continue;
        T* dst = output + ((image * Ho + oy) * Wo + ox) * pitch + c;
        if (vector_stores && c + L <= C) {
          Vec<T, L> result;
#pragma unroll
          for (int e = 0; e < L; ++e) result.v[e] = static_cast<T>(acc[r][v][e]);
          store_vec<T, L>(dst, result);
        } else {
#pragma unroll
          for (int e = 0; e < L; ++e) {
            if (c + e < C) dst[e] = static_cast<T>(acc[r][v][e]);
          }
        }
      }
    }
  };
  run_tile_pipeline<Tile::kStages>(space, blockIdx.x, persistent_tile_count(tiles), buffers,
                                   Tile::kElems, load, landed, NoStep{}, compute);
}

template <typename T, int K, int S>
void launch(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
            at::Tensor& output, const DepthwiseProblem& p, Activation input_activation) {
  using Tile = NhwcForwardTile<T, K, S>;
  constexpr auto kernel = depthwise_forward_nhwc_kernel<T, K, S>;
  allow_shared_bytes(kernel, Tile::kSharedBytes);
  const T* in = input.const_data_ptr<T>();
  T* out = output.mutable_data_ptr<T>();
  const int64_t slabs = ceil_div64(p.C, Tile::kSlab);
  const int64_t tiles_x = ceil_div64(p.Wo, Tile::kOutW), tiles_y = ceil_div64(p.Ho, Tile::kOutH);
  const int64_t tiles = slabs * tiles_x * tiles_y * p.N;
  const int64_t blocks = persistent_blocks<kernel>(Tile::kThreads, Tile::kSharedBytes, tiles, slabs);
  const TileSpace<4> space = tile_space<4>({slabs, tiles_x, tiles_y, p.N}, blocks);
  // Pixels `pitch` elements apart: C for a dense output, more for GEMM rows.
  const int64_t pitch = output.stride(3);
  TORCH_INTERNAL_ASSERT(output.stride(1) == 1 && pitch >= p.C && output.stride(2) == pitch * p.Wo &&
                            output.stride(0) == output.stride(2) * p.Ho,
                        "the NHWC forward writes pixels of dense channels in dense rows");
  const bool vector_stores = vector_width<T>(Tile::kLane, p.C, {out}) == Tile::kLane && pitch % Tile::kLane == 0;
  kernel<<<grid_x(blocks), Tile::kThreads, Tile::kSharedBytes, c10::cuda::getCurrentCUDAStream()>>>(
      in, weight.const_data_ptr<T>(), bias.defined() ? bias.const_data_ptr<T>() : nullptr, out,
      static_cast<int>(p.C), static_cast<int>(pitch), static_cast<int>(p.H), static_cast<int>(p.W),
      static_cast<int>(p.Ho), static_cast<int>(p.Wo), chunk_width<T>(p.C, in), vector_stores,
      InputActivation{input_activation, activation_form<T>(input_activation)}, space, tiles);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void launch_depthwise_forward_nhwc(const at::Tensor& input, const at::Tensor& weight,
                                   const at::Tensor& bias, at::Tensor& output,
                                   const DepthwiseProblem& p, Activation input_activation) {
  LUMENBRIDGE_DISPATCH_CUDA_TYPES(input.scalar_type(), "lumenbridge_depthwise_forward_nhwc", [&] {
    dispatch_kernel_size(p.K, [&](auto k) {
      dispatch_stride(p.stride, [&](auto s) {
        launch<scalar_t, decltype(k)::value, decltype(s)::value>(input, weight, bias, output, p,
                                                                 input_activation);
      });
    });
  });
}

}  // namespace cuda
}  // namespace lumenbridge

// Gradient of the depthwise convolution with respect to weight and bias:
//   grad_w[c, i, j] = sum_{n, y, x} grad_out[n, c, y, x] * in[n, c, y*s + i - p, x*s + j - p]
//   grad_b[c]       = sum_{n, y, x} grad_out[n, c, y, x]
//
// Bitwise deterministic: pass 1 gives each block a fixed run of tiles of one
// channel (NCHW) or one 32-channel slab (NHWC) and reduces its partial sums in
// a fixed tree; pass 2 sums the per-block partials in order. The split depends
// only on the problem's shape, never on timing or the GPU.
#include <c10/cuda/CUDAGuard.h>

#include "../gateway.h"
#include "common.cuh"
#include "tiles.cuh"

namespace lumenbridge {
namespace cuda {
namespace {

// Tiles per block in pass 1: enough work per block to amortize its final
// reduction, while leaving thousands of blocks for large batches.
constexpr int kTilesPerBlock = 8;

// Sums `value` over the 32 lanes of a warp in a fixed order; lane 0 holds it.
__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  return value;
}

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
                                          int items, int chunks) {
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

  const int first = chunk * kTilesPerBlock;
  const int last = min(first + kTilesPerBlock, items);
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

  const int warp = tid / 32, lane = tid % 32;
#pragma unroll
  for (int i = 0; i < kSums; ++i) {
    const float s = warp_sum(acc[i]);
    if (lane == 0) warp_sums[warp][i] = s;
  }
  __syncthreads();
  if (tid < kSums) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w][tid];
    partials[(static_cast<int64_t>(c) * chunks + chunk) * kSums + tid] = total;
  }
}

// NHWC: 32 channels (one per lane) x 8 warps; each warp owns one output row
// of an 8 x 8 tile and walks its 8 columns.
template <typename T, int K, int S>
struct NhwcWeightTile {
  static constexpr int kChannels = 32, kOutW = 8, kOutH = kThreads / kChannels;
  static constexpr int kInW = (kOutW - 1) * S + K, kInH = (kOutH - 1) * S + K;
  static constexpr size_t kSharedBytes = sizeof(T) * kInH * kInW * kChannels;
};

template <typename T, int K, int S, int VEC>
__global__ void __launch_bounds__(kThreads)
    depthwise_backward_weight_nhwc_kernel(const T* __restrict__ grad_output,
                                          const T* __restrict__ input,
                                          float* __restrict__ partials, int C, int H, int W,
                                          int Ho, int Wo, int tiles_x, int tiles_y,
                                          int items, int chunks) {
  using Tile = NhwcWeightTile<T, K, S>;
  constexpr int kCh = Tile::kChannels;
  constexpr int kSums = K * K + 1;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* tile = reinterpret_cast<T*>(shared_bytes);
  __shared__ float warp_sums[Tile::kOutH][kCh];

  const int chunk = blockIdx.x;
  const int slab = blockIdx.y;
  const int lane = threadIdx.x, ly = threadIdx.y;
  const int c0 = slab * kCh;
  const int c = c0 + lane;
  const int tiles = tiles_x * tiles_y;

  float acc[kSums];
#pragma unroll
  for (int i = 0; i < kSums; ++i) acc[i] = 0.0f;

  const int first = chunk * kTilesPerBlock;
  const int last = min(first + kTilesPerBlock, items);
  for (int item = first; item < last; ++item) {
    const int64_t n = item / tiles;
    const int t = item - static_cast<int>(n) * tiles;
    const int oy0 = (t / tiles_x) * Tile::kOutH, ox0 = (t % tiles_x) * Tile::kOutW;
    const int oy = oy0 + ly;

    float g[Tile::kOutW];
#pragma unroll
    for (int x = 0; x < Tile::kOutW; ++x) {
      const int ox = ox0 + x;
      g[x] = oy < Ho && ox < Wo && c < C
                 ? static_cast<float>(grad_output[((n * Ho + oy) * Wo + ox) * C + c])
                 : 0.0f;
      acc[K * K] += g[x];
    }
    __syncthreads();
    load_pixel_tile<T, Tile::kInH, Tile::kInW, kCh / VEC, VEC, kThreads>(
        tile, input + n * H * W * C, H, W, C, oy0 * S - K / 2, ox0 * S - K / 2, c0,
        ly * kCh + lane);
    __syncthreads();

    // Walk input columns once; each feeds the outputs whose window covers it.
#pragma unroll
    for (int ic = 0; ic < (Tile::kOutW - 1) * S + K; ++ic) {
      float v[K];
#pragma unroll
      for (int ky = 0; ky < K; ++ky) {
        v[ky] = static_cast<float>(tile[((ly * S + ky) * Tile::kInW + ic) * kCh + lane]);
      }
#pragma unroll
      for (int x = 0; x < Tile::kOutW; ++x) {
        const int kx = ic - x * S;
        if (kx >= 0 && kx < K) {
#pragma unroll
          for (int ky = 0; ky < K; ++ky) acc[ky * K + kx] = fmaf(g[x], v[ky], acc[ky * K + kx]);
        }
      }
    }
  }

  // Sum the warps' rows in a fixed order, one tap at a time.
#pragma unroll
  for (int i = 0; i < kSums; ++i) {
    __syncthreads();
    warp_sums[ly][lane] = acc[i];
    __syncthreads();
    if (ly == 0) {
      float total = 0.0f;
#pragma unroll
      for (int w = 0; w < Tile::kOutH; ++w) total += warp_sums[w][lane];
      if (c < C) partials[(static_cast<int64_t>(c) * chunks + chunk) * kSums + i] = total;
    }
  }
}

// Pass 2: one thread per (channel, tap or bias) sums the chunks in order.
template <typename T>
__global__ void depthwise_weight_sum_partials_kernel(const float* __restrict__ partials, T* __restrict__ grad_weight,
                                    T* __restrict__ grad_bias, int C, int taps, int chunks) {
  const int sums = taps + 1;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= static_cast<int64_t>(C) * sums) return;
  const int c = static_cast<int>(index / sums), i = static_cast<int>(index % sums);
  const float* p = partials + static_cast<int64_t>(c) * chunks * sums + i;
  float total = 0.0f;
  for (int k = 0; k < chunks; ++k) total += p[static_cast<int64_t>(k) * sums];
  if (i < taps) {
    grad_weight[static_cast<int64_t>(c) * taps + i] = static_cast<T>(total);
  } else {
    grad_bias[c] = static_cast<T>(total);
  }
}

// How pass 1 splits one channel's work: `items` tiles over the batch, in
// `chunks` runs of kTilesPerBlock. A function of the shape alone.
struct WorkSplit {
  int tiles_x, tiles_y;
  int64_t items, chunks;
};

template <typename Tile>
WorkSplit split_work(const DepthwiseProblem& p) {
  WorkSplit split;
  split.tiles_x = ceil_div(static_cast<int>(p.Wo), Tile::kOutW);
  split.tiles_y = ceil_div(static_cast<int>(p.Ho), Tile::kOutH);
  split.items = p.N * split.tiles_x * split.tiles_y;
  TORCH_CHECK(split.items <= std::numeric_limits<int32_t>::max(),
              "LumenBridge: batch too large for one weight-gradient launch (", text(split.items),
              " tiles)");
  split.chunks = ceil_div64(split.items, kTilesPerBlock);
  return split;
}

template <typename T, int K, int S>
void launch_pass1(const T* grad_output, const T* input, float* partials, const WorkSplit& split,
                  const DepthwiseProblem& p, cudaStream_t stream) {
  const int chunks = static_cast<int>(split.chunks);
  if (p.layout == Layout::NCHW) {
    const int vec = vector_width<T>(4, p.W, {input});
    dispatch_vector_width<4>(vec, [&](auto v) {
      using Tile = NchwWeightTile<K, S, decltype(v)::value>;
      depthwise_backward_weight_nchw_kernel<T, K, S, decltype(v)::value>
          <<<dim3(grid_x(split.chunks), grid_y(p.C, "channels")), dim3(Tile::kTX, Tile::kTY), 0,
             stream>>>(grad_output, input, partials, p.C, p.H, p.W, p.Ho, p.Wo, split.tiles_x,
                       split.tiles_y, static_cast<int>(split.items), chunks);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  } else {
    using Tile = NhwcWeightTile<T, K, S>;
    const int slabs = ceil_div(static_cast<int>(p.C), Tile::kChannels);
    const int vec = vector_width<T>(4, p.C, {input});
    dispatch_vector_width<4>(vec, [&](auto v) {
      auto kernel = depthwise_backward_weight_nhwc_kernel<T, K, S, decltype(v)::value>;
      allow_shared_bytes(kernel, Tile::kSharedBytes);
      kernel<<<dim3(grid_x(split.chunks), grid_y(slabs, "channel slabs")),
               dim3(Tile::kChannels, Tile::kOutH), Tile::kSharedBytes, stream>>>(
          grad_output, input, partials, p.C, p.H, p.W, p.Ho, p.Wo, split.tiles_x, split.tiles_y,
          static_cast<int>(split.items), chunks);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> depthwise_backward_weight(const at::Tensor& grad_output,
                                                             const at::Tensor& input,
                                                             const DepthwiseProblem& p) {
  const c10::cuda::CUDAGuard guard(input.device());
  const auto options = input.options();
  at::Tensor grad_weight = new_output({p.C, 1, p.K, p.K}, options, at::MemoryFormat::Contiguous);
  at::Tensor grad_bias = new_output({p.C}, options, at::MemoryFormat::Contiguous);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int taps = static_cast<int>(p.K * p.K);
  LUMENBRIDGE_DISPATCH_CUDA_TYPES(input.scalar_type(), "lumenbridge_depthwise_backward_weight", [&] {
    using T = scalar_t;
    dispatch_kernel_size(p.K, [&](auto k) {
      dispatch_stride(p.stride, [&](auto s) {
        constexpr int K = decltype(k)::value, S = decltype(s)::value;
        const WorkSplit split = p.layout == Layout::NCHW ? split_work<NchwWeightTile<K, S, 1>>(p)
                                                          : split_work<NhwcWeightTile<T, K, S>>(p);
        // An empty batch has no chunks: one zero partial keeps pass 2 uniform.
        const int64_t chunks = std::max<int64_t>(split.chunks, 1);
        at::Tensor partials = at::zeros({p.C, chunks, taps + 1}, options.dtype(at::kFloat));
        if (split.chunks > 0) {
          launch_pass1<T, K, S>(grad_output.const_data_ptr<T>(), input.const_data_ptr<T>(),
                                partials.mutable_data_ptr<float>(), split, p, stream);
        }
        const int64_t sums = p.C * (taps + 1);
        depthwise_weight_sum_partials_kernel<T><<<grid_x(ceil_div64(sums, kThreads)), kThreads, 0, stream>>>(
            partials.const_data_ptr<float>(), grad_weight.mutable_data_ptr<T>(),
            grad_bias.mutable_data_ptr<T>(), static_cast<int>(p.C), taps,
            static_cast<int>(chunks));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return {grad_weight, grad_bias};
}

}  // namespace cuda
}  // namespace lumenbridge

// Depthwise K x K forward: shared-memory tiles with full halos, one barrier,
// then an unrolled, branch-free K x K loop that reads only shared memory.
//
// NCHW: a block owns one (n, c) plane's output tile; warps run along rows so
//   global loads and stores are coalesced (16-byte vectors where W allows).
// NHWC: a block owns a spatial tile and a slab of channels; threads run along
//   channels so each pixel's slab moves as contiguous vectors.
// Each thread computes ROWS consecutive output rows of one column, so every
// input row it needs is read from shared memory once and reused for all the
// output rows it touches.
#include <c10/cuda/CUDAGuard.h>

#include "common.cuh"
#include "depthwise_forward.cuh"
#include "tiles.cuh"

namespace lumenbridge {
namespace cuda {
namespace {

// NCHW tile shapes: TX threads along a row, kThreads / TX rows of threads,
// ROWS output rows per thread: 32 x 64 output tiles for tall planes, 32 x 32
// for planes at most 32 tall, 16 x 16 for planes at most 16 wide, so that few
// lanes idle at the plane's edges.
template <int K, int S, int TX, int ROWS, int VEC>
struct NchwTile {
  static constexpr int kTY = kThreads / TX;
  static constexpr int kOutW = TX;
  static constexpr int kOutH = kTY * ROWS;
  static constexpr int kInW = (kOutW - 1) * S + K;
  static constexpr int kInH = (kOutH - 1) * S + K;
  // A 16-wide block puts two rows in a warp; a 32-wide warp reads one row.
  using Plane = PlaneTile<kInH, kInW, VEC, S == 2, TX == 16>;
};

// Register caps for the 3 x 3 kernels, so registers do not limit occupancy
// below what shared memory allows (benchmarks/NOTES.md): 8 blocks of 256
// threads for stride 1, 6 for the larger stride-2 tiles, 4 for NHWC's
// per-thread channel vectors. Larger kernels keep their taps in registers
// uncapped rather than spill.
template <typename T, int K, int S, int VEC, int TX, int ROWS>
__global__ void __launch_bounds__(kThreads, K == 3 ? (S == 1 ? 8 : 6) : 1)
    depthwise_forward_nchw_kernel(const T* __restrict__ input, const T* __restrict__ weight,
                                  const T* __restrict__ bias, T* __restrict__ output, int C,
                                  int H, int W, int Ho, int Wo, int tiles_x) {
  using Plane = typename NchwTile<K, S, TX, ROWS, VEC>::Plane;
  using Tile = NchwTile<K, S, TX, ROWS, VEC>;
  __shared__ __align__(16) float tile[Plane::kFloats];

  const int by = blockIdx.x / tiles_x;
  const int bx = blockIdx.x - by * tiles_x;
  const int c = blockIdx.y;
  const int64_t plane = static_cast<int64_t>(blockIdx.z) * C + c;
  const int oy0 = by * Tile::kOutH;
  const int ox0 = bx * Tile::kOutW;

  // The channel's taps and bias go to registers while the tile loads.
  float w[K * K];
#pragma unroll
  for (int i = 0; i < K * K; ++i) w[i] = static_cast<float>(weight[c * K * K + i]);
  const float b = bias != nullptr ? static_cast<float>(bias[c]) : 0.0f;

  const int lead = Plane::template load<T, kThreads>(
      tile, input + plane * H * W, H, W, oy0 * S - K / 2, ox0 * S - K / 2,
      threadIdx.y * TX + threadIdx.x);
  __syncthreads();

  int col[K];
#pragma unroll
  for (int kx = 0; kx < K; ++kx) col[kx] = Plane::column(lead + threadIdx.x * S + kx);
  const int ly0 = threadIdx.y * ROWS;
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = b;
#pragma unroll
  for (int ir = 0; ir < (ROWS - 1) * S + K; ++ir) {
    const float* row = tile + (ly0 * S + ir) * Plane::kPitch;
    float v[K];
#pragma unroll
    for (int kx = 0; kx < K; ++kx) v[kx] = row[col[kx]];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int ky = ir - r * S;  // compile-time once unrolled: no branch survives
      if (ky >= 0 && ky < K) {
#pragma unroll
        for (int kx = 0; kx < K; ++kx) acc[r] = fmaf(w[ky * K + kx], v[kx], acc[r]);
      }
    }
  }

  T* out = output + plane * Ho * Wo;
  const int ox = ox0 + threadIdx.x;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int oy = oy0 + ly0 + r;
    if (oy < Ho && ox < Wo) out[static_cast<int64_t>(oy) * Wo + ox] = static_cast<T>(acc[r]);
  }
}

// NHWC tile: CV threads share a pixel (VEC channels each), SX x SY threads
// tile the output plane, each computing ROWS consecutive rows.
template <typename T, int K, int S, int VEC>
struct NhwcTile {
  static constexpr int kCV = 8, kSX = 8, kSY = kThreads / (kCV * kSX);
  static constexpr int kRows = S == 1 ? 4 : 2;
  static constexpr int kSlab = kCV * VEC;
  static constexpr int kOutW = kSX, kOutH = kSY * kRows;
  static constexpr int kInW = (kOutW - 1) * S + K;
  static constexpr int kInH = (kOutH - 1) * S + K;
  using Map = ColumnMap<kInW, S == 2>;
  static constexpr size_t kSharedBytes = sizeof(T) * kInH * Map::kWidth * kSlab;
};

template <typename T, int K, int S, int VEC>
__global__ void __launch_bounds__(kThreads, K == 3 ? 4 : 1)
    depthwise_forward_nhwc_kernel(const T* __restrict__ input, const T* __restrict__ weight,
                                  const T* __restrict__ bias, T* __restrict__ output, int C,
                                  int H, int W, int Ho, int Wo, int slabs) {
  using Tile = NhwcTile<T, K, S, VEC>;
  using Map = typename Tile::Map;
  constexpr int ROWS = Tile::kRows;
  constexpr int kSlab = Tile::kSlab;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* tile = reinterpret_cast<T*>(shared_bytes);
  // The slab's taps ([tap][channel]) and bias, staged once per block.
  __shared__ __align__(16) float taps[K * K + 1][kSlab];

  const int slab = blockIdx.x % slabs;
  const int bx = blockIdx.x / slabs;  // slabs vary fastest: one pixel's channels load together
  const int by = blockIdx.y;
  const int64_t n = blockIdx.z;
  const int oy0 = by * Tile::kOutH;
  const int ox0 = bx * Tile::kOutW;
  const int cv = threadIdx.x, sx = threadIdx.y, sy = threadIdx.z;
  const int tid = (sy * Tile::kSX + sx) * Tile::kCV + cv;
  const int c0 = slab * kSlab;
  const int c = c0 + cv * VEC;

  for (int i = tid; i < (K * K + 1) * kSlab; i += kThreads) {
    const int t = i / kSlab, ch = c0 + i % kSlab;
    float value = 0.0f;
    if (ch < C) {
      if (t < K * K) {
        value = static_cast<float>(weight[ch * K * K + t]);
      } else if (bias != nullptr) {
        value = static_cast<float>(bias[ch]);
      }
    }
    taps[t][i % kSlab] = value;
  }
  load_pixel_tile<T, Tile::kInH, Tile::kInW, Tile::kCV, VEC, S == 2, kThreads>(
      tile, input + n * H * W * C, H, W, C, oy0 * S - K / 2, ox0 * S - K / 2, c0, tid);
  __syncthreads();

  float w[K * K][VEC];
  float acc[ROWS][VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
#pragma unroll
    for (int i = 0; i < K * K; ++i) w[i][e] = taps[i][cv * VEC + e];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r][e] = taps[K * K][cv * VEC + e];
  }

  const int ly0 = sy * ROWS;
#pragma unroll
  for (int ir = 0; ir < (ROWS - 1) * S + K; ++ir) {
    const T* row = tile + (ly0 * S + ir) * Map::kWidth * Tile::kSlab + cv * VEC;
    float v[K][VEC];
#pragma unroll
    for (int kx = 0; kx < K; ++kx) {
      const Vec<T, VEC> pixel = load_vec<T, VEC>(row + Map::phys(sx * S + kx) * Tile::kSlab);
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[kx][e] = static_cast<float>(pixel.v[e]);
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int ky = ir - r * S;
      if (ky >= 0 && ky < K) {
#pragma unroll
        for (int kx = 0; kx < K; ++kx) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[r][e] = fmaf(w[ky * K + kx][e], v[kx][e], acc[r][e]);
        }
      }
    }
  }

  const int ox = ox0 + sx;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int oy = oy0 + ly0 + r;
    if (oy < Ho && ox < Wo && c < C) {
      Vec<T, VEC> result;
#pragma unroll
      for (int e = 0; e < VEC; ++e) result.v[e] = static_cast<T>(acc[r][e]);
      store_vec<T, VEC>(output + ((n * Ho + oy) * Wo + ox) * C + c, result);
    }
  }
}

template <typename T, int K, int S, int VEC, int TX, int ROWS>
void launch_nchw(const T* input, const T* weight, const T* bias, T* output,
                 const DepthwiseProblem& p, cudaStream_t stream) {
  using Tile = NchwTile<K, S, TX, ROWS, VEC>;
  const int tiles_x = ceil_div(static_cast<int>(p.Wo), Tile::kOutW);
  const int tiles_y = ceil_div(static_cast<int>(p.Ho), Tile::kOutH);
  for_each_batch_slice(p.N, [&](int64_t n0, unsigned count) {
    const dim3 grid(grid_x(int64_t{tiles_x} * tiles_y), grid_y(p.C, "channels"), count);
    depthwise_forward_nchw_kernel<T, K, S, VEC, TX, ROWS><<<grid, dim3(TX, Tile::kTY), 0, stream>>>(
        input + n0 * p.C * p.H * p.W, weight, bias, output + n0 * p.C * p.Ho * p.Wo, p.C, p.H,
        p.W, p.Ho, p.Wo, tiles_x);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename T, int K, int S, int VEC>
void launch_nhwc(const T* input, const T* weight, const T* bias, T* output,
                 const DepthwiseProblem& p, cudaStream_t stream) {
  using Tile = NhwcTile<T, K, S, VEC>;
  const int tiles_x = ceil_div(static_cast<int>(p.Wo), Tile::kOutW);
  const int tiles_y = ceil_div(static_cast<int>(p.Ho), Tile::kOutH);
  const int slabs = ceil_div(static_cast<int>(p.C), Tile::kSlab);
  auto kernel = depthwise_forward_nhwc_kernel<T, K, S, VEC>;
  allow_shared_bytes(kernel, Tile::kSharedBytes);
  for_each_batch_slice(p.N, [&](int64_t n0, unsigned count) {
    const dim3 grid(grid_x(int64_t{slabs} * tiles_x), grid_y(tiles_y, "output tile rows"), count);
    kernel<<<grid, dim3(Tile::kCV, Tile::kSX, Tile::kSY), Tile::kSharedBytes, stream>>>(
        input + n0 * p.H * p.W * p.C, weight, bias, output + n0 * p.Ho * p.Wo * p.C, p.C, p.H,
        p.W, p.Ho, p.Wo, slabs);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

void launch_depthwise_forward(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& bias, at::Tensor& output,
                              const DepthwiseProblem& p) {
  if (output.numel() == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  LUMENBRIDGE_DISPATCH_CUDA_TYPES(input.scalar_type(), "lumenbridge_depthwise_forward", [&] {
    using T = scalar_t;
    const T* in = input.const_data_ptr<T>();
    const T* w = weight.const_data_ptr<T>();
    const T* b = bias.defined() ? bias.const_data_ptr<T>() : nullptr;
    T* out = output.mutable_data_ptr<T>();
    dispatch_kernel_size(p.K, [&](auto k) {
      dispatch_stride(p.stride, [&](auto s) {
        constexpr int K = decltype(k)::value, S = decltype(s)::value;
        if (p.layout == Layout::NCHW) {
          const int vec = vector_width<T>(4, p.W, {in});
          dispatch_vector_width<4>(vec, [&](auto v) {
            constexpr int VEC = decltype(v)::value;
            if (p.Wo <= 16) {
              launch_nchw<T, K, S, VEC, 16, 1>(in, w, b, out, p, stream);
            } else if (p.Ho <= 32) {
              launch_nchw<T, K, S, VEC, 32, 4>(in, w, b, out, p, stream);
            } else {
              launch_nchw<T, K, S, VEC, 32, 8>(in, w, b, out, p, stream);
            }
          });
        } else {
          const int vec = vector_width<T>(4, p.C, {in, out});
          dispatch_vector_width<4>(vec, [&](auto v) {
            launch_nhwc<T, K, S, decltype(v)::value>(in, w, b, out, p, stream);
          });
        }
      });
    });
  });
}

at::Tensor depthwise_forward(const at::Tensor& input, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, const DepthwiseProblem& p) {
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor output = new_output({p.N, p.C, p.Ho, p.Wo}, input.options(), p.memory_format());
  launch_depthwise_forward(input, weight, bias.has_value() ? *bias : at::Tensor(), output, p);
  return output;
}

}  // namespace cuda
}  // namespace lumenbridge

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
// ROWS output rows per thread. Wide planes use 32 x 32 output tiles; planes
// at most 16 wide use the 16 x 16 tile so fewer lanes idle.
template <int K, int S, int TX, int ROWS>
struct NchwTile {
  static constexpr int kTY = kThreads / TX;
  static constexpr int kOutW = TX;
  static constexpr int kOutH = kTY * ROWS;
  static constexpr int kInW = (kOutW - 1) * S + K;
  static constexpr int kInH = (kOutH - 1) * S + K;
  using Map = ColumnMap<kInW, S == 2>;
  // A 16-wide block puts two rows in a warp; rows 16 banks apart keep their
  // reads conflict-free. A 32-wide warp reads within one row.
  static constexpr int kPitch = TX == 32 ? Map::kWidth : Map::kWidth + (48 - Map::kWidth % 32) % 32;
};

template <typename T, int K, int S, int VEC, int TX, int ROWS>
__global__ void __launch_bounds__(kThreads)
    depthwise_forward_nchw_kernel(const T* __restrict__ input, const T* __restrict__ weight,
                                  const T* __restrict__ bias, T* __restrict__ output, int C,
                                  int H, int W, int Ho, int Wo, int tiles_x, int tiles_y) {
  using Tile = NchwTile<K, S, TX, ROWS>;
  using Map = typename Tile::Map;
  __shared__ float tile[Tile::kInH * Tile::kPitch];

  int64_t block = blockIdx.x;
  const int bx = static_cast<int>(block % tiles_x);
  block /= tiles_x;
  const int by = static_cast<int>(block % tiles_y);
  const int64_t plane = block / tiles_y;
  const int c = static_cast<int>(plane % C);
  const int oy0 = by * Tile::kOutH;
  const int ox0 = bx * Tile::kOutW;

  // The channel's taps and bias go to registers while the tile loads.
  float w[K * K];
#pragma unroll
  for (int i = 0; i < K * K; ++i) w[i] = static_cast<float>(weight[c * K * K + i]);
  const float b = bias != nullptr ? static_cast<float>(bias[c]) : 0.0f;

  load_plane_tile<T, Tile::kInH, Tile::kInW, Tile::kPitch, VEC, S == 2, kThreads>(
      tile, input + plane * H * W, H, W, oy0 * S - K / 2, ox0 * S - K / 2,
      threadIdx.y * TX + threadIdx.x);
  __syncthreads();

  const int ly0 = threadIdx.y * ROWS;
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = b;
#pragma unroll
  for (int ir = 0; ir < (ROWS - 1) * S + K; ++ir) {
    const float* row = tile + (ly0 * S + ir) * Tile::kPitch;
    float v[K];
#pragma unroll
    for (int kx = 0; kx < K; ++kx) v[kx] = row[Map::phys(threadIdx.x * S + kx)];
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
__global__ void __launch_bounds__(kThreads)
    depthwise_forward_nhwc_kernel(const T* __restrict__ input, const T* __restrict__ weight,
                                  const T* __restrict__ bias, T* __restrict__ output, int C,
                                  int H, int W, int Ho, int Wo, int tiles_x, int tiles_y,
                                  int slabs) {
  using Tile = NhwcTile<T, K, S, VEC>;
  using Map = typename Tile::Map;
  constexpr int ROWS = Tile::kRows;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* tile = reinterpret_cast<T*>(shared_bytes);

  // Slabs vary fastest, so the blocks reading one pixel's channels run together.
  int64_t block = blockIdx.x;
  const int slab = static_cast<int>(block % slabs);
  block /= slabs;
  const int bx = static_cast<int>(block % tiles_x);
  block /= tiles_x;
  const int by = static_cast<int>(block % tiles_y);
  const int64_t n = block / tiles_y;
  const int oy0 = by * Tile::kOutH;
  const int ox0 = bx * Tile::kOutW;
  const int cv = threadIdx.x, sx = threadIdx.y, sy = threadIdx.z;
  const int c0 = slab * Tile::kSlab;
  const int c = c0 + cv * VEC;

  float w[K * K][VEC];
  float acc[ROWS][VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const bool valid = c + e < C;
#pragma unroll
    for (int i = 0; i < K * K; ++i) {
      w[i][e] = valid ? static_cast<float>(weight[(c + e) * K * K + i]) : 0.0f;
    }
    const float b = valid && bias != nullptr ? static_cast<float>(bias[c + e]) : 0.0f;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r][e] = b;
  }

  load_pixel_tile<T, Tile::kInH, Tile::kInW, Tile::kCV, VEC, S == 2, kThreads>(
      tile, input + n * H * W * C, H, W, C, oy0 * S - K / 2, ox0 * S - K / 2, c0,
      (sy * Tile::kSX + sx) * Tile::kCV + cv);
  __syncthreads();

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
  using Tile = NchwTile<K, S, TX, ROWS>;
  const int tiles_x = ceil_div(static_cast<int>(p.Wo), Tile::kOutW);
  const int tiles_y = ceil_div(static_cast<int>(p.Ho), Tile::kOutH);
  const unsigned grid = grid_size(p.N * p.C * tiles_x * tiles_y);
  depthwise_forward_nchw_kernel<T, K, S, VEC, TX, ROWS>
      <<<grid, dim3(TX, Tile::kTY), 0, stream>>>(input, weight, bias, output, p.C, p.H, p.W,
                                                  p.Ho, p.Wo, tiles_x, tiles_y);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int K, int S, int VEC>
void launch_nhwc(const T* input, const T* weight, const T* bias, T* output,
                 const DepthwiseProblem& p, cudaStream_t stream) {
  using Tile = NhwcTile<T, K, S, VEC>;
  const int tiles_x = ceil_div(static_cast<int>(p.Wo), Tile::kOutW);
  const int tiles_y = ceil_div(static_cast<int>(p.Ho), Tile::kOutH);
  const int slabs = ceil_div(static_cast<int>(p.C), Tile::kSlab);
  const unsigned grid = grid_size(p.N * tiles_x * tiles_y * slabs);
  auto kernel = depthwise_forward_nhwc_kernel<T, K, S, VEC>;
  allow_shared_bytes(kernel, Tile::kSharedBytes);
  kernel<<<grid, dim3(Tile::kCV, Tile::kSX, Tile::kSY), Tile::kSharedBytes, stream>>>(
      input, weight, bias, output, p.C, p.H, p.W, p.Ho, p.Wo, tiles_x, tiles_y, slabs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
          constexpr int kMaxVec = kVectorBytes / sizeof(T);
          const int vec = vector_width<T>(kMaxVec, p.W, {in});
          dispatch_vector_width<kMaxVec>(vec, [&](auto v) {
            constexpr int VEC = decltype(v)::value;
            if (p.Wo > 16) {
              launch_nchw<T, K, S, VEC, 32, 4>(in, w, b, out, p, stream);
            } else {
              launch_nchw<T, K, S, VEC, 16, 1>(in, w, b, out, p, stream);
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

// Depthwise K x K forward, NCHW: a persistent, multi-buffered pipeline of
// shared-memory tiles with full halos (pipeline.cuh). Per tile: one barrier,
// then an unrolled, branch-free K x K loop that reads only shared memory.
//
// A tile is an OW x OH block of one (n, c) plane's output. Its input window,
// halo included, is copied into shared memory in the input dtype with 16-byte
// chunks where W allows (8-byte or single elements otherwise); cells outside
// the image are zero-filled by the copy itself. Rows are stored from one
// 16-byte unit left of the window, so every chunk is aligned.
//
// Each thread computes V adjacent outputs in each of R rows, where V * S
// elements fill one 16-byte unit: its input window then starts at its own
// unit, a warp's 16-byte shared reads are consecutive (no bank conflicts,
// even at stride 2), and each input row it reads serves all R rows.
#include "common.cuh"
#include "depthwise_forward.cuh"
#include "pipeline.cuh"

namespace lumenbridge {
namespace cuda {
namespace {

// Output tile extents by plane width: wide planes take 64-wide tiles, planes
// at most 32 or 16 wide take 32- or 16-wide ones, so few lanes idle at the
// right edge. Tall tiles amortize the K - 1 halo rows; stride-2 tiles are
// shorter so their buffers still fit several blocks per SM.
enum class PlaneSize { Wide, Medium, Narrow };

template <typename T, int K, int S, PlaneSize SIZE>
struct NchwForwardTile {
  static constexpr int kUnit = 16 / sizeof(T);  // elements per 16-byte unit
  static constexpr int kV = kUnit / S;          // output columns per thread
  static constexpr int kOutW = SIZE == PlaneSize::Wide ? 64 : SIZE == PlaneSize::Medium ? 32 : 16;
  static constexpr int kOutH = SIZE == PlaneSize::Wide ? (S == 1 ? 64 : kUnit == 4 ? 16 : 32) : kOutW;
  static constexpr int kRows =
      SIZE == PlaneSize::Narrow ? 1 : (S == 1 && kUnit == 4 && SIZE == PlaneSize::Wide ? 4 : 2);
  static constexpr int kTX = kOutW / kV, kTY = kOutH / kRows, kThreads = kTX * kTY;
  static constexpr int kPad = K / 2, kStride = S;
  static constexpr int kInRows = (kOutH - 1) * S + K;
  // One unit left of the window (which reaches kPad < kUnit to the left), the
  // S * kOutW columns the tile steps over, and one unit for the right halo.
  static constexpr int kPitch = S * kOutW + 2 * kUnit;
  static constexpr int kElems = kInRows * kPitch;
  static constexpr int kStages = pipeline_stages(kElems * sizeof(T));
  static constexpr size_t kSharedBytes = kStages * kElems * sizeof(T);
  // A thread's input window: kWindow elements from offset kFirst of its unit.
  static constexpr int kFirst = kUnit - kPad;
  static constexpr int kWindow = (kV - 1) * S + K;
  static constexpr int kUnitsRead = ceil_div(kFirst + kWindow, kUnit);
  static_assert(kUnitsRead <= 3, "a thread's window must fit the tile's right halo unit");
  static_assert(kThreads % 32 == 0 && kThreads <= 256, "whole warps, at most 256 threads");
};

// Copies the input window of the tile at output (oy0, ox0) into `tile`.
// Chunk `item` lands at tile[item * CHUNK]: rows are exactly kPitch long.
template <typename Tile, int CHUNK, typename T>
__device__ __forceinline__ void load_nchw_tile(T* __restrict__ tile, const T* __restrict__ plane,
                                               int H, int W, int oy0, int ox0, int tid) {
  constexpr unsigned kChunksPerRow = Tile::kPitch / CHUNK;
  constexpr unsigned kItems = Tile::kInRows * kChunksPerRow;
  const int iy0 = oy0 * Tile::kStride - Tile::kPad;
  const int ix0 = ox0 * Tile::kStride - Tile::kUnit;
#pragma unroll 4
  for (unsigned item = tid; item < kItems; item += Tile::kThreads) {
    const unsigned r = item / kChunksPerRow, q = item % kChunksPerRow;
    const int gy = iy0 + static_cast<int>(r), gx = ix0 + static_cast<int>(q * CHUNK);
    const bool inside = static_cast<unsigned>(gy) < static_cast<unsigned>(H) &&
                        static_cast<unsigned>(gx) < static_cast<unsigned>(W);
    const int64_t offset = inside ? static_cast<int64_t>(gy) * W + gx : 0;
    copy_chunk_async<T, CHUNK>(tile + item * CHUNK, plane + offset, inside);
  }
}

// Register caps: 64 per thread for 3 x 3 (four 256-thread blocks per SM),
// 128 for the larger kernels' taps.
template <typename T, int K, int S, PlaneSize SIZE>
__global__ void __launch_bounds__(NchwForwardTile<T, K, S, SIZE>::kThreads,
                                  (K == 3 ? 1024 : 512) / NchwForwardTile<T, K, S, SIZE>::kThreads)
    depthwise_forward_nchw_kernel(const T* __restrict__ input, const T* __restrict__ weight,
                                  const T* __restrict__ bias, T* __restrict__ output, int H,
                                  int W, int Ho, int Wo, int chunk, bool vector_stores,
                                  TileSpace<4> space, int64_t tiles) {
  using Tile = NchwForwardTile<T, K, S, SIZE>;
  constexpr int V = Tile::kV, R = Tile::kRows, U = Tile::kUnit;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* const buffers = reinterpret_cast<T*>(shared_bytes);
  const int tid = threadIdx.x;
  const int tx = tid % Tile::kTX, ty = tid / Tile::kTX;
  const int C = space.radix[2];

  // Digits: tile column, tile row, channel, image.
  auto plane_of = [&](const TileCursor<4>& t) {
    return static_cast<int64_t>(t.digit[3]) * C + t.digit[2];
  };
  auto load = [&](T* tile, const TileCursor<4>& t) {
    dispatch_chunk<T>(chunk, [&](auto width) {
      load_nchw_tile<Tile, decltype(width)::value>(
          tile, input + plane_of(t) * H * W, H, W, t.digit[1] * Tile::kOutH,
          t.digit[0] * Tile::kOutW, tid);
    });
  };
  // The channel's taps and bias, fetched before the tile's barrier so their
  // latency overlaps the wait.
  float w[K * K], b;
  auto fetch_taps = [&](const TileCursor<4>& t) {
    const int c = t.digit[2];  // in range even past the last tile
#pragma unroll
    for (int i = 0; i < K * K; ++i) w[i] = static_cast<float>(weight[c * K * K + i]);
    b = bias != nullptr ? static_cast<float>(bias[c]) : 0.0f;
  };
  auto compute = [&](const T* tile, const TileCursor<4>& t) {
    float acc[R][V];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int v = 0; v < V; ++v) acc[r][v] = b;
    }
    const T* window = tile + ty * R * S * Tile::kPitch + tx * U;
#pragma unroll
    for (int ir = 0; ir < (R - 1) * S + K; ++ir) {
      float x[Tile::kUnitsRead * U];
#pragma unroll
      for (int u = 0; u < Tile::kUnitsRead; ++u) {
        const Vec<T, U> unit = load_vec<T, U>(window + ir * Tile::kPitch + u * U);
#pragma unroll
        for (int e = 0; e < U; ++e) x[u * U + e] = static_cast<float>(unit.v[e]);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int ky = ir - r * S;  // compile-time once unrolled: no branch survives
        if (ky >= 0 && ky < K) {
#pragma unroll
          for (int v = 0; v < V; ++v) {
#pragma unroll
            for (int kx = 0; kx < K; ++kx) {
              acc[r][v] = fmaf(w[ky * K + kx], x[Tile::kFirst + v * S + kx], acc[r][v]);
            }
          }
        }
      }
    }

    T* out = output + plane_of(t) * Ho * Wo;
    const int ox = t.digit[0] * Tile::kOutW + tx * V;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int oy = t.digit[1] * Tile::kOutH + ty * R + r;
      if (oy >= Ho) continue;
      T* dst = out + static_cast<int64_t>(oy) * Wo + ox;
      if (vector_stores && ox + V <= Wo) {
        Vec<T, V> result;
#pragma unroll
        for (int v = 0; v < V; ++v) result.v[v] = static_cast<T>(acc[r][v]);
        store_vec<T, V>(dst, result);
      } else {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          if (ox + v < Wo) dst[v] = static_cast<T>(acc[r][v]);
        }
      }
    }
  };
  run_tile_pipeline<Tile::kStages>(space, blockIdx.x, persistent_tile_count(tiles), buffers,
                                   Tile::kElems, load, NoStep{}, fetch_taps, compute);
}

template <typename T, int K, int S, PlaneSize SIZE>
void launch(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
            at::Tensor& output, const DepthwiseProblem& p) {
  using Tile = NchwForwardTile<T, K, S, SIZE>;
  constexpr auto kernel = depthwise_forward_nchw_kernel<T, K, S, SIZE>;
  allow_shared_bytes(kernel, Tile::kSharedBytes);
  const T* in = input.const_data_ptr<T>();
  T* out = output.mutable_data_ptr<T>();
  const int64_t tiles_x = ceil_div64(p.Wo, Tile::kOutW), tiles_y = ceil_div64(p.Ho, Tile::kOutH);
  const int64_t tiles = tiles_x * tiles_y * p.C * p.N;
  const int64_t blocks = persistent_blocks<kernel>(Tile::kThreads, Tile::kSharedBytes, tiles, 1);
  const TileSpace<4> space = tile_space<4>({tiles_x, tiles_y, p.C, p.N}, blocks);
  // Whole V-wide output vectors are aligned when Wo is a multiple of V.
  const bool vector_stores = vector_width<T>(Tile::kV, p.Wo, {out}) == Tile::kV;
  kernel<<<grid_x(blocks), Tile::kThreads, Tile::kSharedBytes, c10::cuda::getCurrentCUDAStream()>>>(
      in, weight.const_data_ptr<T>(), bias.defined() ? bias.const_data_ptr<T>() : nullptr, out,
      static_cast<int>(p.H), static_cast<int>(p.W), static_cast<int>(p.Ho),
      static_cast<int>(p.Wo), chunk_width<T>(p.W, in), vector_stores, space, tiles);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void launch_depthwise_forward_nchw(const at::Tensor& input, const at::Tensor& weight,
                                   const at::Tensor& bias, at::Tensor& output,
                                   const DepthwiseProblem& p) {
  LUMENBRIDGE_DISPATCH_CUDA_TYPES(input.scalar_type(), "lumenbridge_depthwise_forward_nchw", [&] {
    dispatch_kernel_size(p.K, [&](auto k) {
      dispatch_stride(p.stride, [&](auto s) {
        constexpr int K = decltype(k)::value, S = decltype(s)::value;
        if (p.Wo > 32) {
          launch<scalar_t, K, S, PlaneSize::Wide>(input, weight, bias, output, p);
        } else if (p.Wo > 16) {
          launch<scalar_t, K, S, PlaneSize::Medium>(input, weight, bias, output, p);
        } else {
          launch<scalar_t, K, S, PlaneSize::Narrow>(input, weight, bias, output, p);
        }
      });
    });
  });
}

}  // namespace cuda
}  // namespace lumenbridge

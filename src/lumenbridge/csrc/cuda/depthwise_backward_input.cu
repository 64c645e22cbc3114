// Gradient of the depthwise convolution with respect to its input.
//
// Stride 1: the gradient is the forward convolution of grad_output with the
//   kernel flipped in both axes (padding K / 2 is symmetric), so it reuses
//   the forward kernels.
// Stride 2: each input pixel (2a + py, 2b + px) receives only the taps whose
//   parity matches (py, px). A thread computes all four parities of a quad
//   (a, b), so which taps apply is known at compile time and the inner loops
//   stay branch-free. grad_output tiles (with halo) go through shared memory
//   exactly as the forward input tiles do.
#include <c10/cuda/CUDAGuard.h>

#include "common.cuh"
#include "depthwise_forward.cuh"
#include "tiles.cuh"

namespace lumenbridge {
namespace cuda {
namespace {

// Which taps reach an input pixel of parity `parity` (0 even, 1 odd), and
// from which grad_output row (or column) relative to the quad index: tap t
// reaches quad a + offset when parity + K/2 - t is even.
template <int K>
struct QuadReach {
  static constexpr int kPad = K / 2;
  static constexpr bool contributes(int parity, int tap) { return ((parity + kPad - tap) & 1) == 0; }
  static constexpr int offset(int parity, int tap) { return (parity + kPad - tap) / 2; }  // exact
  static constexpr int extreme(bool largest) {
    int best = largest ? -K : K;
    for (int parity = 0; parity < 2; ++parity) {
      for (int tap = 0; tap < K; ++tap) {
        if (!contributes(parity, tap)) continue;
        const int o = offset(parity, tap);
        best = largest ? (o > best ? o : best) : (o < best ? o : best);
      }
    }
    return best;
  }
  // grad_output rows feeding quad row a span a + kMin .. a + kMax.
  static constexpr int kMin = extreme(false), kMax = extreme(true), kSpan = kMax - kMin;
};

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

template <typename T, int K, int VEC>
struct NhwcQuadTile {
  static constexpr int kCV = 8, kQX = 8, kQY = kThreads / (kCV * kQX), kQRows = 2;
  static constexpr int kSlab = kCV * VEC;
  static constexpr int kQuadW = kQX, kQuadH = kQY * kQRows;
  static constexpr int kInW = kQuadW + QuadReach<K>::kSpan;
  static constexpr int kInH = kQuadH + QuadReach<K>::kSpan;
  static constexpr size_t kSharedBytes = sizeof(T) * kInH * kInW * kSlab;
};

template <typename T, int K, int VEC>
__global__ void __launch_bounds__(kThreads)
    depthwise_backward_input_s2_nhwc_kernel(const T* __restrict__ grad_output,
                                            const T* __restrict__ weight,
                                            T* __restrict__ grad_input, int C, int H, int W,
                                            int Ho, int Wo, int slabs) {
  using Tile = NhwcQuadTile<T, K, VEC>;
  using Reach = QuadReach<K>;
  constexpr int kSlab = Tile::kSlab;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* tile = reinterpret_cast<T*>(shared_bytes);
  __shared__ __align__(16) float taps[K * K][kSlab];  // the slab's taps, [tap][channel]

  const int slab = blockIdx.x % slabs;
  const int bx = blockIdx.x / slabs;
  const int by = blockIdx.y;
  const int64_t n = blockIdx.z;
  const int qy0 = by * Tile::kQuadH, qx0 = bx * Tile::kQuadW;
  const int cv = threadIdx.x, qx = threadIdx.y, qy = threadIdx.z;
  const int tid = (qy * Tile::kQX + qx) * Tile::kCV + cv;
  const int c0 = slab * kSlab;
  const int c = c0 + cv * VEC;

  for (int i = tid; i < K * K * kSlab; i += kThreads) {
    const int t = i / kSlab, ch = c0 + i % kSlab;
    taps[t][i % kSlab] = ch < C ? static_cast<float>(weight[ch * K * K + t]) : 0.0f;
  }
  load_pixel_tile<T, Tile::kInH, Tile::kInW, Tile::kCV, VEC, kThreads>(
      tile, grad_output + n * Ho * Wo * C, Ho, Wo, C, qy0 + Reach::kMin, qx0 + Reach::kMin, c0, tid);
  __syncthreads();

  float w[K * K][VEC];
#pragma unroll
  for (int i = 0; i < K * K; ++i) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) w[i][e] = taps[i][cv * VEC + e];
  }

#pragma unroll
  for (int q = 0; q < Tile::kQRows; ++q) {
    const int la = qy * Tile::kQRows + q;
    const int y = 2 * (qy0 + la), x = 2 * (qx0 + qx);
#pragma unroll
    for (int py = 0; py < 2; ++py) {
#pragma unroll
      for (int px = 0; px < 2; ++px) {
        float acc[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = 0.0f;
#pragma unroll
        for (int i = 0; i < K; ++i) {
          if (!Reach::contributes(py, i)) continue;
#pragma unroll
          for (int j = 0; j < K; ++j) {
            if (!Reach::contributes(px, j)) continue;
            const int ty = la + Reach::offset(py, i) - Reach::kMin;
            const int tx = qx + Reach::offset(px, j) - Reach::kMin;
            const Vec<T, VEC> g = load_vec<T, VEC>(tile + (ty * Tile::kInW + tx) * Tile::kSlab + cv * VEC);
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] = fmaf(w[i * K + j][e], static_cast<float>(g.v[e]), acc[e]);
          }
        }
        if (y + py < H && x + px < W && c < C) {
          Vec<T, VEC> result;
#pragma unroll
          for (int e = 0; e < VEC; ++e) result.v[e] = static_cast<T>(acc[e]);
          store_vec<T, VEC>(grad_input + ((n * H + y + py) * W + x + px) * C + c, result);
        }
      }
    }
  }
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

template <typename T, int K>
void launch_s2_nhwc(const T* grad_output, const T* weight, T* grad_input,
                    const DepthwiseProblem& p, cudaStream_t stream) {
  const int vec = vector_width<T>(4, p.C, {grad_output, grad_input});
  dispatch_vector_width<4>(vec, [&](auto v) {
    constexpr int VEC = decltype(v)::value;
    using Tile = NhwcQuadTile<T, K, VEC>;
    const int tiles_x = ceil_div(ceil_div(static_cast<int>(p.W), 2), Tile::kQuadW);
    const int tiles_y = ceil_div(ceil_div(static_cast<int>(p.H), 2), Tile::kQuadH);
    const int slabs = ceil_div(static_cast<int>(p.C), Tile::kSlab);
    auto kernel = depthwise_backward_input_s2_nhwc_kernel<T, K, VEC>;
    allow_shared_bytes(kernel, Tile::kSharedBytes);
    for_each_batch_slice(p.N, [&](int64_t n0, unsigned count) {
      const dim3 grid(grid_x(int64_t{slabs} * tiles_x), grid_y(tiles_y, "tile rows"), count);
      kernel<<<grid, dim3(Tile::kCV, Tile::kQX, Tile::kQY), Tile::kSharedBytes, stream>>>(
          grad_output + n0 * p.Ho * p.Wo * p.C, weight, grad_input + n0 * p.H * p.W * p.C, p.C,
          p.H, p.W, p.Ho, p.Wo, slabs);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace

at::Tensor depthwise_backward_input(const at::Tensor& grad_output, const at::Tensor& weight,
                                    const DepthwiseProblem& p) {
  const c10::cuda::CUDAGuard guard(grad_output.device());
  at::Tensor grad_input = new_output({p.N, p.C, p.H, p.W}, grad_output.options(), p.memory_format());
  if (grad_input.numel() == 0) return grad_input;
  if (p.stride == 1) {
    // Same extents in and out at stride 1, so the forward problem is this one.
    launch_depthwise_forward(grad_output, weight.flip({2, 3}).contiguous(), at::Tensor(), grad_input, p);
    return grad_input;
  }
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
        launch_s2_nhwc<T, K>(go, w, gi, p, stream);
      }
    });
  });
  return grad_input;
}

}  // namespace cuda
}  // namespace lumenbridge

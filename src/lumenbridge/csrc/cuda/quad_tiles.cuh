// The stride-2 input gradient's quads, shared by the NHWC kernels that
// compute it (depthwise_backward_input.cu, and with the weight gradient,
// depthwise_backward_both.cu): which taps reach each parity of a quad, the
// visit of a quad's (pixel, tap, grad_output) triples from a shared
// grad_output window, and the stores of its gradient, scaled by the
// activation's slope.
#pragma once

#include "activation.cuh"
#include "common.cuh"

namespace lumenbridge {
namespace cuda {

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

// A thread's L gradients at one pixel times act'(pre) there, the slope in
// float, then rounded to T once: for bf16 and fp16 GELU, the slope of the fit
// their forward evaluates (gelu_fit_slope), for the rest ATen's. (A slope
// evaluated in packed bf16 / fp16 steps was off by a few units of T's last
// place in the same direction at many pixels, and the parameter gradients,
// sums over every pixel, drifted to 3-5x PyTorch's error: benchmarks/NOTES.md,
// thirtieth session.)
template <typename T, int L>
__device__ __forceinline__ Vec<T, L> slope_scaled(const float (&value)[L], const Vec<T, L>& pre, Activation slope) {
  float x[L];
  to_floats(pre, x);
  dispatch_activation(slope, [&](auto a) {
    constexpr Activation kKind = decltype(a)::value;
#pragma unroll
    for (int e = 0; e < L; ++e) {
      float s;
      if constexpr (kKind == Activation::GELU && !std::is_same_v<T, float>) {
        s = gelu_fit_slope(x[e]);
      } else {
        s = activation_slope<kKind>(x[e]);
      }
      x[e] = value[e] * s;
    }
  });
  return from_floats<T, L>(x);
}

// bf16 with GELU: x and the slope from one exponential
// (gelu_fit_value_and_slope) before the visit, the slopes then kept until the
// scaling as float16 in the pixel's slot over pre, which nothing reads after
// x (the one-pass kernel, depthwise_backward_both.cu). x is then the fit in
// float, not the packed x the forward passed on (nearer the exact GELU).
// float16's 2^-11 relative error (3e-8 absolute where the slope is
// subnormal, below pre = -4.5) is below bf16's rounding of the gradient
// (2^-9) but as large as fp16's own, so fp16 keeps slope_scaled; the slope
// lies in [-0.129, 1.129], within float16's range.
template <typename T>
constexpr bool keeps_slopes = std::is_same_v<T, at::BFloat16>;

// x = act(pre) at one pixel from its slot, whose pre gives way to the slopes.
template <typename T, int L>
__device__ __forceinline__ void keep_slopes(Vec<T, L>& slot, float (&x)[L]) {
  static_assert(keeps_slopes<T> && sizeof(Vec<T, L>) == sizeof(Vec<at::Half, L>), "the slopes fill pre's slot");
  float pre[L], slope[L];
  to_floats(slot, pre);
#pragma unroll
  for (int e = 0; e < L; ++e) {
    const auto fit = gelu_fit_value_and_slope(pre[e]);
    x[e] = fit.value;
    slope[e] = fit.slope;
  }
  *reinterpret_cast<Vec<at::Half, L>*>(&slot) = from_floats<at::Half, L>(slope);
}

// slope_scaled with the slopes keep_slopes left in the slot.
template <typename T, int L>
__device__ __forceinline__ Vec<T, L> scaled_by_kept_slopes(const float (&value)[L], const Vec<T, L>& slot) {
  float scaled[L];
  to_floats(*reinterpret_cast<const Vec<at::Half, L>*>(&slot), scaled);
#pragma unroll
  for (int e = 0; e < L; ++e) scaled[e] *= value[e];
  return from_floats<T, L>(scaled);
}

// Visits every (pixel, tap, grad_output pixel) triple of one quad (a, b),
// this thread's L channels: term(py, px, t, g) for pixel (2a + py, 2b + px),
// tap t = i * K + j and g the grad_output values that tap reaches it from
// (rows a + kMin .. a + kMax; which taps each parity takes is known at
// compile time). `window` is the quad's first grad_output pixel (row
// a + kMin, column b + kMin), this thread's channels, in a shared window of
// ROW_PIXELS pixels a row and SLAB channels a pixel. Every (output, tap)
// pair whose input pixel lies in a quad is visited exactly once.
template <typename T, int K, int L, int ROW_PIXELS, int SLAB, typename Term>
__device__ __forceinline__ void visit_quad(const T* window, Term&& term) {
  using Reach = QuadReach<K>;
  constexpr int kCols = Reach::kSpan + 1;
#pragma unroll
  for (int row = 0; row <= Reach::kSpan; ++row) {
    float g[kCols][L];
#pragma unroll
    for (int col = 0; col < kCols; ++col) {
      to_floats(load_vec<T, L>(window + (row * ROW_PIXELS + col) * SLAB), g[col]);
    }
#pragma unroll
    for (int py = 0; py < 2; ++py) {
#pragma unroll
      for (int i = 0; i < K; ++i) {
        if (!Reach::contributes(py, i) || Reach::offset(py, i) - Reach::kMin != row) continue;
#pragma unroll
        for (int px = 0; px < 2; ++px) {
#pragma unroll
          for (int j = 0; j < K; ++j) {
            if (Reach::contributes(px, j)) term(py, px, i * K + j, g[Reach::offset(px, j) - Reach::kMin]);
          }
        }
      }
    }
  }
}

// Stores a quad's values[py][px] at pixel (y + py, x + px) of an NHWC
// H x W x C image (`image` points at its pixel 0, channel c), pixels past the
// image left out: one vector a pixel where the caller's vector stores hold
// and the pixels have L channels from c, element by element up to C
// otherwise. The quad's address is computed once, and the vector test once
// outside the pixels' border tests: per pixel, the compiler recomputed the
// address (a 64-bit product, about ten instructions) and, inside the border
// branches, the test.
template <typename T, int L>
__device__ __forceinline__ void store_quad_values(const Vec<T, L> (&values)[2][2], T* image, int y, int x, int H,
                                                  int W, int C, int c, bool vector_stores) {
  T* const quad = image + (static_cast<int64_t>(y) * W + x) * C;
  const int64_t row = static_cast<int64_t>(W) * C;
  const auto for_each_inside = [&](auto&& store) {
#pragma unroll
    for (int py = 0; py < 2; ++py) {
#pragma unroll
      for (int px = 0; px < 2; ++px) {
        if (y + py < H && x + px < W) store(quad + py * row + px * C, values[py][px]);
      }
    }
  };
  if (vector_stores && c + L <= C) {
    for_each_inside([](T* dst, const Vec<T, L>& v) { store_vec<T, L>(dst, v); });
  } else {
    for_each_inside([&](T* dst, const Vec<T, L>& v) {
#pragma unroll
      for (int e = 0; e < L; ++e) {
        if (c + e < C) dst[e] = v.v[e];
      }
    });
  }
}

// The same for float gradients acc[py][px], rounded to T; with SLOPE each
// is scaled by the slope at the pre-activation pre_at(py, px) (a Vec<T, L>
// of this thread's channels; read for the pixels past the image too).
template <bool SLOPE, typename T, int L, typename PreAt>
__device__ __forceinline__ void store_quad(const float (&acc)[2][2][L], T* image, int y, int x, int H, int W, int C,
                                           int c, bool vector_stores, Activation slope, PreAt&& pre_at) {
  Vec<T, L> values[2][2];
#pragma unroll
  for (int py = 0; py < 2; ++py) {
#pragma unroll
    for (int px = 0; px < 2; ++px) {
      if constexpr (SLOPE) {
        values[py][px] = slope_scaled<T, L>(acc[py][px], pre_at(py, px), slope);
      } else {
        values[py][px] = from_floats<T, L>(acc[py][px]);
      }
    }
  }
  store_quad_values<T, L>(values, image, y, x, H, W, C, c, vector_stores);
}

}  // namespace cuda
}  // namespace lumenbridge

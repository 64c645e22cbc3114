// The activation between stages on pairs of bf16 / fp16 values in packed
// instructions (activate_pair), shared by the fused stage kernels' epilogues
// (fused_parts.cuh) and the depthwise kernels of the composed backward, which
// apply it to their input tiles (nhwc_tiles.cuh); GELU's slope in the same
// form (gelu_slope_pair), for the input gradient's stores; and the packing
// of pairs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <limits>

#include "activation.cuh"

namespace lumenbridge {
namespace cuda {

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<at::BFloat16>(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<at::Half>(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t u);
template <>
__device__ __forceinline__ float2 unpack2<at::BFloat16>(uint32_t u) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u));
}
template <>
__device__ __forceinline__ float2 unpack2<at::Half>(uint32_t u) {
  return __half22float2(*reinterpret_cast<__half2*>(&u));
}

// ---- activation, two values at a time ----------------------------------------

// Every activation as one branch-free form, v/2 (1 + tanh(u)) with
// u = v p(min(v^2, 25)) + q, so a kernel applies whichever the config names
// with no per-element switch:
//   gelu  p fitted to the erf form (GeluFit; not the usual tanh-GELU, 5e-4
//         off): max error 2.7e-5 before rounding; at v^2 = 25 p is still
//         positive and tanh is 1;
//   silu  v sigmoid(v) = v/2 (1 + tanh(v/2)): p = 1/2;
//   relu  p = the largest finite T, so tanh rounds to -1 or 1 for
//         |v| > 5 / p (1.5e-38 in bfloat16, 7.6e-5 in float16); smaller
//         values are off by at most half themselves;
//   none  p = 0, q = the largest finite T: tanh(q) = 1 and the form is exactly v.
// It runs on pairs of T in packed instructions (fma/mul/min .bf16x2 or
// .f16x2 and one hardware tanh for both values): about 4.5 instructions a
// value, against 9.5 in float. v is rounded to T first, as PyTorch rounds
// a convolution's output before its activation; the packed steps add a few
// units of T's last place at most, which the tokens' tolerance test covers
// (the emulated form changes the tokens' error against float64 by under 10%).
struct ActivationForm {
  uint32_t p0, p1, p2, q, clamp, half;  // each a pair of equal values of T
};

template <typename T>
uint32_t splat(float v) {
  const uint32_t bits = T(v).x;  // rounded to nearest, as the device rounds
  return bits | bits << 16;
}

// Empty for float, whose kernels evaluate ATen's forms instead.
template <typename T>
ActivationForm activation_form(Activation act) {
  if constexpr (std::is_same_v<T, float>) {
    return {};
  } else {
    const float largest = static_cast<float>(std::numeric_limits<T>::max());
    float p0 = 0.0f, p1 = 0.0f, p2 = 0.0f, q = 0.0f;
    switch (act) {
      case Activation::GELU: p0 = GeluFit::kP0, p1 = GeluFit::kP1, p2 = GeluFit::kP2; break;
      case Activation::SILU: p0 = 0.5f; break;
      case Activation::RELU: p0 = largest; break;
      case Activation::NONE: q = largest; break;
    }
    return {splat<T>(p0), splat<T>(p1), splat<T>(p2), splat<T>(q), splat<T>(GeluFit::kClamp), splat<T>(0.5f)};
  }
}

// An activation as a kernel argument: its kind and a packed form's constants
// (activation_form, gelu_slope_form), which the kernels use for bf16 and fp16.
template <typename Form>
struct PackedChoice {
  Activation kind;
  Form form;
};

// The packed instructions on pairs of T held in 32-bit registers.
template <typename T>
struct PairMath;

template <>
struct PairMath<at::BFloat16> {
  static __device__ __forceinline__ uint32_t fma(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
  }
  static __device__ __forceinline__ uint32_t mul(uint32_t a, uint32_t b) {
    return fma(a, b, 0x80008000u);  // + (-0): exact, and -0 keeps the sign of a zero product
  }
  static __device__ __forceinline__ uint32_t min(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("min.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  static __device__ __forceinline__ uint32_t tanh(uint32_t u) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t t;
    asm("tanh.approx.bf16x2 %0, %1;" : "=r"(t) : "r"(u));
    return t;
#else  // no packed bfloat16 tanh before sm_90: one float tanh per value
    const float2 f = unpack2<at::BFloat16>(u);
    float t0, t1;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t0) : "f"(f.x));
    asm("tanh.approx.f32 %0, %1;" : "=f"(t1) : "f"(f.y));
    return pack2<at::BFloat16>(t0, t1);
#endif
  }
};

template <>
struct PairMath<at::Half> {
  static __device__ __forceinline__ uint32_t fma(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
  }
  static __device__ __forceinline__ uint32_t mul(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  static __device__ __forceinline__ uint32_t min(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("min.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  static __device__ __forceinline__ uint32_t tanh(uint32_t u) {
    uint32_t t;
    asm("tanh.approx.f16x2 %0, %1;" : "=r"(t) : "r"(u));
    return t;
  }
};

// act of a packed pair v of T, packed the same way.
template <typename T>
__device__ __forceinline__ uint32_t activate_packed(uint32_t v, const ActivationForm& f) {
  using M = PairMath<T>;
  const uint32_t x2 = M::min(M::mul(v, v), f.clamp);
  const uint32_t p = M::fma(M::fma(x2, f.p2, f.p1), x2, f.p0);
  const uint32_t t = M::tanh(M::fma(v, p, f.q));
  return M::mul(v, M::fma(t, f.half, f.half));
}

// act(a), act(b) rounded to T and packed (a in the low half), for a store.
template <typename T>
__device__ __forceinline__ uint32_t activate_pair(float a, float b, const ActivationForm& f) {
  return activate_packed<T>(pack2<T>(a, b), f);
}

// ---- GELU's slope, two values at a time -----------------------------------------

// The derivative of activate_pair's GELU, the function the forward kernels
// evaluate: with z = min(v^2, 25), u = v p(z) and t = tanh(u),
//   act'(v) = (1 + t) / 2 + v (1 - t^2) u' / 2,  u' = p + 2 z p'(z) = p0 + 3 p1 z + 5 p2 z^2
// (past the clamp t is +-1 in T and the second term vanishes). Every step is
// one packed instruction, with one hardware tanh for both values: about 7
// instructions a value, against about 16 and two MUFU operations for the same
// derivative in float (benchmarks/NOTES.md, step 29). Rounding each step to T
// makes it coarser than that float form (1.1e-4 at most): near saturation,
// where 1 - t^2 is a few units of T's last place off, by about 2e-3 at
// v = -2.5 in bf16. The gradient tests' 2x / 3x rule holds with it on every
// sample case (worst ratio 2.41 of 3 in the CPU emulation of step 29).
struct GeluSlopeForm {
  uint32_t p0, p1, p2, d1, d2, clamp, half, one;  // each a pair of equal values of T
};

// Empty for float, whose kernels evaluate ATen's form instead.
template <typename T>
GeluSlopeForm gelu_slope_form() {
  if constexpr (std::is_same_v<T, float>) {
    return {};
  } else {
    return {splat<T>(GeluFit::kP0),        splat<T>(GeluFit::kP1),        splat<T>(GeluFit::kP2),
            splat<T>(3.0f * GeluFit::kP1), splat<T>(5.0f * GeluFit::kP2), splat<T>(GeluFit::kClamp),
            splat<T>(0.5f),                splat<T>(1.0f)};
  }
}

// GELU and its slope at a packed pair v of T from one tanh: returns act(v)
// and sets `slope` to act'(v), both packed. act(v) is activate_pair's GELU
// bit for bit: there u = v p(z) + q with q = 0, here v p(z), which differ
// only in the sign of a zero, and tanh, (1 + t) / 2 and the product by v
// give the same result for either.
template <typename T>
__device__ __forceinline__ uint32_t gelu_pair_with_slope(uint32_t v, const GeluSlopeForm& f, uint32_t& slope) {
  using M = PairMath<T>;
  constexpr uint32_t kSigns = 0x80008000u;
  const uint32_t z = M::min(M::mul(v, v), f.clamp);
  const uint32_t p = M::fma(M::fma(z, f.p2, f.p1), z, f.p0);
  const uint32_t du = M::fma(M::fma(z, f.d2, f.d1), z, f.p0);
  const uint32_t t = M::tanh(M::mul(v, p));
  const uint32_t flat = M::fma(t ^ kSigns, t, f.one);  // 1 - t^2
  const uint32_t scaled = M::mul(M::mul(v, f.half), flat);
  const uint32_t h = M::fma(t, f.half, f.half);  // (1 + t) / 2
  slope = M::fma(scaled, du, h);
  return M::mul(v, h);
}

// act'(v) for a packed pair v of T, packed the same way.
template <typename T>
__device__ __forceinline__ uint32_t gelu_slope_pair(uint32_t v, const GeluSlopeForm& f) {
  uint32_t slope;
  gelu_pair_with_slope<T>(v, f, slope);
  return slope;
}

}  // namespace cuda
}  // namespace lumenbridge

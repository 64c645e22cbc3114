// The activation between stages on pairs of bf16 / fp16 values in packed
// instructions (activate_pair), shared by the fused stage kernels' epilogues
// (fused_parts.cuh) and the depthwise kernels of the composed backward, which
// apply it to their input tiles (nhwc_tiles.cuh). (The pairs' packing,
// pack2 and unpack2, is in common.cuh; the input gradient's slope is
// evaluated in float: quad_tiles.cuh.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <limits>

#include "activation.cuh"
#include "common.cuh"

namespace lumenbridge {
namespace cuda {

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

// An activation as a kernel argument: its kind and the packed form's
// constants (activation_form), which the kernels use for bf16 and fp16.
struct PackedActivation {
  Activation kind;
  ActivationForm form;
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

}  // namespace cuda
}  // namespace lumenbridge

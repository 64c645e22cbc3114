// The activation between stages on one value, as ATen evaluates it on a
// tensor of a floating type (in float, its op-math type; the caller rounds
// once to the tensor's type), and its slope, for the depthwise kernels of the
// composed backward, which apply it to their input tiles and their input
// gradients; and the fit of GELU that the packed forms (packed_activation.cuh)
// of the activation and of its slope share.
#pragma once

#include <type_traits>

#include "../activation.h"

namespace lumenbridge {
namespace cuda {

template <Activation A>
using ActivationConstant = std::integral_constant<Activation, A>;

// Runs body(ActivationConstant<A>{}) for the runtime choice; the branch is
// uniform across the grid.
template <typename Body>
__host__ __device__ __forceinline__ void dispatch_activation(Activation activation, Body&& body) {
  switch (activation) {
    case Activation::GELU: body(ActivationConstant<Activation::GELU>{}); return;
    case Activation::RELU: body(ActivationConstant<Activation::RELU>{}); return;
    case Activation::SILU: body(ActivationConstant<Activation::SILU>{}); return;
    case Activation::NONE: body(ActivationConstant<Activation::NONE>{}); return;
  }
}

template <Activation A>
__device__ __forceinline__ float activation_value(float x) {
  if constexpr (A == Activation::GELU) {
    return x * 0.5f * (1.0f + erff(x * static_cast<float>(M_SQRT1_2)));
  } else if constexpr (A == Activation::RELU) {
    return x > 0.0f || x != x ? x : 0.0f;  // NaN propagates, as in ATen
  } else if constexpr (A == Activation::SILU) {
    return x / (1.0f + expf(-x));
  } else {
    return x;
  }
}

// d act / dx at x, as ATen's backward of each activation takes it.
template <Activation A>
__device__ __forceinline__ float activation_slope(float x) {
  if constexpr (A == Activation::GELU) {
    constexpr float kPdfScale = static_cast<float>(M_2_SQRTPI * M_SQRT1_2 * 0.5);
    const float cdf = 0.5f * (1.0f + erff(x * static_cast<float>(M_SQRT1_2)));
    const float pdf = expf(-0.5f * x * x) * kPdfScale;
    return cdf + x * pdf;
  } else if constexpr (A == Activation::RELU) {
    return x <= 0.0f ? 0.0f : 1.0f;
  } else if constexpr (A == Activation::SILU) {
    const float sigmoid = 1.0f / (1.0f + expf(-x));
    return sigmoid * (1.0f + x * (1.0f - sigmoid));
  } else {
    return 1.0f;
  }
}

// 2^x by the MUFU alone. Below 2^-126 the result flushes to zero, where
// ex2.approx.f32 without .ftz (what __expf compiles to here) halves its
// argument and squares the result to return a subnormal (a test and two
// multiplies more a value, SASS); gelu_fit_slope reaches that only at
// x > 29, where its slope is then 1, as ATen's is in float.
__device__ __forceinline__ float exp2_flushed(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// GELU's cdf as the packed form fits it: Phi(x) ~ (1 + tanh(x p(z))) / 2 with
// z = min(x^2, 25) and p(z) = p0 + p1 z + p2 z^2 (p(25) is still positive,
// and tanh is 1 there).
struct GeluFit {
  static constexpr float kP0 = 7.97528333e-1f, kP1 = 3.69923366e-2f, kP2 = -3.49826470e-4f, kClamp = 25.0f;
};

// The fit and its slope at x, in float: with u = x p(z), t = tanh(u) and
// r = (1 + t) / 2 = 1 / (1 + exp(-2u)),
//   act(x) = x r,
//   act'(x) = r + x (1 - t^2) u' / 2 = r + x (2u') r (1 - r),
//   u' = p0 + 3 p1 z + 5 p2 z^2,
// as 1 - t^2 = 4 r (1 - r). (Past the clamp 1 - t^2 < 3e-6, so u' there
// matters no more.) exp(-2u) is 2^(x q(z)), q being p with its
// coefficients times -2 log2(e), and 2u' has its coefficients doubled, so
// neither u nor the factors take an instruction. Where the exponential
// overflows (x < -29) r = 0, where it flushes to zero (x > 29) r = 1: the
// slope is 0 or 1 there, as ATen's is in float. Near saturation the slope
// carries r's error (its rounding, and the reciprocal's two ulp) times up
// to 1 - x (2u'), about 27: a slope error below 5e-6. Two
// MUFU operations (exp2, reciprocal) for both, against erff's polynomial
// and expf in ATen's form; the slope within 1.1e-4 of ATen's, which the half
// types' gradient rule does not see (benchmarks/NOTES.md, thirtieth
// session), but fp32's would.
__device__ __forceinline__ auto gelu_fit_value_and_slope(float x) {
  struct GeluFitPoint {
    float value, slope;
  };
  constexpr float kExponent = -2.0f * 1.4426950408889634f;  // -2 log2(e)
  const float z = fminf(x * x, GeluFit::kClamp);
  const float q = fmaf(fmaf(z, kExponent * GeluFit::kP2, kExponent * GeluFit::kP1), z, kExponent * GeluFit::kP0);
  const float two_du = fmaf(fmaf(z, 10.0f * GeluFit::kP2, 6.0f * GeluFit::kP1), z, 2.0f * GeluFit::kP0);
  const float r = __fdividef(1.0f, 1.0f + exp2_flushed(x * q));
  return GeluFitPoint{x * r, fmaf(x * two_du, fmaf(-r, r, r), r)};
}

__device__ __forceinline__ float gelu_fit_slope(float x) { return gelu_fit_value_and_slope(x).slope; }

}  // namespace cuda
}  // namespace lumenbridge

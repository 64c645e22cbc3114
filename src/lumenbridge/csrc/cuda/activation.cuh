// The activation between stages on one value, as ATen evaluates it on a
// tensor of a floating type (in float, its op-math type; the caller rounds
// once to the tensor's type), and its slope, for the depthwise kernels of the
// composed backward, which apply it to their input tiles and their input
// gradients; and the fit of GELU that the packed form (packed_activation.cuh)
// and the half types' slope share.
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

// GELU's cdf as the packed form fits it: Phi(x) ~ (1 + tanh(x p(z))) / 2 with
// z = min(x^2, 25) and p(z) = p0 + p1 z + p2 z^2 (p(25) is still positive,
// and tanh is 1 there).
struct GeluFit {
  static constexpr float kP0 = 7.97528333e-1f, kP1 = 3.69923366e-2f, kP2 = -3.49826470e-4f, kClamp = 25.0f;
};

// act'(x) for the input gradient's epilogue (depthwise_backward_input.cu).
// Half types take GELU's as the derivative of its fit, the form the fused
// forward evaluates: two fast hardware functions and about a dozen float
// instructions, where the erf and exp of ATen's form made the epilogue cost
// more than the pass it replaces (benchmarks/NOTES.md, step 22). Its error,
// 1.1e-4 at most, is below a half type's rounding. Float, and the other
// activations, take ATen's forms. The switch is uniform across the grid.
template <typename T>
__device__ __forceinline__ float input_slope(float x, Activation kind) {
  if constexpr (!std::is_same_v<T, float>) {
    if (kind == Activation::GELU) {
      // d/dx of x s(2u), with s the logistic function, (1 + tanh(u)) / 2, and
      // u = x p(z): s (1 - s) = e s^2 with e = exp(-2u) keeps its relative
      // accuracy where s is near 1 (1 - tanh^2 from a hardware tanh would
      // not); u >= -40 keeps e finite. The clamp's kink in z lies where
      // s (1 - s) has already vanished.
      const float z = fminf(x * x, GeluFit::kClamp);
      const float p = fmaf(fmaf(z, GeluFit::kP2, GeluFit::kP1), z, GeluFit::kP0);
      const float du = fmaf(2.0f * z, fmaf(2.0f * GeluFit::kP2, z, GeluFit::kP1), p);
      const float e = __expf(-2.0f * fmaxf(x * p, -40.0f));
      const float s = __fdividef(1.0f, 1.0f + e);
      return fmaf(2.0f * x * (e * s) * s, du, s);
    }
  }
  float slope = 1.0f;
  dispatch_activation(kind, [&](auto a) { slope = activation_slope<decltype(a)::value>(x); });
  return slope;
}

}  // namespace cuda
}  // namespace lumenbridge

// The images as the op takes them (uint8 or the parameters' dtype, NCHW or
// NHWC), read as the first stage's input: uint8 values normalized with the
// problem's mean and std, in float, as (v - mean) / std with 1 / std rounded
// to float once; other values as given. The fused forward
// (tokenize_fused.cu) and the backward's images' stage kernels
// (images_stage.cu) read them through these definitions, so the backward's
// recompute sees the values the forward saw. The composed path (the CPU, and
// CUDA cases these kernels do not cover: tokenize_composed.cpp's
// normalized_images) normalizes with ATen in the parameters' dtype, which
// rounds twice: the two differ by about a unit in T's last place.
#pragma once

#include <type_traits>

#include "../tokenize.h"

namespace lumenbridge {
namespace cuda {

// Channels a kernel normalizes: as many as the images' stage's rows hold
// (a one column after them, kRowAlignment wide).
constexpr int kMaxNormalizedChannels = static_cast<int>(kRowAlignment) - 1;

struct ImageNormalization {
  float mean[kMaxNormalizedChannels], inv_std[kMaxNormalizedChannels];
};

// Channels past the problem's (or past kMaxNormalizedChannels) are left as
// the identity; kernels that normalize more channels are not launched.
inline ImageNormalization image_normalization(const TokenizeProblem& p) {
  ImageNormalization n;
  for (int c = 0; c < kMaxNormalizedChannels; ++c) {
    n.mean[c] = c < p.C ? static_cast<float>(p.mean[c]) : 0.0f;
    n.inv_std[c] = c < p.C ? static_cast<float>(1.0 / p.std[c]) : 1.0f;
  }
  return n;
}

// The first stage's input value of an image element `v` of type In whose
// channel normalizes with `mean` and `inv_std`.
template <typename In>
__device__ __forceinline__ float normalized(float v, float mean, float inv_std) {
  return std::is_same_v<In, uint8_t> ? (v - mean) * inv_std : v;
}

}  // namespace cuda
}  // namespace lumenbridge

// lumenbridge::crop_resize: uint8 images [C, H, W] of any sizes and strides,
// each with a box and a sample count, into one uint8 batch [B, C, S, S].
// Each output pixel averages ratio x ratio bilinear samples spread evenly
// over its share of the box, with coordinates clamped to the image (the
// edge pixels repeat), then rounds half to even: torchvision's roi_align
// with aligned boxes, over one image at a time. The sample math is written
// once here for the CPU and CUDA kernels; on the device the products and
// sums are rounded one by one (no fused multiply-add), as the host computes
// them, so both give the same bytes.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <vector>

#ifdef __CUDACC__
#define LUMENBRIDGE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LUMENBRIDGE_HOST_DEVICE inline
#endif

namespace lumenbridge {

// One image of a crop_resize call, in the form the kernels read it.
struct CropSource {
  const uint8_t* pixels;
  int64_t c_step, y_step, x_step;
  int32_t height, width;
  // The box in pixel-centre coordinates (its corner minus half a pixel) and
  // one output pixel's share of it, along each axis.
  float start_x, start_y, bin_w, bin_h;
  int32_t ratio;
};

// The channels crop_resize takes (RGB, or RGBA and grey as decoders give them).
inline constexpr int64_t kMaxCropChannels = 4;
// The largest output side: far past any tokenizer input, and within the CUDA
// grid's 65,535 blocks an axis at 16 pixels a block.
inline constexpr int64_t kMaxCropSize = 65535;

namespace crop_math {

#ifdef __CUDA_ARCH__
LUMENBRIDGE_HOST_DEVICE float add(float a, float b) { return __fadd_rn(a, b); }
LUMENBRIDGE_HOST_DEVICE float mul(float a, float b) { return __fmul_rn(a, b); }
LUMENBRIDGE_HOST_DEVICE float div(float a, float b) { return __fdiv_rn(a, b); }
LUMENBRIDGE_HOST_DEVICE float round_half_even(float a) { return rintf(a); }
#else
LUMENBRIDGE_HOST_DEVICE float add(float a, float b) { return a + b; }
LUMENBRIDGE_HOST_DEVICE float mul(float a, float b) { return a * b; }
LUMENBRIDGE_HOST_DEVICE float div(float a, float b) { return a / b; }
LUMENBRIDGE_HOST_DEVICE float round_half_even(float a) { return std::nearbyint(a); }
#endif

// Where sample `index` of output pixel `pixel` lies along one axis.
LUMENBRIDGE_HOST_DEVICE float sample_position(float start, float bin, int pixel, int index, int ratio) {
  return add(add(start, mul(static_cast<float>(pixel), bin)),
             div(mul(static_cast<float>(index) + 0.5f, bin), static_cast<float>(ratio)));
}

// The two pixels a coordinate falls between along one axis (the same where
// it lies on or past the last), and its weight towards the second.
struct Span {
  int32_t low, high;
  float fraction;
};

LUMENBRIDGE_HOST_DEVICE Span span(float position, int32_t extent) {
  const float clamped = position > 0.0f ? position : 0.0f;
  const int32_t low = static_cast<int32_t>(clamped);
  if (low >= extent - 1) return {extent - 1, extent - 1, 0.0f};
  return {low, low + 1, add(clamped, -static_cast<float>(low))};
}

// One output pixel of every channel (out[c * channel_step]).
LUMENBRIDGE_HOST_DEVICE void output_pixel(const CropSource& source, int channels, int x, int y, uint8_t* out,
                                          int64_t channel_step) {
  float sums[kMaxCropChannels] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int iy = 0; iy < source.ratio; ++iy) {
    const Span row = span(sample_position(source.start_y, source.bin_h, y, iy, source.ratio), source.height);
    for (int ix = 0; ix < source.ratio; ++ix) {
      const Span column = span(sample_position(source.start_x, source.bin_w, x, ix, source.ratio), source.width);
      const float ly = row.fraction, lx = column.fraction;
      const float hy = add(1.0f, -ly), hx = add(1.0f, -lx);
      const float w1 = mul(hy, hx), w2 = mul(hy, lx), w3 = mul(ly, hx), w4 = mul(ly, lx);
      const int64_t top = row.low * source.y_step, bottom = row.high * source.y_step;
      const int64_t left = column.low * source.x_step, right = column.high * source.x_step;
      for (int c = 0; c < kMaxCropChannels && c < channels; ++c) {
        const uint8_t* plane = source.pixels + c * source.c_step;
        const float value = add(add(add(mul(w1, plane[top + left]), mul(w2, plane[top + right])),
                                    mul(w3, plane[bottom + left])),
                                mul(w4, plane[bottom + right]));
        sums[c] = add(sums[c], value);
      }
    }
  }
  const float count = static_cast<float>(source.ratio * source.ratio);
  for (int c = 0; c < kMaxCropChannels && c < channels; ++c) {
    const float rounded = round_half_even(div(sums[c], count));  // as torch.round
    out[c * channel_step] = static_cast<uint8_t>(rounded < 0.0f ? 0.0f : (rounded > 255.0f ? 255.0f : rounded));
  }
}

}  // namespace crop_math

#ifdef LUMENBRIDGE_WITH_CUDA
namespace cuda {
// Copies `sources` to the device and launches one kernel over every output pixel of `out` [B, C, S, S].
void crop_resize(const std::vector<CropSource>& sources, int channels, int size, at::Tensor& out);
}  // namespace cuda
#endif

}  // namespace lumenbridge

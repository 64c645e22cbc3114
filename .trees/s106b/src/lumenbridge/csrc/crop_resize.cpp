// lumenbridge::crop_resize (crop_resize.h says what it computes): its
// schema, its checks, its CPU kernel and its registration. The --decode gpu
// pipeline calls it once a batch on the GPU, where it replaces a float canvas,
// a copy per image and roi_align (gpu_decode.py keeps that as the reference).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "crop_resize.h"
#include "gateway.h"

namespace lumenbridge {
namespace {

// More samples an axis than any downscale to a tokenizer's input needs (a
// 100,000-pixel side to 32 is about 3,000), and few enough that ratio squared
// stays exact in float.
constexpr int64_t kMaxRatio = 4096;

void check_image(const at::Tensor& image, const at::Tensor& first, size_t index) {
  const std::string name = "images[" + text(static_cast<int64_t>(index)) + "]";
  TORCH_CHECK(image.scalar_type() == at::kByte, "LumenBridge: crop_resize takes uint8 images; ", name,
              " has dtype ", text(image.scalar_type()));
  TORCH_CHECK(image.layout() == at::kStrided, "LumenBridge: crop_resize takes dense images; ", name, " is sparse");
  TORCH_CHECK(image.dim() == 3, "LumenBridge: crop_resize takes images of shape [C, H, W]; ", name,
              " has shape ", text(image.sizes()));
  TORCH_CHECK(image.device() == first.device(), "LumenBridge: ", name, " is on ", text(image.device()),
              " but images[0] is on ", text(first.device()), "; all images must be on the same device");
  TORCH_CHECK(image.size(0) >= 1 && image.size(0) <= kMaxCropChannels, "LumenBridge: crop_resize takes 1 to ",
              text(kMaxCropChannels), " channels; ", name, " has ", text(image.size(0)));
  TORCH_CHECK(image.size(0) == first.size(0), "LumenBridge: crop_resize takes images of one channel count; ",
              "images[0] has ", text(first.size(0)), " and ", name, " has ", text(image.size(0)));
  TORCH_CHECK(image.size(1) >= 1 && image.size(2) >= 1 && image.size(1) <= kMaxExtent && image.size(2) <= kMaxExtent,
              "LumenBridge: ", name, " must have between 1 and ", text(kMaxExtent), " rows and columns, got shape ",
              text(image.sizes()));
}

// The box [x0, y0, x1, y1] of image `index` must lie inside it and hold at least part of a pixel.
CropSource check_box(const at::Tensor& image, at::ArrayRef<double> box, int64_t ratio, int64_t size,
                     size_t index) {
  const std::string name = "image " + text(static_cast<int64_t>(index));
  const double height = static_cast<double>(image.size(1)), width = static_cast<double>(image.size(2));
  const bool inside = std::isfinite(box[0]) && std::isfinite(box[1]) && std::isfinite(box[2]) &&
                      std::isfinite(box[3]) && 0.0 <= box[0] && box[0] < box[2] && box[2] <= width &&
                      0.0 <= box[1] && box[1] < box[3] && box[3] <= height;
  TORCH_CHECK(inside, "LumenBridge: the box of ", name, " must satisfy 0 <= x0 < x1 <= W and 0 <= y0 < y1 <= H for ",
              "its size ", text(image.size(2)), " x ", text(image.size(1)), " (W x H), got [", text(box[0]), ", ",
              text(box[1]), ", ", text(box[2]), ", ", text(box[3]), "]");
  TORCH_CHECK(ratio >= 1 && ratio <= kMaxRatio, "LumenBridge: the sample count of ", name, " must be between 1 and ",
              text(kMaxRatio), ", got ", text(ratio));
  // The box's corners are rounded to float first, as roi_align reads them.
  const float x0 = static_cast<float>(box[0]), y0 = static_cast<float>(box[1]);
  const float x1 = static_cast<float>(box[2]), y1 = static_cast<float>(box[3]);
  const float start_x = x0 - 0.5f, start_y = y0 - 0.5f;
  CropSource source;
  source.pixels = static_cast<const uint8_t*>(image.const_data_ptr());
  source.c_step = image.stride(0);
  source.y_step = image.stride(1);
  source.x_step = image.stride(2);
  source.height = static_cast<int32_t>(image.size(1));
  source.width = static_cast<int32_t>(image.size(2));
  source.start_x = start_x;
  source.start_y = start_y;
  source.bin_w = ((x1 - 0.5f) - start_x) / static_cast<float>(size);
  source.bin_h = ((y1 - 0.5f) - start_y) / static_cast<float>(size);
  source.ratio = static_cast<int32_t>(ratio);
  return source;
}

std::vector<CropSource> check_crop_resize(at::TensorList images, at::ArrayRef<double> boxes, at::IntArrayRef ratios,
                                          int64_t size) {
  TORCH_CHECK(!images.empty(), "LumenBridge: crop_resize needs at least one image");
  const auto count = static_cast<int64_t>(images.size());
  TORCH_CHECK(static_cast<int64_t>(boxes.size()) == 4 * count, "LumenBridge: crop_resize needs four box values an ",
              "image, [x0, y0, x1, y1] each: ", text(4 * count), " for ", text(count), " images, got ",
              text(static_cast<int64_t>(boxes.size())));
  TORCH_CHECK(static_cast<int64_t>(ratios.size()) == count, "LumenBridge: crop_resize needs one sample count an ",
              "image: ", text(count), ", got ", text(static_cast<int64_t>(ratios.size())));
  TORCH_CHECK(size >= 1 && size <= kMaxCropSize, "LumenBridge: crop_resize's size must be between 1 and ",
              text(kMaxCropSize), ", got ", text(size));
  const at::Device device = images[0].device();
#ifdef LUMENBRIDGE_WITH_CUDA
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), "LumenBridge: crop_resize runs on the CPU and on CUDA GPUs, not on ",
              text(device));
#else
  TORCH_CHECK(device.is_cpu(), "LumenBridge: crop_resize runs on the CPU (this build has no CUDA kernels), not on ",
              text(device));
#endif
  check_no_tangents({images});
  std::vector<CropSource> sources;
  sources.reserve(images.size());
  for (size_t i = 0; i < images.size(); ++i) {
    check_image(images[i], images[0], i);
    sources.push_back(check_box(images[i], boxes.slice(4 * i, 4), ratios[i], size, i));
  }
  return sources;
}

void crop_resize_cpu(const std::vector<CropSource>& sources, int channels, int size, uint8_t* out) {
  const int64_t plane = static_cast<int64_t>(size) * size;
  // One task a row of one output image; a row's pixels share nothing but their image.
  at::parallel_for(0, static_cast<int64_t>(sources.size()) * size, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t image = row / size;
      const int y = static_cast<int>(row % size);
      uint8_t* first = out + image * channels * plane + static_cast<int64_t>(y) * size;
      for (int x = 0; x < size; ++x) {
        crop_math::output_pixel(sources[image], channels, x, y, first + x, plane);
      }
    }
  });
}

at::Tensor crop_resize(at::TensorList images, at::ArrayRef<double> boxes, at::IntArrayRef ratios, int64_t size) {
  const std::vector<CropSource> sources = check_crop_resize(images, boxes, ratios, size);
  const auto count = static_cast<int64_t>(images.size());
  const auto channels = images[0].size(0);
  at::Tensor out = new_output({count, channels, size, size}, images[0].options(), at::MemoryFormat::Contiguous);
#ifdef LUMENBRIDGE_WITH_CUDA
  if (out.is_cuda()) {
    cuda::crop_resize(sources, static_cast<int>(channels), static_cast<int>(size), out);
    return out;
  }
#endif
  crop_resize_cpu(sources, static_cast<int>(channels), static_cast<int>(size), out.mutable_data_ptr<uint8_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lumenbridge, m) {
  m.def("crop_resize(Tensor[] images, float[] boxes, int[] ratios, int size) -> Tensor");
}

// One kernel for every device, the images' device picking the loop; composite,
// so that a call without any image reaches its check too.
TORCH_LIBRARY_IMPL(lumenbridge, CompositeExplicitAutograd, m) { m.impl("crop_resize", &crop_resize); }

}  // namespace lumenbridge

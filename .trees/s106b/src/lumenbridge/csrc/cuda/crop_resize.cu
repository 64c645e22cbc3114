// lumenbridge::crop_resize on the GPU: one thread an output pixel (all its
// channels), one grid over every image of the batch, reading each decoded
// image where it lies. The work is a few loads and multiplies a sample; what
// this removes is the float canvas, the copy into it per image and the
// conversions of the roi_align route.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>

#include "../crop_resize.h"

namespace lumenbridge {
namespace cuda {
namespace {

constexpr int kTile = 16;  // a block covers kTile x kTile output pixels of one image

__global__ void crop_resize_kernel(const CropSource* __restrict__ sources, int channels, int size,
                                   uint8_t* __restrict__ out) {
  const int x = blockIdx.y * kTile + threadIdx.x;
  const int y = blockIdx.z * kTile + threadIdx.y;
  if (x >= size || y >= size) return;
  const int64_t image = blockIdx.x;
  const int64_t plane = static_cast<int64_t>(size) * size;
  const CropSource source = sources[image];
  crop_math::output_pixel(source, channels, x, y, out + (image * channels) * plane + static_cast<int64_t>(y) * size + x,
                          plane);
}

}  // namespace

void crop_resize(const std::vector<CropSource>& sources, int channels, int size, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(out.device());
  const auto count = static_cast<int64_t>(sources.size());
  const int64_t bytes = count * static_cast<int64_t>(sizeof(CropSource));
  // Pinned, so the copy is asynchronous; the caching host allocator keeps the
  // block until the copy has run.
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.mutable_data_ptr(), sources.data(), bytes);
  const at::Tensor on_device = host.to(out.device(), /*non_blocking=*/true);
  // Images along x, which takes 2^31 - 1 blocks; kMaxCropSize keeps the tiles within y's and z's 65,535.
  const auto tiles = static_cast<unsigned>((size + kTile - 1) / kTile);
  const dim3 grid(static_cast<unsigned>(count), tiles, tiles);
  const dim3 block(kTile, kTile);
  crop_resize_kernel<<<grid, block, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const CropSource*>(on_device.const_data_ptr()), channels, size, out.mutable_data_ptr<uint8_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace lumenbridge

// The backward's two passes over the images' stage's depthwise convolution,
// reading the images as the op takes them (images.cuh: uint8 or the
// parameters' dtype, NCHW or NHWC, normalized and zero padded as they are
// read):
//   rows             its output as the pointwise GEMMs' rows [M, kRowAlignment]:
//                    the channels, a one, zeros (depthwise_rows_sizes(p, 0))
//   weight gradient  its weight and bias gradients from its output's gradient
//                    (dense NCHW, as the narrow pointwise backward writes it)
// Composed, both first normalize and pad the images into a dense NCHW copy
// (the NCHW depthwise kernels' input), and the rows take three more passes
// (fill, convolution, copy into the rows): 206 us of a training step at
// B = 256, bf16, on the H200, and 97 + 90 us for the copy and the weight
// gradient. Here each is one pass over the images.
// The weight sums are deterministic: each block owns a fixed set of tiles
// and reduces each channel in a fixed tree; pass 2 adds the blocks in order
// (partial_sums.cuh).
#include <c10/cuda/CUDAGuard.h>

#include "../tokenize_steps.h"
#include "common.cuh"
#include "images.cuh"
#include "partial_sums.cuh"

namespace lumenbridge {
namespace cuda {
namespace {

constexpr int kRowWidth = static_cast<int>(kRowAlignment);

// One channel of one image, as the first stage's input: zero outside the
// H x W image (the zero padding after normalization and the convolution's
// own padding are both zero).
template <typename In>
struct ImagePlane {
  const In* origin;
  int64_t y_step, x_step;
  int H, W;
  float mean, inv_std;

  __device__ __forceinline__ float at(int y, int x) const {
    if (y < 0 || y >= H || x < 0 || x >= W) return 0.0f;
    return normalized<In>(static_cast<float>(__ldg(origin + y * y_step + x * x_step)), mean, inv_std);
  }
};

template <typename In>
struct ImageReader {
  const In* images;
  int64_t image_step, c_step, y_step, x_step;
  int H, W;
  ImageNormalization normalization;

  // Channel c's constants by selection, not by a dynamic index into the
  // kernel's arguments (which copies them to local memory).
  __device__ __forceinline__ ImagePlane<In> plane(int64_t n, int c) const {
    float mean = 0.0f, inv_std = 1.0f;
#pragma unroll
    for (int k = 0; k < kMaxNormalizedChannels; ++k) {
      mean = k == c ? normalization.mean[k] : mean;
      inv_std = k == c ? normalization.inv_std[k] : inv_std;
    }
    return {images + n * image_step + c * c_step, y_step, x_step, H, W, mean, inv_std};
  }
};

template <typename In>
ImageReader<In> image_reader(const at::Tensor& images, const TokenizeProblem& p) {
  const bool nhwc = p.layout == Layout::NHWC;
  return {images.const_data_ptr<In>(),
          p.C * p.H * p.W,
          nhwc ? 1 : p.H * p.W,
          nhwc ? p.W * p.C : p.W,
          nhwc ? p.C : 1,
          static_cast<int>(p.H),
          static_cast<int>(p.W),
          image_normalization(p)};
}

// The convolution's geometry, from stage_depthwise_problem(p, 0, ...).
struct ImageConv {
  int C, Ho, Wo, stride, pad;
};

// One output pixel a thread, all channels: its row of kRowWidth values
// (rounded to T, as the convolution's output is) is one 16-byte store for
// half types. Grid: x pixels of an image, y images.
template <typename In, typename T, int K>
__global__ void __launch_bounds__(kThreads)
    images_depthwise_rows_kernel(ImageReader<In> images, const T* __restrict__ weight, const T* __restrict__ bias,
                                 T* __restrict__ rows, ImageConv conv, int64_t first_image) {
  constexpr int kTaps = K * K;
  __shared__ float taps[kMaxNormalizedChannels][kTaps + 1];  // bias last
  for (int i = threadIdx.x; i < conv.C * (kTaps + 1); i += kThreads) {
    const int c = i / (kTaps + 1), tap = i % (kTaps + 1);
    taps[c][tap] = static_cast<float>(tap < kTaps ? weight[c * kTaps + tap] : bias[c]);
  }
  __syncthreads();
  const int pixel = blockIdx.x * kThreads + threadIdx.x;
  if (pixel >= conv.Ho * conv.Wo) return;
  const int64_t n = first_image + blockIdx.y;
  const int y0 = pixel / conv.Wo * conv.stride - conv.pad, x0 = pixel % conv.Wo * conv.stride - conv.pad;
  Vec<T, kRowWidth> row;
#pragma unroll
  for (int c = 0; c < kRowWidth; ++c) {
    float value = c == conv.C ? 1.0f : 0.0f;  // the bias's column, then zeros
    if (c < kMaxNormalizedChannels && c < conv.C) {
      const ImagePlane<In> plane = images.plane(n, c);
      value = taps[c][kTaps];
#pragma unroll
      for (int ky = 0; ky < K; ++ky) {
#pragma unroll
        for (int kx = 0; kx < K; ++kx) value = fmaf(taps[c][ky * K + kx], plane.at(y0 + ky, x0 + kx), value);
      }
    }
    row.v[c] = static_cast<T>(value);
  }
  store_vec(rows + (n * conv.Ho * conv.Wo + pixel) * kRowWidth, row);
}

// Pass 1 of the weight gradient, over tiles of kWeightTileRows x 32 outputs
// of one image, all channels: the block loads the tile's image window once
// (every channel, normalized, zero outside the image) into shared memory,
// then warp c sums channel c's g x over the tile for every tap, and g for
// the bias, a lane a column. A block per channel reading channels-last
// images pulled every channel's bytes, and the channels' blocks each read
// the images again: 107 us a step at B = 256 for about 96 MB
// (benchmarks/NOTES.md, step 47). Blocks walk the tiles blockIdx.x,
// + gridDim.x, ...; partials is [C, gridDim.x, K * K + 1].
constexpr int kWeightTileRows = 8, kWeightTileColumns = 32;

// The tiles of pass 1: their grid over an image, and the blocks that walk them.
struct WeightTiles {
  int tiles_x, tiles_y;
  int64_t count, blocks;
};

// The window of a tile's image pixels its taps read, at stride 2 (the widest).
template <int K>
struct WeightWindow {
  static constexpr int kRows = (kWeightTileRows - 1) * 2 + K, kColumns = (kWeightTileColumns - 1) * 2 + K;
  static constexpr int kSlots = ceil_div(kRows * kColumns, kThreads);  // window positions a thread loads
};

template <typename In, typename T, int K>
__global__ void __launch_bounds__(kThreads)
    images_depthwise_weight_kernel(ImageReader<In> images, const T* __restrict__ grad_output,
                                   float* __restrict__ partials, ImageConv conv, WeightTiles tiles) {
  using Window = WeightWindow<K>;
  constexpr int kTaps = K * K, kSums = kTaps + 1;  // taps, then the bias
  __shared__ float window[kMaxNormalizedChannels][Window::kRows * Window::kColumns];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows = (kWeightTileRows - 1) * conv.stride + K, columns = (kWeightTileColumns - 1) * conv.stride + K;
  float sums[kSums] = {};
  for (int64_t tile = blockIdx.x; tile < tiles.count; tile += gridDim.x) {
    const int oy0 = static_cast<int>(tile / tiles.tiles_x % tiles.tiles_y) * kWeightTileRows;
    const int ox0 = static_cast<int>(tile % tiles.tiles_x) * kWeightTileColumns;
    const int64_t n = tile / tiles.tiles_x / tiles.tiles_y;
    const int y0 = oy0 * conv.stride - conv.pad, x0 = ox0 * conv.stride - conv.pad;
    // Every load of the tile (the window's, then this warp's gradients) is
    // issued before any is used: a block waits one memory round trip a tile.
    float x[kMaxNormalizedChannels][Window::kSlots];
#pragma unroll
    for (int c = 0; c < kMaxNormalizedChannels; ++c) {
      if (c >= conv.C) break;
      const ImagePlane<In> plane = images.plane(n, c);
#pragma unroll
      for (int s = 0; s < Window::kSlots; ++s) {
        const int q = threadIdx.x + s * kThreads;
        x[c][s] = plane.at(y0 + q / columns, x0 + q % columns);
      }
    }
    // This lane's outputs: column ox, the tile's first `tile_rows` rows.
    const int ox = ox0 + lane, tile_rows = min(kWeightTileRows, conv.Ho - oy0);
    const bool sums_outputs = warp < conv.C && ox < conv.Wo;
    float g[kWeightTileRows];
#pragma unroll
    for (int r = 0; r < kWeightTileRows; ++r) {
      g[r] = sums_outputs && r < tile_rows
                 ? static_cast<float>(grad_output[((n * conv.C + warp) * conv.Ho + oy0 + r) * conv.Wo + ox])
                 : 0.0f;
    }
#pragma unroll
    for (int c = 0; c < kMaxNormalizedChannels; ++c) {
      if (c >= conv.C) break;
#pragma unroll
      for (int s = 0; s < Window::kSlots; ++s) {
        const int q = threadIdx.x + s * kThreads;
        if (q < rows * columns) window[c][q] = x[c][s];
      }
    }
    __syncthreads();
    // Only the outputs inside the extent: a pixel only outputs past it read
    // (one the convolution leaves out) adds nothing, even if not finite.
    if (sums_outputs) {
      const float* own = window[warp] + lane * conv.stride;
#pragma unroll
      for (int r = 0; r < kWeightTileRows; ++r) {
        if (r >= tile_rows) break;
#pragma unroll
        for (int t = 0; t < kTaps; ++t) {
          sums[t] = fmaf(g[r], own[(r * conv.stride + t / K) * columns + t % K], sums[t]);
        }
        sums[kTaps] += g[r];
      }
    }
    __syncthreads();  // the next tile's window overwrites this one
  }
  if (warp >= conv.C) return;
#pragma unroll
  for (int i = 0; i < kSums; ++i) {
    const float total = warp_sum(sums[i]);
    if (lane == 0) partials[(static_cast<int64_t>(warp) * gridDim.x + blockIdx.x) * kSums + i] = total;
  }
}

// Blocks of pass 1: at most kWeightBlocks (at K = 3, 76 registers a
// thread, three an SM: one wave on the H200), fewer where there are fewer
// tiles. A function of the shape alone, so the sums are the same on every GPU.
constexpr int64_t kWeightBlocks = 396;
WeightTiles weight_tiles(int64_t N, int Ho, int Wo) {
  WeightTiles t;
  t.tiles_x = ceil_div(Wo, kWeightTileColumns);
  t.tiles_y = ceil_div(Ho, kWeightTileRows);
  t.count = N * t.tiles_x * t.tiles_y;
  t.blocks = std::min(t.count, kWeightBlocks);
  return t;
}

ImageConv image_conv(const TokenizeProblem& p) {
  const DepthwiseProblem dw = stage_depthwise_problem(p, 0, Layout::NCHW);
  return {static_cast<int>(dw.C), static_cast<int>(dw.Ho), static_cast<int>(dw.Wo), static_cast<int>(dw.stride),
          static_cast<int>(dw.pad)};
}

// Runs body(In{}, T{}, K constant) for the problem's image type, dtype and K.
template <typename Body>
void dispatch_images(const TokenizeProblem& p, Body&& body) {
  LUMENBRIDGE_DISPATCH_CUDA_TYPES(p.dtype, "lumenbridge_images_stage", [&] {
    using T = scalar_t;
    dispatch_kernel_size(p.K, [&](auto k) {
      if (p.uint8_input) {
        body(uint8_t{}, T{}, k);
      } else {
        body(T{}, T{}, k);
      }
    });
  });
}

// The kernels take the images' stage where its rows are narrow (the images'
// few channels) and every extent fits an int.
// The convolution runs over the padded Hp x Wp extents.
bool images_stage_covered(const TokenizeProblem& p) {
  const int64_t pixels = p.stages[0].out_h * p.stages[0].out_w;
  return depthwise_row_width(p.C) == kRowAlignment && p.Hp <= kMaxExtent && p.Wp <= kMaxExtent &&
         pixels <= kMaxExtent;
}

}  // namespace

at::Tensor images_depthwise_rows(const at::Tensor& images, const TokenizeProblem& p) {
  if (!images_stage_covered(p)) return images_depthwise_rows_composed(images, p, backward_kernels());
  const c10::cuda::CUDAGuard guard(images.device());
  const at::Tensor x = dense(images, p.layout);
  at::Tensor rows =
      new_output(depthwise_rows_sizes(p, 0), images.options().dtype(p.dtype), at::MemoryFormat::Contiguous);
  const ImageConv conv = image_conv(p);
  const TokenizeStage& s = p.stages[0];
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_images(p, [&](auto in, auto t, auto k) {
    using In = decltype(in);
    using T = decltype(t);
    const ImageReader<In> reader = image_reader<In>(x, p);
    for_each_batch_slice(p.N, [&](int64_t n0, unsigned count) {
      images_depthwise_rows_kernel<In, T, decltype(k)::value>
          <<<dim3(grid_x(ceil_div64(int64_t{conv.Ho} * conv.Wo, kThreads)), count), kThreads, 0, stream>>>(
              reader, s.dw_weight.const_data_ptr<T>(), s.dw_bias.const_data_ptr<T>(), rows.mutable_data_ptr<T>(),
              conv, n0);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return rows;
}

std::tuple<at::Tensor, at::Tensor> images_depthwise_backward_weight(const at::Tensor& grad_depthwise,
                                                                     const at::Tensor& images,
                                                                     const TokenizeProblem& p) {
  if (!images_stage_covered(p)) {
    return images_depthwise_backward_weight_composed(grad_depthwise, images, p, backward_kernels());
  }
  const c10::cuda::CUDAGuard guard(images.device());
  const at::Tensor x = dense(images, p.layout);
  const at::Tensor g = grad_depthwise.contiguous();
  const auto options = g.options();
  at::Tensor grad_weight = new_output({p.C, 1, p.K, p.K}, options, at::MemoryFormat::Contiguous);
  at::Tensor grad_bias = new_output({p.C}, options, at::MemoryFormat::Contiguous);
  const ImageConv conv = image_conv(p);
  const WeightTiles tiles = weight_tiles(p.N, conv.Ho, conv.Wo);
  const int sums = static_cast<int>(p.K * p.K) + 1;
  at::Tensor partials = at::zeros({p.C, tiles.blocks, sums}, options.dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_images(p, [&](auto in, auto t, auto k) {
    using In = decltype(in);
    using T = decltype(t);
    if (tiles.blocks > 0) {
      images_depthwise_weight_kernel<In, T, decltype(k)::value><<<grid_x(tiles.blocks), kThreads, 0, stream>>>(
          image_reader<In>(x, p), g.const_data_ptr<T>(), partials.mutable_data_ptr<float>(), conv, tiles);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    sum_partials<T>(partials.const_data_ptr<float>(), p.C, tiles.blocks, sums,
                    {grad_weight.mutable_data_ptr<T>(), grad_bias.mutable_data_ptr<T>(), sums - 1, 1}, stream);
  });
  return {grad_weight, grad_bias};
}

}  // namespace cuda
}  // namespace lumenbridge

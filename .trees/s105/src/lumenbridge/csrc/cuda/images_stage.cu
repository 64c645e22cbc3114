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
// The weight sums are deterministic: each block owns a fixed set of output
// rows of one channel and reduces in a fixed tree; pass 2 adds the blocks in
// order (partial_sums.cuh).
#include <c10/cuda/CUDAGuard.h>

#include "../tokenize_steps.h"
#include "common.cuh"
#include "images.cuh"
#include "partial_sums.cuh"
#include "weight_partials.cuh"

namespace lumenbridge {
namespace cuda {
namespace {

constexpr int kRowWidth = static_cast<int>(kRowAlignment);

// One channel of one image, as the first stage's input: zero outside the
// H x W image (the zero padding after normalization and the convolution's
// own padding are both zero). A kernel finds each row once (row) and reads
// its taps from it: at gives zero outside the image, value reads a column
// inside it (of a row outside, from the row it was clamped to). The row's
// test and 64-bit offset are then not repeated at every tap, and one
// unsigned test covers both row and column.
template <typename In>
struct ImagePlane {
  const In* origin;
  int64_t y_step;
  uint32_t x_bytes;  // a column's step in bytes: C elements (NHWC) or 1 (NCHW)
  int H, W;
  float mean, inv_std;

  // A row's first byte (row y clamped into the image), and its width: 0
  // outside the image.
  struct Row {
    const char* start;
    unsigned width;
  };

  __device__ __forceinline__ Row row(int y) const {
    const bool inside = static_cast<unsigned>(y) < static_cast<unsigned>(H);
    return {reinterpret_cast<const char*>(origin + min(max(y, 0), H - 1) * y_step),
            inside ? static_cast<unsigned>(W) : 0u};
  }

  __device__ __forceinline__ float at(Row row, int x) const {
    const unsigned column = static_cast<unsigned>(x);
    return column < row.width ? value(row, column) : 0.0f;
  }

  // The value in a column inside the image, of the row or (outside the
  // image) of the row it was clamped to.
  __device__ __forceinline__ float value(Row row, unsigned column) const {
    const In v = __ldg(reinterpret_cast<const In*>(row.start + static_cast<uint64_t>(column) * x_bytes));
    return normalized<In>(static_cast<float>(v), mean, inv_std);
  }
};

template <typename In>
struct ImageReader {
  const In* images;
  int64_t image_step, c_step, y_step;
  uint32_t x_bytes;
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
    return {images + n * image_step + c * c_step, y_step, x_bytes, H, W, mean, inv_std};
  }
};

template <typename In>
ImageReader<In> image_reader(const at::Tensor& images, const TokenizeProblem& p) {
  const bool nhwc = p.layout == Layout::NHWC;
  return {images.const_data_ptr<In>(),
          p.C * p.H * p.W,
          nhwc ? 1 : p.H * p.W,
          nhwc ? p.W * p.C : p.W,
          static_cast<uint32_t>((nhwc ? p.C : 1) * sizeof(In)),
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
        const typename ImagePlane<In>::Row image_row = plane.row(y0 + ky);
#pragma unroll
        for (int kx = 0; kx < K; ++kx) value = fmaf(taps[c][ky * K + kx], plane.at(image_row, x0 + kx), value);
      }
    }
    row.v[c] = static_cast<T>(value);
  }
  store_vec(rows + (n * conv.Ho * conv.Wo + pixel) * kRowWidth, row);
}

// One output row's products added to `sums` (the K x K taps, then the
// bias), lanes along the row. No tap is conditional (a conditional tap took
// seven or eight instructions and kept a row's loads from starting before
// the last row's sums, SASS): each reads its row and column clamped into the
// image, and a tap outside it takes g times 0 as its gradient, which adds g
// x 0 to its sum as its zero value would: the block's sums are those of
// reading zeros, bit for bit (a thread's may differ in the sign of a zero
// sum, which the block's reduction drops), for an image whose edges are
// finite (an inf or NaN there now reaches the taps outside it too).
// kRowsInside: every row of `rows` lies inside the image (all output rows
// but those whose window reaches the padding above or below it), so only
// the columns' weights apply.
template <bool kRowsInside, typename In, typename T, int K>
__device__ __forceinline__ void add_output_row(const ImagePlane<In>& plane, const typename ImagePlane<In>::Row* rows,
                                               const float* row_weight, const T* g_row, const ImageConv& conv,
                                               int lane, float* sums) {
  for (int ox = lane; ox < conv.Wo; ox += 32) {
    const float g = static_cast<float>(g_row[ox]);
    const int x0 = ox * conv.stride - conv.pad;
    unsigned column[K];
    float g_column[K];
#pragma unroll
    for (int kx = 0; kx < K; ++kx) {
      const int x = x0 + kx;
      column[kx] = static_cast<unsigned>(min(max(x, 0), plane.W - 1));
      g_column[kx] = g * (static_cast<unsigned>(x) < static_cast<unsigned>(plane.W) ? 1.0f : 0.0f);
    }
#pragma unroll
    for (int ky = 0; ky < K; ++ky) {
#pragma unroll
      for (int kx = 0; kx < K; ++kx) {
        const float g_tap = kRowsInside ? g_column[kx] : g_column[kx] * row_weight[ky];
        sums[ky * K + kx] = fmaf(g_tap, plane.value(rows[ky], column[kx]), sums[ky * K + kx]);
      }
    }
    sums[K * K] += g;
  }
}

// Pass 1 of the weight gradient: block (chunk, c) takes channel c's output
// rows over the batch (row r is image r / Ho, output row r % Ho), its warp w
// the rows chunk * kWarps + w + k * chunks * kWarps, a row at a time, lanes
// along it. Each thread sums g x over its outputs for every tap, and g for
// the bias.
constexpr int kWarps = kThreads / 32;

template <typename In, typename T, int K>
__global__ void __launch_bounds__(kThreads)
    images_depthwise_weight_kernel(ImageReader<In> images, const T* __restrict__ grad_output,
                                   float* __restrict__ partials, ImageConv conv, int64_t output_rows, int chunks) {
  constexpr int kSums = K * K + 1;  // taps, then the bias
  __shared__ float warp_sums[kWarps][kSums];
  const int chunk = blockIdx.x, c = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float sums[kSums] = {};
  for (int64_t r = static_cast<int64_t>(chunk) * kWarps + warp; r < output_rows;
       r += static_cast<int64_t>(chunks) * kWarps) {
    const int64_t n = r / conv.Ho;
    const int oy = static_cast<int>(r - n * conv.Ho);
    const T* g_row = grad_output + ((n * conv.C + c) * conv.Ho + oy) * conv.Wo;
    const ImagePlane<In> plane = images.plane(n, c);
    typename ImagePlane<In>::Row rows[K];  // every output of the row reads these K image rows
    float row_weight[K];                   // 1, or 0 outside the image
    bool rows_inside = true;
#pragma unroll
    for (int ky = 0; ky < K; ++ky) {
      rows[ky] = plane.row(oy * conv.stride - conv.pad + ky);
      row_weight[ky] = rows[ky].width != 0 ? 1.0f : 0.0f;
      rows_inside = rows_inside && rows[ky].width != 0;
    }
    if (rows_inside) {
      add_output_row<true, In, T, K>(plane, rows, row_weight, g_row, conv, lane, sums);
    } else {
      add_output_row<false, In, T, K>(plane, rows, row_weight, g_row, conv, lane, sums);
    }
  }
  store_channel_partials<kSums>(sums, warp_sums, threadIdx.x, c, chunk, chunks, partials);
}

// Blocks per channel of pass 1: about kWeightBlocks over all channels (four
// an SM on the H200, one wave), fewer where there are few output rows. A
// function of the shape alone, so the sums are the same on every GPU.
constexpr int64_t kWeightBlocks = 528;
int64_t weight_chunks(int64_t output_rows, int64_t channels) {
  return std::max<int64_t>(1, std::min(ceil_div64(output_rows, kWarps), ceil_div64(kWeightBlocks, channels)));
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
  const int64_t output_rows = p.N * conv.Ho;
  const int64_t chunks = weight_chunks(output_rows, p.C);
  const int sums = static_cast<int>(p.K * p.K) + 1;
  at::Tensor partials = at::zeros({p.C, chunks, sums}, options.dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_images(p, [&](auto in, auto t, auto k) {
    using In = decltype(in);
    using T = decltype(t);
    if (output_rows > 0) {
      images_depthwise_weight_kernel<In, T, decltype(k)::value>
          <<<dim3(grid_x(chunks), grid_y(p.C, "image channels")), kThreads, 0, stream>>>(
              image_reader<In>(x, p), g.const_data_ptr<T>(), partials.mutable_data_ptr<float>(), conv,
              output_rows, static_cast<int>(chunks));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    sum_partials<T>(partials.const_data_ptr<float>(), p.C, chunks, sums,
                    {grad_weight.mutable_data_ptr<T>(), grad_bias.mutable_data_ptr<T>(), sums - 1, 1}, stream);
  });
  return {grad_weight, grad_bias};
}

}  // namespace cuda
}  // namespace lumenbridge

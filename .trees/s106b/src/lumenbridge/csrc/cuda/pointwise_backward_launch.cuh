// What the one-pass pointwise backward kernels (pointwise_backward_narrow.cu
// and pointwise_backward_wide.cu) share: their tiles of rows, and their
// launch: the outputs, a fixed run of tiles a block (so the sums depend on
// the shape alone), the kernel, and the fixed-order pass 2 of the weight
// and bias sums.
#pragma once

#include <c10/cuda/CUDAGuard.h>

#include <limits>
#include <optional>

#include "../tokenize.h"
#include "common.cuh"
#include "partial_sums.cuh"
#include "pipeline.cuh"
#include "weight_partials.cuh"

namespace lumenbridge {
namespace cuda {

constexpr int kOnePassTileRows = 64;   // consecutive rows of g and d a tile
constexpr int kOnePassBlockRows = 16;  // an mma's M (g_d) or K (weight sums)

// The kernel's launch, with its parameters: g [M, C], d's rows, W [C, cin];
// g_d ([N, cin, Ho, Wo]: `grad_depthwise` where given, else new in
// `grad_depthwise_format`) and the blocks' partial
// sums [C, chunks, cin + 1]; M, C, cin, then `extent`, the kernel's own (its
// rows' width, or the pixels of a g_d plane); the tiles, their count, a
// block's run of them and the number of runs (chunks). `shared` is its
// dynamic shared memory; where that does not fit the device, nullopt (the
// caller falls back).
template <typename T, typename Kernel, typename Extent>
std::optional<PointwiseGrads> launch_one_pass(Kernel kernel, int threads, size_t shared, int64_t target_blocks,
                                              Extent extent,
                                              at::MemoryFormat grad_depthwise_format, at::Tensor grad_depthwise,
                                              const at::Tensor& grad,
                                              const at::Tensor& rows, const at::Tensor& weight,
                                              const DepthwiseProblem& p) {
  if (shared > max_shared_bytes_per_block()) return std::nullopt;
  const int64_t cin = p.C, M = grad.size(0), C = grad.size(1);
  const c10::cuda::CUDAGuard guard(grad.device());
  TORCH_INTERNAL_ASSERT(M == p.N * p.Ho * p.Wo && rows.size(0) == M && weight.numel() == C * cin);
  const int64_t tiles = ceil_div64(M, kOnePassTileRows);
  TORCH_CHECK(tiles <= std::numeric_limits<int32_t>::max(), "LumenBridge: too many pixels for one launch (",
              text(M), ")");
  const int run = tiles_per_block(tiles, 1, target_blocks);
  const int64_t chunks = ceil_div64(tiles, run);
  const auto options = grad.options();
  PointwiseGrads out;
  out.grad_depthwise = grad_depthwise.defined() ? std::move(grad_depthwise)
                                                : new_output({p.N, cin, p.Ho, p.Wo}, options, grad_depthwise_format);
  out.weight = new_output({C, cin, 1, 1}, options, at::MemoryFormat::Contiguous);
  out.bias = new_output({C}, options, at::MemoryFormat::Contiguous);
  at::Tensor partials = at::empty({C, chunks, cin + 1}, options.dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  allow_shared_bytes(kernel, shared);
  kernel<<<grid_x(chunks), threads, shared, stream>>>(
      grad.const_data_ptr<T>(), rows.const_data_ptr<T>(), weight.const_data_ptr<T>(),
      out.grad_depthwise.mutable_data_ptr<T>(), partials.mutable_data_ptr<float>(), M, static_cast<int>(C),
      static_cast<int>(cin), extent, tile_space<1>({tiles}, 1), static_cast<int>(tiles), run,
      static_cast<int>(chunks));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sum_partials<T>(partials.const_data_ptr<float>(), C, chunks, static_cast<int>(cin + 1),
                  {out.weight.mutable_data_ptr<T>(), out.bias.mutable_data_ptr<T>(), static_cast<int>(cin), 1},
                  stream);
  return out;
}

}  // namespace cuda
}  // namespace lumenbridge

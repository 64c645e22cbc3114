// The second pass of the deterministic reductions (the depthwise and
// LayerNorm parameter gradients): per-block partial sums [outer, count,
// inner] in float, summed over count in a fixed order by one warp per sum.
// Lane l adds k = l, l + 32, ... in order, then warp_sum adds the lanes in a
// fixed tree, so the result depends on the shape alone; a thread per sum
// walking all of count took 16-27 us on the H200 for sums of 264-1024 terms.
#pragma once

#include "common.cuh"

namespace lumenbridge {
namespace cuda {

// Where the sums of row a of [outer, inner] go, in T: i < first_width to
// first[a * first_width + i], the rest to second[a * second_width + i - first_width].
template <typename T>
struct SplitSums {
  T* first;
  T* second;
  int first_width, second_width;
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    sum_partials_kernel(const float* __restrict__ partials, int64_t sums, int64_t count, int inner,
                        SplitSums<T> out) {
  const int64_t sum = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (sum >= sums) return;  // whole warps: kThreads is a multiple of 32
  const int64_t row = sum / inner;
  const int i = static_cast<int>(sum - row * inner);
  const float* p = partials + row * count * inner + i;
  float total = 0.0f;
  for (int64_t k = lane; k < count; k += 32) total += p[k * inner];
  total = warp_sum(total);
  if (lane != 0) return;
  if (i < out.first_width) {
    out.first[row * out.first_width + i] = static_cast<T>(total);
  } else {
    out.second[row * out.second_width + i - out.first_width] = static_cast<T>(total);
  }
}

template <typename T>
void sum_partials(const float* partials, int64_t outer, int64_t count, int inner, SplitSums<T> out,
                  cudaStream_t stream) {
  const int64_t sums = outer * inner;
  sum_partials_kernel<T><<<grid_x(ceil_div64(sums * 32, kThreads)), kThreads, 0, stream>>>(partials, sums, count,
                                                                                         inner, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace lumenbridge

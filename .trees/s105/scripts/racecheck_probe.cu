// Does compute-sanitizer's racecheck order shared-memory accesses across each
// way a warp-specialized kernel can hand a buffer between two groups of warps?
// 8 producer warps fill one of two shared buffers per round while 8 consumer
// warps sum the other; the hand-over is, per variant:
//   syncthreads  __syncthreads() in code both roles reach, after each side (the control)
//   named        the same two hand-overs as named barriers (bar.sync 1 and 2, 512 threads),
//                each reached from each role's own code
//   arrive       full / empty named barriers: bar.arrive by the side that hands over, bar.sync by the side that waits
//   mbarrier     full / empty mbarriers, phase-parity waits (the Hopper pipelines' form)
// Each variant checks its sums; run the binary under racecheck to see which
// hand-overs the tool reports as hazards although the sums are right.
// Build: nvcc -arch=sm_90 -O2 -o racecheck_probe racecheck_probe.cu
// Run:   compute-sanitizer --tool racecheck ./racecheck_probe [syncthreads|named|arrive|mbarrier]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>

constexpr int kThreads = 512, kHalf = kThreads / 2, kElems = 2048, kRounds = 8;

__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [%0]; }" ::"r"(smem_address(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_address(bar)), "r"(parity)
        : "memory");
  }
}

// What producers write to element i in round `round`; the host sums the same values.
__host__ __device__ float value(int round, int i) { return static_cast<float>((round * 131 + i * 7) % 97); }

enum Variant { SYNCTHREADS, NAMED, ARRIVE, MBARRIER };

// Producers write buffer r & 1 in round r; consumers add it up in round r.
__global__ void __launch_bounds__(kThreads, 1) probe(int variant, float* sums) {
  __shared__ float buffer[2][kElems];
  __shared__ uint64_t full[2], empty[2];
  const bool producer = threadIdx.x < kHalf;
  const int t = threadIdx.x % kHalf;
  if (threadIdx.x == 0) {
    for (int b = 0; b < 2; ++b) {
      mbar_init(&full[b], kHalf);
      mbar_init(&empty[b], kHalf);
    }
  }
  __syncthreads();
  float sum = 0.0f;
  for (int r = 0; r < kRounds; ++r) {
    const int b = r & 1;
    const uint32_t parity = (r >> 1) & 1;  // of the phase that round r's use of buffer b completes
    if (producer) {
      if (variant == ARRIVE && r >= 2) named_sync(3 + b, kThreads);  // consumers emptied buffer b
      if (variant == MBARRIER && r >= 2) mbar_wait(&empty[b], parity ^ 1);
      for (int i = t; i < kElems; i += kHalf) buffer[b][i] = value(r, i);
      if (variant == ARRIVE) named_arrive(1 + b, kThreads);  // buffer b full
      if (variant == MBARRIER) mbar_arrive(&full[b]);
      if (variant == NAMED) named_sync(1, kThreads);
    } else if (variant == NAMED) {
      named_sync(1, kThreads);
    }
    if (variant == SYNCTHREADS) __syncthreads();
    if (!producer) {
      if (variant == ARRIVE) named_sync(1 + b, kThreads);
      if (variant == MBARRIER) mbar_wait(&full[b], parity);
      for (int i = t; i < kElems; i += kHalf) sum += buffer[b][i];
      if (variant == ARRIVE && r + 2 < kRounds) named_arrive(3 + b, kThreads);
      if (variant == MBARRIER) mbar_arrive(&empty[b]);
      if (variant == NAMED) named_sync(2, kThreads);
    } else if (variant == NAMED) {
      named_sync(2, kThreads);
    }
    if (variant == SYNCTHREADS) __syncthreads();
  }
  if (!producer) sums[t] = sum;
}

int main(int argc, char** argv) {
  const char* names[] = {"syncthreads", "named", "arrive", "mbarrier"};
  int first = SYNCTHREADS, last = MBARRIER;  // a variant's name as the argument runs it alone
  if (argc > 1) {
    first = MBARRIER + 1;
    for (int v = SYNCTHREADS; v <= MBARRIER; ++v) {
      if (std::strcmp(argv[1], names[v]) == 0) first = last = v;
    }
    if (first > MBARRIER) {
      std::fprintf(stderr, "usage: racecheck_probe [syncthreads|named|arrive|mbarrier]\n");
      return 2;
    }
  }
  float expected[kHalf] = {};
  for (int r = 0; r < kRounds; ++r) {
    for (int i = 0; i < kElems; ++i) expected[i % kHalf] += value(r, i);
  }
  float* sums;
  cudaMalloc(&sums, sizeof(float) * kHalf);
  int failures = 0;
  for (int v = first; v <= last; ++v) {
    cudaMemset(sums, 0xff, sizeof(float) * kHalf);  // poison: NaN
    probe<<<1, kThreads>>>(v, sums);
    cudaError_t error = cudaDeviceSynchronize();
    float got[kHalf];
    cudaMemcpy(got, sums, sizeof(got), cudaMemcpyDeviceToHost);
    int wrong = 0;
    for (int i = 0; i < kHalf; ++i) wrong += got[i] != expected[i];
    std::printf("%-12s %s, %d of %d sums wrong\n", names[v], error == cudaSuccess ? "ran" : cudaGetErrorString(error),
                wrong, kHalf);
    failures += wrong != 0 || error != cudaSuccess;
  }
  cudaFree(sums);
  return failures == 0 ? 0 : 1;
}

// Phase clocks, in development builds only (-DLUMENBRIDGE_PHASE_CLOCKS:
// LUMENBRIDGE_PHASE_CLOCKS=1 at build time; scripts/phase_clock.py): thread 0
// of each block of the fused kernels stamps the global timer and its SM's
// cycle counter at each phase boundary of its tiles (the last tile's stamps
// stay), which lumenbridge::phase_clocks (tokenize_fused.cu) returns: how
// long each phase takes on every block, and so which block and phase hold a
// one-wave launch, which stall samples do not show. Elsewhere the marks
// compile to nothing. scripts/phase_clock.py labels the stamps with the
// enumerators below, read from this file.
#pragma once

namespace lumenbridge {
namespace cuda {
namespace fused {
namespace {

// Which kernel stamps (a wide stage kernel has 16 warps a block), each kind
// twice: plain, then split (clock_kernel).
enum ClockKernel { kFirstKernel, kStageKernel, kWideStageKernel, kClockKinds };
enum PhaseMark {
  kStart,
  kPrologue,      // the block's once-only set-up (the first kernel's weights and taps)
  kEarlierTiles,  // the top of the block's last tile: every tile before it
  kTileSetup,     // a stage kernel's row table (and on a block's first tile its taps and the wait)
  kWindow,        // the first kernel's row table and image window
  kStage1Depthwise,
  kStage1Pointwise,
  kDepthwise,
  kExchange,
  kGemm,
  kOwnStatistics,  // a token norm's row statistics over the block's columns, sent to the other parts
  kStatistics,     // and combined with theirs
  kEpilogue,
  kPhaseMarks
};
constexpr int kClockBlocks = 2048;

constexpr int clock_kernel(ClockKernel kind, bool split) { return kind + (split ? kClockKinds : 0); }

#ifdef LUMENBRIDGE_PHASE_CLOCKS
__device__ unsigned long long phase_clocks[2 * kClockKinds][kClockBlocks][kPhaseMarks][2];

__device__ __forceinline__ void phase_mark(int kernel, PhaseMark mark) {
  if (threadIdx.x == 0 && blockIdx.x < kClockBlocks) {
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    phase_clocks[kernel][blockIdx.x][mark][0] = ns;
    phase_clocks[kernel][blockIdx.x][mark][1] = clock64();
  }
}
#else
__device__ __forceinline__ void phase_mark(int, PhaseMark) {}
#endif

}  // namespace
}  // namespace fused
}  // namespace cuda
}  // namespace lumenbridge

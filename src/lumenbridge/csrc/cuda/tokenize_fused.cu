// lumenbridge::tokenize on CUDA: the whole tokenizer in S - 1 launches for S
// stages (one more for each stage kernel that runs whole waves and then a
// split last wave), bf16 or fp16, intermediates in NHWC. Where a kernel
// leaves SMs idle (small batches), the next one starts its blocks there
// before it ends (programmatic dependent launch, sm_90).
//
//   first kernel   images (uint8 or T, NCHW or NHWC) -> stage 1 -> stage 2 output,
//                  one wave of persistent blocks. Stage 2's 8 x 8 output tiles
//                  compute the stage-1 outputs they need (halo included)
//                  straight from the image window, so the stage-1 activation
//                  never reaches device memory: the stage-1 depthwise in float
//                  on CUDA cores, its pointwise step (K = the image channels)
//                  on the tensor cores as m16n8k8, all stage-1 channels at once
//                  into shared memory. Where its tiles, split, still fit one
//                  wave (lumenbridge-base at B = 1), a tile splits between
//                  the blocks of a cluster (sm_90) by stage 2's input channel
//                  groups and output columns.
//   stage kernel   stage i output -> stage i + 1 output, one per later stage;
//                  blocks take 64 consecutive output pixels, so no tile is
//                  partly empty at 28 x 28 or 14 x 14.
// Either kernel's last instance writes the tokens: bias, token LayerNorm and
// the requested layout in its epilogue. Every kernel computes its depthwise
// tile into shared memory (after stage 1 on the tensor cores, as diagonal
// mma) and multiplies it on the tensor cores (fused_parts.cuh); nothing but
// stage outputs (and, for tokenize_for_training, what the backward would
// otherwise recompute) leaves the SM.
#include <c10/cuda/CUDAGuard.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "depthwise_forward.cuh"
#include "fused_parts.cuh"
#include "images.cuh"

#ifdef LUMENBRIDGE_PHASE_CLOCKS
#include <torch/library.h>
#endif

namespace lumenbridge {
namespace cuda {
namespace fused {
namespace {

constexpr int kTile = 8;  // first kernel: stage-2 tiles of kTile x kTile pixels
static_assert(kTile * kTile == kTileRows, "a first-kernel tile is one GEMM block");
constexpr int kMaxImageChannels = 4;
static_assert(kMaxImageChannels <= kMaxNormalizedChannels, "the images' channels are normalized");

// Fields of one pointwise stage shared by both kernels.
template <typename T>
struct StageGemm {
  const T* dw_weight;  // [Cin, 1, K, K]
  const T* dw_bias;
  PointwiseWeight<T> pw;
  int k_padded;              // Cin rounded up to kChannelGroup
  Divisor channel_groups;    // k_padded / kChannelGroup
  TileOutput<T> output;
  T* saved_rows;         // tokenize_for_training: A's rows, [pixels, 8 * saved_units]; else null
  Divisor saved_units;   // 16-byte units of a saved row
};

// Shared memory of a block: row bookkeeping, A, then a region that holds the
// producer's scratch and, once A is complete, the output tile.
struct SharedLayout {
  size_t a_offset, region_offset, total;
};

// Bytes of a block's output tile, which starts the region.
size_t out_tile_bytes(int out_channels, size_t elem) {
  return kTileRows * padded_stride(round_up(out_channels, 8)) * elem;
}

size_t a_tile_bytes(int k_padded, size_t elem) { return align16(kTileRows * padded_stride(k_padded) * elem); }

// `splits`: whether the kernel's tiles may split between a cluster's
// blocks; one whose tiles never do gives RowInfo's part_stats to A.
SharedLayout shared_layout(int k_padded, size_t scratch_bytes, int out_channels, size_t elem, bool splits) {
  SharedLayout l;
  l.a_offset = align16(splits ? sizeof(RowInfo) : offsetof(RowInfo, part_stats));
  l.region_offset = l.a_offset + a_tile_bytes(k_padded, elem);
  l.total = l.region_offset + align16(std::max(scratch_bytes, out_tile_bytes(out_channels, elem)));
  return l;
}

// Whether two blocks of `shared_bytes` fit in one SM's shared memory.
bool two_blocks_fit(size_t shared_bytes) {
  const size_t reserved = 1024;  // per block, by the runtime
  return 2 * (shared_bytes + reserved) <= kMaxSharedBytes;
}

// Eight values of T with element `column` set to one, if it is one of them
// (0 .. 7): the saved rows' one. A select per 32-bit pair, since an element
// chosen by a run-time index would put the values in local memory.
template <typename T>
__device__ __forceinline__ uint4 with_one_at(uint4 values, int column) {
  const uint32_t one = T(1.0f).x;
  uint32_t* pairs = reinterpret_cast<uint32_t*>(&values);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int half = column - 2 * i;  // 0: the pair's low element, 1: its high one
    pairs[i] = half == 0 ? (pairs[i] & 0xffff0000u) | one : half == 1 ? (pairs[i] & 0xffffu) | one << 16 : pairs[i];
  }
  return values;
}

// Copies a complete A tile, the depthwise output, into the saved rows in
// channel order, then a one at column Cin and zeros (the backward's GEMM
// rows, tokenize.h), 16 bytes at a time. A is zero past Cin.
template <typename T>
__device__ void save_depthwise_rows(const T* a_tile, int a_stride, const StageGemm<T>& s, const RowInfo& rows) {
  const int cin = s.pw.in_channels;
  const int width = s.saved_units.value * 8;
  for (GridCursor at(s.saved_units); at.row < kTileRows; at.advance()) {
    const int64_t pixel = rows.pixel[at.row];
    if (pixel < 0) continue;
    const int c0 = at.column * 8;
    const uint4 chunk = c0 < s.k_padded ? load_a8(a_tile + at.row * a_stride, c0) : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(s.saved_rows + pixel * width + c0) = with_one_at<T>(chunk, cin - c0);
  }
}

// The GEMM and the epilogue, once a block's A tile is complete (and, for
// tokenize_for_training, A saved on the way): of all the output columns, or
// with Split of the block's part of them (the tile's first part saves A),
// NTiles column tiles a warp and pass.
template <typename T, bool Split, int NTiles = kNTiles>
__device__ void finish_block(unsigned char* shared, const SharedLayout& layout, const StageGemm<T>& s,
                             RowInfo& rows, int part, int clock_kernel) {
  const T* a_tile = reinterpret_cast<const T*>(shared + layout.a_offset);
  T* out_tile = reinterpret_cast<T*>(shared + layout.region_offset);
  if (s.saved_rows != nullptr && (!Split || part == 0)) {
    save_depthwise_rows<T>(a_tile, padded_stride(s.k_padded), s, rows);
  }
  const int out_stride = padded_stride(round_up(s.pw.out_channels, 8));
  const int column0 = s.output.template first_column<Split>(part);
  const int tile_begin = column0 / 8;
  const int tile_end = ceil_div(Split ? column0 + s.output.columns : s.pw.out_channels, 8);
  if (s.pw.vector) {
    gemm_tile<T, true, Split, NTiles>(a_tile, padded_stride(s.k_padded), s.k_padded, s.pw, out_tile, out_stride,
                              tile_begin, tile_end);
  } else {
    gemm_tile<T, false, Split, NTiles>(a_tile, padded_stride(s.k_padded), s.k_padded, s.pw, out_tile, out_stride,
                               tile_begin, tile_end);
  }
  __syncthreads();
  phase_mark(clock_kernel, kGemm);
  write_tile<T, Split>(out_tile, out_stride, s.output, part, rows, clock_kernel);
}

// Copies `total` elements of a small tensor (weights, taps) into shared
// memory: element i is load(i) (an in-bounds address, so no load waits
// behind a test), stored by store(i, value). A thread issues
// kLoadsInFlight loads before it stores any, so the block waits a few round
// trips to L2, not one per element.
constexpr int kLoadsInFlight = 4;

template <typename Load, typename Store>
__device__ __forceinline__ void copy_small(int total, Load load, Store store) {
  for (int i0 = threadIdx.x; i0 < total; i0 += kLoadsInFlight * blockDim.x) {
    decltype(load(0)) value[kLoadsInFlight];
#pragma unroll
    for (int b = 0; b < kLoadsInFlight; ++b) value[b] = load(min(i0 + b * static_cast<int>(blockDim.x), total - 1));
#pragma unroll
    for (int b = 0; b < kLoadsInFlight; ++b) {
      const int i = i0 + b * blockDim.x;
      if (i < total) store(i, value[b]);
    }
  }
}

// Depthwise weights [C, 1, K, K] and bias, element by element: store(tap, c,
// value) for every tap (K * K is the bias) and every channel c < padded,
// with zero past C.
template <typename T, int K, typename Store>
__device__ void load_depthwise(const T* weight, const T* bias, int channels, int padded, Store store) {
  constexpr int rows = K * K + 1;
  copy_small(
      padded * rows,
      [&](int i) {
        const int c = min(i / rows, channels - 1), tap = i % rows;
        return __ldg(tap < K * K ? weight + c * K * K + tap : bias + c);
      },
      [&](int i, T value) {
        const int c = i / rows, tap = i % rows;
        store(tap, c, c < channels ? value : T(0.0f));
      });
}

// The stage-1 taps as float, a row of float_tap_row(K) a channel (its K * K
// taps, then its bias), for its depthwise on the CUDA cores (a few image
// channels): a channel's taps are float_tap_row(K) / 4 16-byte reads.
__host__ __device__ constexpr int float_tap_row(int K) { return round_up(K * K + 1, 4); }

template <typename T, int K>
__device__ void load_float_taps(float* taps, const T* weight, const T* bias, int channels, int padded) {
  load_depthwise<T, K>(weight, bias, channels, padded, [&](int tap, int c, T value) {
    taps[c * float_tap_row(K) + tap] = static_cast<float>(value);
  });
}

// Later stages' taps as T [K * K][Kp] (a tap's 8 channels are one 16-byte
// read: a diagonal mma's B) and the bias as float [Kp] after them.
__host__ __device__ constexpr size_t tap_matrix_bytes(int K, int k_padded, size_t elem) {
  return align16(elem * K * K * k_padded);
}
__host__ __device__ constexpr size_t taps_with_bias_bytes(int K, int k_padded, size_t elem) {
  return tap_matrix_bytes(K, k_padded, elem) + sizeof(float) * k_padded;
}
__host__ __device__ constexpr size_t float_taps_bytes(int K, int channels) {
  return sizeof(float) * float_tap_row(K) * channels;
}

// Where the bias follows the taps (const or not, as the taps are).
template <int K, typename T>
__device__ __forceinline__ auto tap_bias(T* taps, int k_padded) {
  using Float = std::conditional_t<std::is_const_v<T>, const float, float>;
  return reinterpret_cast<Float*>(taps + tap_matrix_bytes(K, k_padded, sizeof(T)) / sizeof(T));
}

template <typename T, int K>
__device__ void load_tap_matrix(T* taps, const T* weight, const T* bias, int channels, int padded) {
  float* bias_out = tap_bias<K>(taps, padded);
  load_depthwise<T, K>(weight, bias, channels, padded, [&](int tap, int c, T value) {
    if (tap < K * K) {
      taps[tap * padded + c] = value;
    } else {
      bias_out[c] = static_cast<float>(value);
    }
  });
}

__device__ __forceinline__ void load_floats8(const float* p, float (&v)[8]) {
  const float4 lo = *reinterpret_cast<const float4*>(p), hi = *reinterpret_cast<const float4*>(p + 4);
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
}

// ---- the order of the kernels ---------------------------------------------------

// Each kernel lets the next one start its blocks at once. Where the kernel
// before it leaves SMs idle (small batches), a stage kernel is launched
// programmatically (Follows::kFusedKernel), so its blocks load their taps and
// lay out their rows on those SMs while that kernel still runs, and cross
// wait_for_previous_kernel before they read or write anything in device
// memory but the parameters. Writing waits too: a tensor the kernel before
// reads may be freed on the host and handed out again as this kernel's output.
// Both are no-ops for a plain launch.
__device__ __forceinline__ void let_next_kernel_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Returns once the kernel before this one has finished and its writes are visible.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ---- the stage kernel ----------------------------------------------------------

template <typename T>
struct StageArgs {
  StageGemm<T> gemm;
  const T* input;  // NHWC [N, H, W, Cin]
  int H, W, Ho, Wo, stride;
  int64_t pixels;  // N * Ho * Wo
  int64_t first_tile, tiles;  // this launch's tiles of kTileRows pixels: [first_tile, tiles)
  bool vector_input;
  SharedLayout layout;
  size_t taps_offset;
  bool reload_taps;  // the taps share the output tile's space: loaded again per tile
};

// Where each row of a stage-kernel block reads its input: the element offset
// of its window's top-left pixel, and that pixel's coordinates (which may lie
// in the padding), computed once per block instead of once per channel group.
struct RowSource {
  int64_t offset[kTileRows];
  int y[kTileRows], x[kTileRows];
};

// Where one item of the stage kernel reads: its window's top-left tap (which
// may lie in the padding) for its 8 channels, and which window columns lie
// inside the image, tested once per item rather than once per tap.
template <typename T, int K>
struct WindowSource {
  const T* corner;
  int y0;
  bool column_inside[K];
};

// Depthwise taps for a lane's 8 channels of kernel rows i0 .. i0 + Count - 1
// of its two pixels, on the tensor cores (diagonal_tap): every load issued
// before any is used (out-of-image taps are zero), so a thread keeps
// 2 x Count x K loads in flight.
template <typename T, int K, int Count, bool Vector>
__device__ __forceinline__ void depthwise_rows(const WindowSource<T, K> (&src)[2], int i0, int H, int64_t row_step,
                                              int Cin, int c, const T* taps, int Kp, uint32_t mask,
                                              float (&d)[4][4]) {
  uint4 pixel[2][Count][K];
#pragma unroll
  for (int p = 0; p < 2; ++p) {
#pragma unroll
    for (int i = 0; i < Count; ++i) {
      const bool row_inside = src[p].y0 + i0 + i >= 0 && src[p].y0 + i0 + i < H;
      const T* row = src[p].corner + (i0 + i) * row_step;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        const bool inside = row_inside && src[p].column_inside[j];
        if constexpr (Vector) {
          pixel[p][i][j] = load_global16_if(row + j * Cin, inside);
        } else {
          float v[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = inside && c + e < Cin ? static_cast<float>(row[j * Cin + e]) : 0.0f;
          pixel[p][i][j] = pack8<T>(v);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < Count; ++i) {
#pragma unroll
    for (int j = 0; j < K; ++j) {
      diagonal_tap<T>(d, pixel[0][i][j], pixel[1][i][j], load_shared16(taps + ((i0 + i) * K + j) * Kp + c), mask);
    }
  }
}

// Kernel rows whose loads a thread keeps in flight together: the whole 3 x 3
// window, or one row of the larger kernels (whose windows would not fit in
// registers).
template <int K>
constexpr int kRowsInFlight = K == 3 ? 3 : 1;

// One item of the stage kernel's depthwise step into A: 16 pixels (rows
// 16 row_group ..) x the 32 channels of channel group `group`, a lane
// pixels g and g + 8 and 8 channels (see diagonal_tap). Vector: NHWC rows
// of 16-byte-aligned multiples of 8 channels, read 16 bytes at a time.
template <typename T, int K, bool Vector>
__device__ __forceinline__ void depthwise_item(const StageArgs<T>& args, const RowInfo& rows,
                                               const RowSource& sources, const T* taps, T* a_tile, int row_group,
                                               int group) {
  const StageGemm<T>& s = args.gemm;
  const int a_stride = padded_stride(s.k_padded);
  const int Cin = s.pw.in_channels, Kp = s.k_padded;
  const int lane = threadIdx.x % 32;
  const uint32_t mask = diagonal_mask();
  const int64_t row_step = static_cast<int64_t>(args.W) * Cin;
  const int c = group * kChannelGroup + lane % 4 * 8;
  const int r[2] = {row_group * 16 + lane / 4, row_group * 16 + lane / 4 + 8};
  float d[4][4];
  {
    float bias[8];
    load_floats8(tap_bias<K>(taps, Kp) + c, bias);
    diagonal_start(d, bias);
  }
  WindowSource<T, K> src[2];
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    // A pixel past the end, or channels past Cin, read nothing: all columns count as outside.
    const bool live = rows.pixel[r[p]] >= 0 && c < Cin;
    src[p].y0 = sources.y[r[p]];
    src[p].corner =
        args.input + sources.offset[r[p]] + (static_cast<int64_t>(src[p].y0) * args.W + sources.x[r[p]]) * Cin + c;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      src[p].column_inside[j] = live && sources.x[r[p]] + j >= 0 && sources.x[r[p]] + j < args.W;
    }
  }
  constexpr int count = kRowsInFlight<K>;
  // Not unrolled: unrolled, the compiler hoists later kernel rows' loads of
  // K = 5 and 7 and spills them (ptxas: 704 bytes at K = 7, 140 without).
#pragma unroll 1
  for (int i0 = 0; i0 < K; i0 += count) {
    depthwise_rows<T, K, count, Vector>(src, i0, args.H, row_step, Cin, c, taps, Kp, mask, d);
  }
  float v[2][8];
  diagonal_result(d, v[0], v[1]);
#pragma unroll
  for (int p = 0; p < 2; ++p) store_a8<T>(a_tile + r[p] * a_stride, c, v[p]);
}

// The stage kernel's depthwise step into A: warps take its items.
template <typename T, int K, bool Vector>
__device__ void stage_depthwise(const StageArgs<T>& args, const RowInfo& rows, const RowSource& sources,
                                const T* taps, T* a_tile) {
  for (GridCursor at(args.gemm.channel_groups, threadIdx.x / 32, blockDim.x / 32); at.row < kRowGroups;
       at.advance()) {
    depthwise_item<T, K, Vector>(args, rows, sources, taps, a_tile, at.row, at.column);
  }
}

// A cluster part's share of the depthwise step: items [item_begin,
// item_end) of the tile's (channel group, row group) items, numbered row
// group fastest, an even share of them (6 channel groups over 4 parts would
// give shares of 1, 2, 1 and 2 whole groups).
template <typename T, int K, bool Vector>
__device__ void depthwise_share(const StageArgs<T>& args, const RowInfo& rows, const RowSource& sources,
                                const T* taps, T* a_tile, int item_begin, int item_end) {
  for (int item = item_begin + threadIdx.x / 32; item < item_end; item += blockDim.x / 32) {
    depthwise_item<T, K, Vector>(args, rows, sources, taps, a_tile, item % kRowGroups, item / kRowGroups);
  }
}

// Sends this part's items of A (16 rows x one channel group each: store_a8
// permutes columns within a group only) to the same place in every other
// part's A, 16 bytes at a time, then waits for the other parts' items of
// its own A. The sends wait until every part has started and set up its
// barriers, or has read the last tile's A and statistics (after its waits
// for that tile's phases).
template <typename T>
__device__ void exchange_depthwise_shares(T* a_tile, int a_stride, int items, int item_begin, int item_end, int part,
                                          int parts, Exchanges& exchanges) {
  constexpr int kUnitsPerRow = kChannelGroup / 8, kUnitsPerItem = 16 * kUnitsPerRow;
  cluster_wait();
  for (int i = threadIdx.x; i < (item_end - item_begin) * kUnitsPerItem; i += blockDim.x) {
    const int item = item_begin + i / kUnitsPerItem, unit = i % kUnitsPerItem;
    const int row = item % kRowGroups * 16 + unit / kUnitsPerRow;
    uint4* place = reinterpret_cast<uint4*>(a_tile + row * a_stride) + item / kRowGroups * kUnitsPerRow +
                   unit % kUnitsPerRow;
    const uint4 value = *place;
    for (int rank = 0; rank < parts; ++rank) {
      if (rank != part) send16(cluster_address(place, rank), value, cluster_address(&exchanges.shares, rank));
    }
  }
  constexpr uint32_t kBytesPerItem = kUnitsPerItem * 16;
  receive(exchanges.shares, (items - (item_end - item_begin)) * kBytesPerItem, exchanges.parity);
}

// Threads: kThreads (two blocks per SM) or twice that (one block per SM, for
// tiles whose shared memory leaves room for only one): 16 warps per SM either way.
// Persistent: a block walks tiles args.first_tile + blockIdx.x, + gridDim.x,
// ...; with Split, the `parts` blocks blockIdx.x = parts * i + part (a
// cluster from sm_90) walk tiles args.first_tile + i, +
// gridDim.x / parts, ..., each its part of the columns. The taps are
// loaded once per block, past the output tile's reach where shared memory
// has room (ncu: loading them per tile was most of the 10% of stage 3's time
// before its depthwise), else once per tile.
template <typename T, int K, int Threads, bool Split>
__global__ void __launch_bounds__(Threads, 2 * kThreads / Threads) fused_stage_kernel(const StageArgs<T> args) {
  extern __shared__ __align__(16) unsigned char shared[];
  const StageGemm<T>& s = args.gemm;
  auto& rows = *reinterpret_cast<RowInfo*>(shared);
  __shared__ RowSource sources;
  T* a_tile = reinterpret_cast<T*>(shared + args.layout.a_offset);
  T* taps = reinterpret_cast<T*>(shared + args.taps_offset);
  const int Cin = s.pw.in_channels;
  const int64_t plane = static_cast<int64_t>(args.Ho) * args.Wo;
  const unsigned parts = Split ? s.output.parts : 1;
  const unsigned part = Split ? blockIdx.x % parts : 0;
  const int64_t first_tile = args.first_tile + (Split ? blockIdx.x / parts : blockIdx.x);
  // A cluster's parts each compute a share of A's depthwise items.
  constexpr bool clustered = kClusteredSplit<Split>;
  const int items = kRowGroups * s.channel_groups.value;
  const int item_begin = clustered ? part * items / parts : 0;
  const int item_end = clustered ? (part + 1) * items / parts : 0;
  constexpr int clock = clock_kernel(Threads == kThreads ? kStageKernel : kWideStageKernel, Split);
  phase_mark(clock, kStart);
  let_next_kernel_start();
  if (clustered) join_exchanges(rows.exchanges);
  phase_mark(clock, kPrologue);
  uint32_t parity = 0;  // of the exchanges' barriers, one phase a tile
  for (int64_t tile = first_tile; tile < args.tiles; tile += gridDim.x / parts, parity ^= 1) {
    phase_mark(clock, kEarlierTiles);
    if (tile == first_tile || args.reload_taps) load_tap_matrix<T, K>(taps, s.dw_weight, s.dw_bias, Cin, s.k_padded);
    if (clustered && threadIdx.x == 0) rows.exchanges.parity = parity;
    for (int r = threadIdx.x; r < kTileRows; r += Threads) {
      const int64_t pixel = tile * kTileRows + r < args.pixels ? tile * kTileRows + r : -1;
      rows.pixel[r] = pixel;
      const int64_t image = pixel < 0 ? 0 : pixel / plane;
      const int offset = pixel < 0 ? 0 : static_cast<int>(pixel % plane);
      sources.y[r] = (offset / args.Wo) * args.stride - K / 2;
      sources.x[r] = (offset % args.Wo) * args.stride - K / 2;
      sources.offset[r] = image * args.H * args.W * Cin;
    }
    if (tile == first_tile) wait_for_previous_kernel();
    __syncthreads();
    phase_mark(clock, kTileSetup);

    const auto depthwise = [&](auto vector) {
      if constexpr (clustered) {
        depthwise_share<T, K, vector.value>(args, rows, sources, taps, a_tile, item_begin, item_end);
      } else {
        stage_depthwise<T, K, vector.value>(args, rows, sources, taps, a_tile);
      }
    };
    if (args.vector_input) {
      depthwise(std::true_type{});
    } else {
      depthwise(std::false_type{});
    }
    __syncthreads();
    phase_mark(clock, kDepthwise);
    if constexpr (clustered) {
      exchange_depthwise_shares(a_tile, padded_stride(s.k_padded), items, item_begin, item_end, part, parts,
                                rows.exchanges);
      phase_mark(clock, kExchange);
    }
    finish_block<T, Split>(shared, args.layout, s, rows, part, clock);
    // The next tile's rows overwrite the row table and its sources.
    __syncthreads();
    phase_mark(clock, kEpilogue);
    // Once this tile's A and statistics are read, the next tile's may overwrite them.
    if (clustered && tile + gridDim.x / parts < args.tiles) cluster_arrive();
  }
}

// ---- the first kernel: images -> stage 1 -> stage 2 ------------------------------

// Sides of a first-kernel tile's square windows, in stage-1 and in image pixels.
__host__ __device__ constexpr int stage1_window_side(int K, int stride2) { return (kTile - 1) * stride2 + K; }
__host__ __device__ constexpr int image_window_side(int K, int stride1, int stride2) {
  return (stage1_window_side(K, stride2) - 1) * stride1 + K;
}

// A channel of the image window in shared memory, as floats: its rows, and
// within each row its columns, ordered by their remainder modulo the
// stage-1 stride (stride1: those of remainder 0 first, then those of 1), so
// the pixels one stage-1 tap reads for consecutive stage-1 positions are
// consecutive floats; rows row_stride floats apart, a number congruent to
// the stage-1 window's side modulo the 32 banks, so positions on the next
// row go on in the banks where the row before ended: a warp's read of one
// tap is free of bank conflicts (in plain rows, counted: two or three passes
// a read of every other column).
struct ImagePlane {
  int phase_side;  // rows (and columns) of remainder 0, the most of any remainder
  int row_stride, floats;
};
__host__ __device__ constexpr ImagePlane image_plane(int K, int stride1, int stride2) {
  const int phase_side = ceil_div(image_window_side(K, stride1, stride2), stride1);
  const int row = stride1 * phase_side;
  const int row_stride = row + ((stage1_window_side(K, stride2) - row) % 32 + 32) % 32;
  return {phase_side, row_stride, stride1 * phase_side * row_stride};
}

// Where window pixel (row, column) lies in its channel's plane. Strides are
// 1 or 2 (the gateway's rule), so a remainder is a mask and a quotient a shift.
__host__ __device__ constexpr int image_place(const ImagePlane& p, int stride1, int row, int column) {
  const int shift = stride1 - 1;
  return ((row & shift) * p.phase_side + (row >> shift)) * p.row_stride + (column & shift) * p.phase_side +
         (column >> shift);
}

template <typename T>
struct FirstArgs {
  StageGemm<T> gemm;  // stage 2
  const void* images;
  bool uint8_input, nhwc;
  int C0, H0, W0;     // images as given; pixels outside are 0 after normalization
  int stride1, stride2;
  ActivationForm act1;  // after stage 1 (stage 2's is the output's, TileOutput::act)
  ImageNormalization normalization;
  const T* dw1_weight;
  const T* dw1_bias;
  const T* pw1_weight;  // [C1, C0]
  const T* pw1_bias;
  T* saved_rows1;       // tokenize_for_training: the stage-1 depthwise rows, [N * H1 * W1, 8]; else null
  int C1, H1, W1;       // stage-1 outputs
  int H2, W2, tiles;
  Divisor tiles_y, tiles_x;  // tiles per image column and row
  Divisor part_groups;       // stage 2's input channel groups a block computes of a tile
  // Windows, in stage-1 and image pixels, of one stage-2 tile (halo included).
  int win1_h, win0_h;
  Divisor win1_w, win0_w;
  ImagePlane plane;  // of each image channel's window
  int s1_stride;
  // The region holds a tile's image window, then its stage-1 activations
  // over it, then its output tile. From the shared base: the stage-1 rows
  // and the stage-1 pointwise weights, which serve a tile until its stage-1
  // pointwise step (first_geometry puts them in A's place where it can),
  // then, past the output tile's reach, the taps every tile of a block uses.
  size_t d1_offset, w1_offset, taps_offset, taps1_offset;
  SharedLayout layout;
};

// Window positions a thread of load_image_window takes: enough for the
// widest window of K (both strides 2).
constexpr int window_slots(int K) {
  return ceil_div(image_window_side(K, 2, 2) * image_window_side(K, 2, 2), kThreads);
}

// The image window of a tile, normalized, into shared memory as float
// [C0][a.plane] (image_place); zero outside the image. Threads take window
// positions (the same ones for every channel, so their offsets are computed
// once), and every load of every channel is issued before any is used: a
// block waits for one memory round trip. A position outside the image reads
// the nearest pixel inside it (its coordinates clamped), so every load is
// in bounds, with no branch or select of an address; the value is then
// replaced by zero; so are the slots past the window's last row (not
// stored), which read rows below it. Offsets from the window's corner are
// ints (window_offsets_fit bounds them; wider images take the composed
// kernels); the 64-bit
// products with the image's and the channel's strides happen once per tile.
template <typename In, typename T, int K>
__device__ void load_image_window(const FirstArgs<T>& a, const In* images, int64_t n, int y_origin, int x_origin,
                                  float* image) {
  constexpr int kSlots = window_slots(K);
  const int x_step = a.nhwc ? a.C0 : 1, y_step = a.nhwc ? a.W0 * a.C0 : a.W0;
  const int64_t c_step = a.nhwc ? 1 : int64_t{a.H0} * a.W0;
  const In* corner = images + n * a.C0 * a.H0 * a.W0 + int64_t{y_origin} * y_step + int64_t{x_origin} * x_step;
  const int window = a.win0_h * a.win0_w.value;
  bool inside[kSlots];
  int offset[kSlots], place[kSlots];
  GridCursor at(a.win0_w);
#pragma unroll
  for (int s = 0; s < kSlots; ++s, at.advance()) {
    const int y = y_origin + at.row, x = x_origin + at.column;
    const int y_in = min(max(y, 0), a.H0 - 1), x_in = min(max(x, 0), a.W0 - 1);
    inside[s] = at.row < a.win0_h && y == y_in && x == x_in;
    offset[s] = (y_in - y_origin) * y_step + (x_in - x_origin) * x_step;
    place[s] = image_place(a.plane, a.stride1, at.row, at.column);
  }
  float v[kMaxImageChannels][kSlots];
#pragma unroll
  for (int c = 0; c < kMaxImageChannels; ++c) {
    if (c >= a.C0) break;
    const In* plane = corner + c * c_step;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) v[c][s] = static_cast<float>(__ldg(plane + offset[s]));
  }
#pragma unroll
  for (int c = 0; c < kMaxImageChannels; ++c) {
    if (c >= a.C0) break;
    const float mean = a.normalization.mean[c], inv_std = a.normalization.inv_std[c];
    float* plane = image + c * a.plane.floats;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      // Zero after normalization: padding is zero in normalized space.
      const float value = normalized<In>(v[c][s], mean, inv_std);
      if (threadIdx.x + s * kThreads < window) plane[place[s]] = inside[s] ? value : 0.0f;
    }
  }
}

// The stage-1 pointwise weight as m16n8k8 B operands, [Kp][8] in T (input
// channels past C0 and output channels past C1 zero), then its bias in float
// as the mma's c quads: {b[n], b[n + 1], b[n], b[n + 1]} for each even n.
template <typename T>
__device__ void load_stage1_weight(const FirstArgs<T>& a, int Kp, T* w1, float* b1) {
  // A thread an output channel c: its C0 weights' bits as one 16-byte row,
  // and its bias at c's two places among the quads (element 4 (c / 2) +
  // c % 2 and the one two further). Every load reads an in-bounds address
  // (clamped), and the values past C0 or C1 are then replaced by zero.
  static_assert(kMaxImageChannels == 4, "a row's weights are its first two 32-bit pairs");
  for (int c = threadIdx.x; c < Kp; c += blockDim.x) {
    const bool live = c < a.C1;
    const int source = min(c, a.C1 - 1);
    const auto* row = reinterpret_cast<const uint16_t*>(a.pw1_weight) + source * a.C0;
    uint32_t bits[kMaxImageChannels];
#pragma unroll
    for (int k = 0; k < kMaxImageChannels; ++k) {
      const uint32_t value = __ldg(row + min(k, a.C0 - 1));
      bits[k] = live && k < a.C0 ? value : 0u;
    }
    const float bias = live ? static_cast<float>(__ldg(a.pw1_bias + source)) : 0.0f;
    *reinterpret_cast<uint4*>(w1 + c * 8) = make_uint4(bits[0] | bits[1] << 16, bits[2] | bits[3] << 16, 0u, 0u);
    float* quads = b1 + c / 2 * 4 + c % 2;
    quads[0] = quads[2] = bias;
  }
}

// Stage-1 depthwise outputs over the stage-1 window into [rows][8] in T (the
// rounding PyTorch applies between the two convolutions), channels past C0
// and rows past the window zero: the A operand of the stage-1 pointwise step.
// `inside` records which window positions lie in the stage-1 extent. For
// tokenize_for_training the positions the tile owns (the window less stage
// 2's halo: the tiles partition the extent) also go to the saved rows, with
// the one in column C0, as the backward's images_depthwise_rows computes them
// (the same sums in the same order), unless `saved_rows1` is null (the parts
// of a split tile but the first). The taps come from shared memory
// (load_float_taps): read from the weight tensor, each would be a global
// load and a conversion per tap and position. With the strides known to the
// compiler, every read of the window is at a fixed offset from the
// position's own (image_place).
template <typename T, int K, int S1, int S2>
__device__ void stage1_depthwise(const FirstArgs<T>& a, const float* image, const float* taps1, T* d1, bool* inside,
                                 T* saved_rows1, int padded_rows, int64_t n, int y_origin, int x_origin) {
  constexpr int side = stage1_window_side(K, S2), kRow = float_tap_row(K);
  constexpr ImagePlane plane = image_plane(K, S1, S2);
  for (int q = threadIdx.x; q < padded_rows; q += kThreads) {
    float out[8] = {};
    const int y = q / side, x = q % side;
    const bool in_extent =
        q < side * side && y_origin + y >= 0 && y_origin + y < a.H1 && x_origin + x >= 0 && x_origin + x < a.W1;
    inside[q] = in_extent;
    if (q < side * side) {
      const float* src = image + y * plane.row_stride + x;
#pragma unroll
      for (int c = 0; c < kMaxImageChannels; ++c) {
        if (c >= a.C0) continue;
        float4 taps[kRow / 4];
#pragma unroll
        for (int i = 0; i < kRow / 4; ++i) taps[i] = *reinterpret_cast<const float4*>(taps1 + c * kRow + 4 * i);
        const auto tap = [&](int t) {
          const float4& four = taps[t / 4];
          return t % 4 == 0 ? four.x : t % 4 == 1 ? four.y : t % 4 == 2 ? four.z : four.w;
        };
        float acc = tap(K * K);
#pragma unroll
        for (int ky = 0; ky < K; ++ky) {
#pragma unroll
          for (int kx = 0; kx < K; ++kx) {
            acc = fmaf(tap(ky * K + kx), src[c * plane.floats + image_place(plane, S1, ky, kx)], acc);
          }
        }
        out[c] = acc;
      }
    }
    const uint4 row = pack8<T>(out);
    *reinterpret_cast<uint4*>(d1 + q * 8) = row;
    constexpr int span = kTile * S2, pad = K / 2;
    if (saved_rows1 != nullptr && in_extent && y >= pad && y < pad + span && x >= pad && x < pad + span) {
      const int64_t pixel = (n * a.H1 + y_origin + y) * a.W1 + x_origin + x;
      *reinterpret_cast<uint4*>(saved_rows1 + pixel * 8) = with_one_at<T>(row, a.C0);
    }
  }
}

// Stage-1 outputs over the window, channel groups first_group ..
// first_group + groups.value - 1 (all Kp channels, or a split tile's part's
// share): the pointwise step on the tensor cores (one m16n8k8 per 16
// positions and 8 channels), bias, activation, and zero outside the stage-1
// extent (stage 2's padding). Warps take (16 positions, 32 channels) items.
// An item reads its operands and runs its four mma, then its eight
// activations, then stores: the compiler cannot move a shared read above a
// shared store (it cannot tell the buffers apart), so reads between the
// stores would make each 8-channel step wait for the one before (ncu: "wait"
// was 41% of this phase's stalls).
template <typename T>
__device__ void stage1_pointwise(const FirstArgs<T>& a, const T* d1, const bool* inside, const T* w1, const float* b1,
                                 T* s1, int first_group, const Divisor& groups) {
  constexpr int kSteps = kChannelGroup / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, quad = lane % 4;
  const int win1 = a.win1_h * a.win1_w.value;
  for (GridCursor at(groups, warp, kWarps); at.row < ceil_div(win1, 16); at.advance()) {
    const int q0 = at.row * 16 + group, q1 = q0 + 8;
    const int n0 = (first_group + at.column) * kChannelGroup;
    const uint32_t frag[2] = {*reinterpret_cast<const uint32_t*>(d1 + q0 * 8 + quad * 2),
                              *reinterpret_cast<const uint32_t*>(d1 + q1 * 8 + quad * 2)};
    const bool keep0 = inside[q0], keep1 = inside[q1];
    float acc[kSteps][4];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      const float4 bias = *reinterpret_cast<const float4*>(b1 + 2 * (n0 + j * 8 + quad * 2));
      const uint32_t weight = *reinterpret_cast<const uint32_t*>(w1 + (n0 + j * 8 + group) * 8 + quad * 2);
      mma_1688<T>(acc[j], frag, weight, bias);
    }
    uint32_t y[kSteps][2];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      y[j][0] = activate_pair<T>(acc[j][0], acc[j][1], a.act1);
      y[j][1] = activate_pair<T>(acc[j][2], acc[j][3], a.act1);
    }
    // Most items lie wholly inside the stage-1 extent and the window: from
    // sm_90 those store without a select or a bounds test per value (a
    // warp-uniform branch), as two stmatrix: matrix i of the first holds
    // channels n0 + 8 (i / 2) .. + 7 of rows 16 at.row + 8 (i % 2) .. + 7,
    // the second the next 16 channels. The rest, and every item before
    // sm_90, store a pair at a time.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (__all_sync(0xffffffffu, keep0 && keep1)) {  // inside implies within the window
      static_assert(kSteps == 4, "two stmatrix of four matrices");
      const int i = lane / 8;
      T* row = s1 + (at.row * 16 + lane % 8 + 8 * (i % 2)) * a.s1_stride + n0 + 8 * (i / 2);
      stmatrix_x4(row, {y[0][0], y[0][1], y[1][0], y[1][1]});
      stmatrix_x4(row + 16, {y[2][0], y[2][1], y[3][0], y[3][1]});
      continue;
    }
#endif
    T* row0 = s1 + q0 * a.s1_stride + n0 + quad * 2;
    T* row1 = s1 + q1 * a.s1_stride + n0 + quad * 2;
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      if (q0 < win1) *reinterpret_cast<uint32_t*>(row0 + j * 8) = keep0 ? y[j][0] : 0u;
      if (q1 < win1) *reinterpret_cast<uint32_t*>(row1 + j * 8) = keep1 ? y[j][1] : 0u;
    }
  }
}

// The tile column of the pixel in mma row g (and g + 8) of a stage-2
// depthwise item. A 16-byte shared read serves 8 lanes per pass, here 64
// bytes of each of two pixels (rows g = 2j and 2j + 1); with the stage-1 rows
// an odd number of 16-byte units long, two positions 4 apart land in disjoint
// banks, so the two pixels are 4 / S2 columns apart: rows g = 0..7 take
// columns 0 2 1 3 4 6 5 7 at stride 2, 0 4 1 5 2 6 3 7 at stride 1.
template <int S2>
__device__ __forceinline__ int stage2_column(int g) {
  return S2 == 2 ? (g & 4) | (g & 1) << 1 | (g >> 1 & 1) : (g & 1) << 2 | g >> 1;
}

// The first kernel's stage-2 depthwise (stride S2) from the stage-1
// activations into A's channel groups first_group .. first_group + groups.value -
// 1, on the tensor cores (diagonal_tap): warps take (two tile rows, 32
// channels) items, a lane one pixel of each row and 8 channels.
template <typename T, int K, int S2>
__device__ void stage2_depthwise(const FirstArgs<T>& a, const T* s1, const T* taps, T* a_tile, int a_stride, int Kp,
                                 int first_group, const Divisor& groups) {
  static_assert(kTile == 8, "a tile row is the 8 rows g of a diagonal mma");
  const int lane = threadIdx.x % 32;
  const uint32_t mask = diagonal_mask();
  const int px = stage2_column<S2>(lane / 4);
  const int64_t row_step = int64_t{a.win1_w.value} * a.s1_stride;
  for (GridCursor at(groups, threadIdx.x / 32, kWarps); at.row < kRowGroups; at.advance()) {
    const int c = (first_group + at.column) * kChannelGroup + lane % 4 * 8;
    const int py = at.row * 2;
    float d[4][4];
    {
      float bias[8];
      load_floats8(tap_bias<K>(taps, Kp) + c, bias);
      diagonal_start(d, bias);
    }
    const T* window0 = s1 + (py * S2 * a.win1_w.value + px * S2) * a.s1_stride + c;
    const T* window1 = window0 + S2 * row_step;
#pragma unroll
    for (int ky = 0; ky < K; ++ky) {
      uint4 v0[K], v1[K];
#pragma unroll
      for (int kx = 0; kx < K; ++kx) {
        v0[kx] = load_shared16(window0 + ky * row_step + kx * a.s1_stride);
        v1[kx] = load_shared16(window1 + ky * row_step + kx * a.s1_stride);
      }
#pragma unroll
      for (int kx = 0; kx < K; ++kx) {
        diagonal_tap<T>(d, v0[kx], v1[kx], load_shared16(taps + (ky * K + kx) * Kp + c), mask);
      }
    }
    float v[2][8];
    diagonal_result(d, v[0], v[1]);
    store_a8<T>(a_tile + (py * kTile + px) * a_stride, c, v[0]);
    store_a8<T>(a_tile + ((py + 1) * kTile + px) * a_stride, c, v[1]);
  }
}

// Persistent: a block walks tiles blockIdx.x, + gridDim.x, ...; with Split,
// the `parts` blocks blockIdx.x = parts * i + part (a cluster) walk tiles
// i, + gridDim.x / parts, ..., each its part of the output columns and its
// share of stage 2's input channel groups (their stage-1 pointwise step and
// stage-2 depthwise step), whose columns of A it sends the other parts;
// every part loads the image window and runs the stage-1 depthwise step (a
// few image channels). The weights and taps every tile uses are loaded once
// per block, not once per tile (ncu: their loads were a sixth of the load
// phase's stall samples), but for the stage-1 pointwise weights (2.3 KB for
// lumenbridge-base), which are loaded with each tile's image window, in A's
// place where first_geometry puts them there. Blocks: the blocks an SM the
// registers are bounded for (whole_first_kernel says when three run).
template <typename T, int K, bool Split, int Blocks>
__global__ void __launch_bounds__(kThreads, Blocks) fused_first_kernel(const FirstArgs<T> args) {
  extern __shared__ __align__(16) unsigned char shared[];
  const StageGemm<T>& s = args.gemm;
  auto& rows = *reinterpret_cast<RowInfo*>(shared);
  T* a_tile = reinterpret_cast<T*>(shared + args.layout.a_offset);
  unsigned char* region = shared + args.layout.region_offset;
  float* image = reinterpret_cast<float*>(region);  // [C0][args.plane]
  T* s1 = reinterpret_cast<T*>(region);             // [win1_h * win1_w][s1_stride], once the image is read
  const int padded_rows = round_up(args.win1_h * args.win1_w.value, 16);
  T* d1 = reinterpret_cast<T*>(shared + args.d1_offset);                // [padded_rows][8]
  bool* inside = reinterpret_cast<bool*>(d1 + padded_rows * 8);         // [padded_rows]
  T* w1 = reinterpret_cast<T*>(shared + args.w1_offset);                // [Kp][8], then the bias quads
  float* b1 = reinterpret_cast<float*>(w1 + s.k_padded * 8);
  T* taps = reinterpret_cast<T*>(shared + args.taps_offset);            // [K * K][Kp], then the float bias
  float* taps1 = reinterpret_cast<float*>(shared + args.taps1_offset);  // [kMaxImageChannels][float_tap_row(K)]
  const int a_stride = padded_stride(s.k_padded);
  const int Kp = s.k_padded;
  constexpr int pad = K / 2;
  const int parts = Split ? s.output.parts : 1;
  const int part = Split ? static_cast<int>(blockIdx.x) % parts : 0;
  const int tile_step = static_cast<int>(gridDim.x) / parts;
  constexpr bool clustered = kClusteredSplit<Split>;
  // The host splits tiles only as clusters, whose parts divide the groups
  // (first_kernel_parts); compiled without cluster code, each part would
  // compute the whole of A.
  const Divisor& share = clustered ? args.part_groups : s.channel_groups;
  const int first_group = clustered ? part * share.value : 0;
  T* saved_rows1 = part == 0 ? args.saved_rows1 : nullptr;
  constexpr int clock = clock_kernel(kFirstKernel, Split);

  phase_mark(clock, kStart);
  let_next_kernel_start();
  if (clustered) join_exchanges(rows.exchanges);
  load_float_taps<T, K>(taps1, args.dw1_weight, args.dw1_bias, args.C0, kMaxImageChannels);
  load_tap_matrix<T, K>(taps, s.dw_weight, s.dw_bias, s.pw.in_channels, Kp);
  phase_mark(clock, kPrologue);
  uint32_t parity = 0;  // of the exchanges' barriers, one phase a tile
  for (int tile = static_cast<int>(blockIdx.x) / parts; tile < args.tiles; tile += tile_step, parity ^= 1) {
    phase_mark(clock, kEarlierTiles);
    if (clustered && threadIdx.x == 0) rows.exchanges.parity = parity;
    const int tile_row = args.tiles_x.quotient(tile);  // over the batch
    const int64_t n = args.tiles_y.quotient(tile_row);
    const int tx = (tile - tile_row * args.tiles_x.value) * kTile;
    const int ty = (tile_row - static_cast<int>(n) * args.tiles_y.value) * kTile;
    const int y1_origin = ty * args.stride2 - pad, x1_origin = tx * args.stride2 - pad;
    const int y0_origin = y1_origin * args.stride1 - pad, x0_origin = x1_origin * args.stride1 - pad;

    for (int r = threadIdx.x; r < kTileRows; r += kThreads) {
      const int y = ty + r / kTile, x = tx + r % kTile;
      rows.pixel[r] = y < args.H2 && x < args.W2 ? (n * args.H2 + y) * args.W2 + x : -1;
    }
    load_stage1_weight(args, Kp, w1, b1);
    if (args.uint8_input) {
      load_image_window<uint8_t, T, K>(args, static_cast<const uint8_t*>(args.images), n, y0_origin, x0_origin,
                                       image);
    } else {
      load_image_window<T, T, K>(args, static_cast<const T*>(args.images), n, y0_origin, x0_origin, image);
    }
    __syncthreads();
    phase_mark(clock, kWindow);

    dispatch_checked_stride(args.stride1, [&](auto stride1) {
      dispatch_checked_stride(args.stride2, [&](auto stride2) {
        stage1_depthwise<T, K, decltype(stride1)::value, decltype(stride2)::value>(
            args, image, taps1, d1, inside, saved_rows1, padded_rows, n, y1_origin, x1_origin);
      });
    });
    __syncthreads();
    phase_mark(clock, kStage1Depthwise);

    stage1_pointwise(args, d1, inside, w1, b1, s1, first_group, share);
    __syncthreads();
    phase_mark(clock, kStage1Pointwise);

    dispatch_checked_stride(args.stride2, [&](auto stride2) {
      stage2_depthwise<T, K, decltype(stride2)::value>(args, s1, taps, a_tile, a_stride, Kp, first_group, share);
    });
    __syncthreads();
    phase_mark(clock, kDepthwise);
    if constexpr (clustered) {
      exchange_depthwise_shares(a_tile, a_stride, kRowGroups * s.channel_groups.value, first_group * kRowGroups,
                                (first_group + share.value) * kRowGroups, part, parts, rows.exchanges);
      phase_mark(clock, kExchange);
    }
    // At three blocks an SM a thread has 80 registers: one column tile a
    // pass (A read three times where two blocks read it once) keeps the
    // GEMM's accumulators and its ring of B in them.
    finish_block<T, Split, Blocks == 2 ? kNTiles : 1>(shared, args.layout, s, rows, part, clock);
    // The next tile's rows, weights and image window overwrite the row table, A and the output tile.
    __syncthreads();
    phase_mark(clock, kEpilogue);
    // Once this tile's A and statistics are read, the next tile's may overwrite them.
    if (clustered && tile + tile_step < args.tiles) cluster_arrive();
  }
}

// ---- host side -------------------------------------------------------------------

// A first-kernel block's windows and shared memory (FirstArgs says what
// each part holds), for tiles that split between a cluster's blocks or not.
struct FirstGeometry {
  int win1_h, win1_w, win0_h, win0_w, s1_stride;
  ImagePlane plane;
  SharedLayout layout;
  size_t d1_offset, w1_offset, taps_offset, taps1_offset;
};

FirstGeometry first_geometry(int C0, int K, int stride1, int stride2, int k_padded, int out_channels, size_t elem,
                             bool splits) {
  FirstGeometry g;
  g.win1_h = g.win1_w = stage1_window_side(K, stride2);
  g.win0_h = g.win0_w = image_window_side(K, stride1, stride2);
  g.plane = image_plane(K, stride1, stride2);
  g.s1_stride = padded_stride(k_padded);
  const int win1 = g.win1_h * g.win1_w;
  const size_t image = align16(sizeof(float) * C0 * g.plane.floats);
  const size_t s1 = align16(elem * win1 * g.s1_stride);
  const size_t d1 = align16((elem * 8 + sizeof(bool)) * round_up(win1, 16));
  const size_t w1 = align16((elem * 8 + 2 * sizeof(float)) * k_padded);
  // The stage-1 rows and weights are read before the stage-2 depthwise step
  // writes A, so they can take A's place; not where a tile splits, as the
  // other parts of its cluster may send their columns of A before this part
  // has read them. (Saves 7.5 KB for lumenbridge-base: three blocks fit an SM.)
  const bool in_a = !splits && d1 + w1 <= a_tile_bytes(k_padded, elem);
  // Offsets within the region: the image window and s1 at its start, then
  // the stage-1 rows and weights unless in A; the taps past the output tile.
  const size_t rows_at = std::max(image, s1);
  const size_t taps_at = std::max(rows_at + (in_a ? 0 : d1 + w1), align16(out_tile_bytes(out_channels, elem)));
  const size_t taps = align16(taps_with_bias_bytes(K, k_padded, elem));
  const size_t scratch = taps_at + taps + align16(float_taps_bytes(K, kMaxImageChannels));
  g.layout = shared_layout(k_padded, scratch, out_channels, elem, splits);
  g.d1_offset = in_a ? g.layout.a_offset : g.layout.region_offset + rows_at;
  g.w1_offset = g.d1_offset + d1;
  g.taps_offset = g.layout.region_offset + taps_at;
  g.taps1_offset = g.taps_offset + taps;
  return g;
}

// Whether every offset load_image_window forms fits its int. An offset is
// from the window's corner to the clamped pixel a slot reads: at most a
// slot's row (up to the last slot's, below the window when its side is
// smaller than the widest) plus, for a window in the padding below or right
// of the image, the padding's extent, times the images' row step; likewise
// in columns times the pixel step.
bool window_offsets_fit(const TokenizeProblem& p) {
  const int side = image_window_side(static_cast<int>(p.K), static_cast<int>(p.stages[0].stride),
                                     static_cast<int>(p.stages[1].stride));
  const int64_t last_row = (int64_t{window_slots(static_cast<int>(p.K))} * kThreads - 1) / side;
  const bool nhwc = p.layout == Layout::NHWC;
  const int64_t row_step = nhwc ? p.W * p.C : p.W, pixel_step = nhwc ? p.C : 1;
  const int64_t rows = last_row + side + (p.Hp - p.H), columns = side + (p.Wp - p.W);
  return rows * row_step + columns * pixel_step <= std::numeric_limits<int32_t>::max();
}

// Whether every stage's output plane has fewer than 2^31 pixels: the stage
// kernels find a pixel's row and column from its 32-bit place in its plane.
bool planes_fit(const TokenizeProblem& p) {
  for (const TokenizeStage& s : p.stages) {
    if (s.out_h * s.out_w > std::numeric_limits<int32_t>::max()) return false;
  }
  return true;
}

// The stage kernel's region: the output tile, then the taps, where that fits
// a block; else the taps at its start, where the output tile overwrites them.
struct StageLayout {
  SharedLayout shared;
  size_t taps_offset;
  bool reload_taps;
};

StageLayout stage_layout(int K, int k_padded, int out_channels, size_t elem) {
  const size_t out_tile = out_tile_bytes(out_channels, elem), taps = taps_with_bias_bytes(K, k_padded, elem);
  const SharedLayout apart = shared_layout(k_padded, out_tile + taps, out_channels, elem, true);
  if (apart.total + sizeof(RowSource) <= max_shared_bytes_per_block()) {
    return {apart, apart.region_offset + out_tile, false};
  }
  const SharedLayout shared = shared_layout(k_padded, taps, out_channels, elem, true);
  return {shared, shared.region_offset, true};
}

// A stage-kernel block's shared memory: the layout's, dynamic, and the static RowSource.
size_t stage_shared_bytes(const StageLayout& layout) { return layout.shared.total + sizeof(RowSource); }

// Threads per stage-kernel block: kThreads where two such blocks fit in an
// SM's shared memory, else twice that in one block (the last stage's
// full-width LayerNorm tile). Measured on the last stage of
// lumenbridge-base (B = 256): 238 us with two 8-warp blocks of 32 rows,
// 216 us with one 16-warp block of 64, which reads the pointwise weight
// from L2 half as often.
int stage_threads(const StageLayout& layout) {
  return two_blocks_fit(stage_shared_bytes(layout)) ? kThreads : 2 * kThreads;
}

// Persistent blocks for one wave on the current device, `per_sm` on each SM
// (two 8-warp blocks or one of 16: the launch bounds).
int64_t one_wave(int per_sm) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return int64_t{sms} * per_sm;
}

// How a launch follows the kernel before it on the stream.
enum class Follows {
  kAnyWork,      // after all earlier work has finished, as a plain launch does
  kFusedKernel,  // programmatically: it may start while the kernel before it (usually one
                 // of this file's, which lets it) runs, and waits in wait_for_previous_kernel
};

// A launch of `blocks` blocks on the current stream, in thread-block
// clusters of `cluster` where that is above 1.
struct KernelLaunch {
  cudaLaunchAttribute attributes[2];
  cudaLaunchConfig_t config;

  KernelLaunch(int64_t blocks, int threads, size_t shared_bytes, int cluster, Follows follows)
      : attributes{}, config{} {
    config.gridDim = dim3(grid_x(blocks));
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = shared_bytes;
    config.stream = at::cuda::getCurrentCUDAStream();
    config.attrs = attributes;
    if (cluster > 1) {
      cudaLaunchAttribute& clusters = attributes[config.numAttrs++];
      clusters.id = cudaLaunchAttributeClusterDimension;
      clusters.val.clusterDim.x = cluster;
      clusters.val.clusterDim.y = 1;
      clusters.val.clusterDim.z = 1;
    }
    if (follows == Follows::kFusedKernel) {
      cudaLaunchAttribute& early = attributes[config.numAttrs++];
      early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      early.val.programmaticStreamSerializationAllowed = 1;
    }
  }
  KernelLaunch(const KernelLaunch&) = delete;  // config points at attributes
  KernelLaunch& operator=(const KernelLaunch&) = delete;
};

// How the next stage kernel follows a launch of `blocks` blocks: early where
// those leave whole SMs idle for its blocks to start on, else after it, as a
// plain launch (launch itself falls back to that for a kernel without sm_90
// code). Measured on the H200 (benchmarks/NOTES.md, steps 67 and 68): early
// everywhere made every batch from 8 up slower.
Follows next_follows(int64_t blocks) {
  return blocks < one_wave(1) ? Follows::kFusedKernel : Follows::kAnyWork;
}

// Whether `kernel` runs code compiled for sm_90 or later on the current
// device: GPUs before sm_90 run older code, and PTX of an older target,
// compiled for a newer GPU when the library loads, has neither cluster nor
// griddepcontrol instructions. Asked of the runtime once per kernel and device.
template <typename Kernel>
bool compiled_for_sm90(Kernel kernel) {
  using Key = std::pair<const void*, int>;
  static std::mutex mutex;
  static std::map<Key, bool> answers;
  const Key key{reinterpret_cast<const void*>(kernel), c10::cuda::current_device()};
  const std::lock_guard<std::mutex> lock(mutex);
  const auto known = answers.find(key);
  if (known != answers.end()) return known->second;
  cudaFuncAttributes attributes;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  return answers.emplace(key, attributes.ptxVersion >= 90).first->second;
}

// Launches `blocks` blocks, in thread-block clusters of `cluster` where that
// is above 1, and returns how the next stage kernel follows it. A kernel
// without sm_90 code (no wait, or a GPU without programmatic launches)
// follows plainly.
template <typename Kernel, typename Args>
Follows launch(Kernel kernel, int64_t blocks, int threads, size_t shared_bytes, const Args& args, Follows follows,
               int cluster = 1) {
  if (blocks == 0) return follows;
  if (follows == Follows::kFusedKernel && !compiled_for_sm90(kernel)) follows = Follows::kAnyWork;
  allow_shared_bytes(kernel, shared_bytes);
  const KernelLaunch launched(blocks, threads, shared_bytes, cluster, follows);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&launched.config, kernel, args));
  return next_follows(blocks);
}

// `saved`: where tokenize_for_training keeps the stage's depthwise rows (undefined for tokenize).
template <typename T>
StageGemm<T> stage_gemm(const TokenizeStage& stage, const TileOutput<T>& output, const at::Tensor& saved) {
  StageGemm<T> g;
  g.dw_weight = stage.dw_weight.data_ptr<T>();
  g.dw_bias = stage.dw_bias.data_ptr<T>();
  g.pw.weight = stage.pw_weight.data_ptr<T>();
  g.pw.bias = stage.pw_bias.data_ptr<T>();
  g.pw.in_channels = static_cast<int>(stage.in_channels);
  g.pw.out_channels = static_cast<int>(stage.out_channels);
  g.pw.vector = stage.in_channels % 8 == 0 && aligned16(g.pw.weight);
  g.k_padded = round_up(static_cast<int>(stage.in_channels), kChannelGroup);
  g.channel_groups = Divisor::of(g.k_padded / kChannelGroup);
  g.output = output;
  g.saved_rows = saved.defined() ? saved.data_ptr<T>() : nullptr;
  g.saved_units = Divisor::of(saved.defined() ? static_cast<int>(saved.size(1)) / 8 : 1);
  return g;
}

// Splits each tile's output columns between `parts` blocks.
template <typename T>
void split_columns(TileOutput<T>& o, int parts) {
  o.parts = parts;
  o.columns = o.channels / parts;
  o.units = Divisor::of(o.vector ? o.columns / 8 : o.columns);
}

// Parts per tile for the `tiles` of a stage kernel's last wave, on `sms`
// SMs: the columns split in two again, in whole 16-byte units, up to
// kMaxNarrowParts while the split wave keeps to one block an SM, and a
// `wide` kernel's (16-warp blocks: a wide last stage) on up to
// kMaxColumnParts while it keeps to a quarter of the SMs. The parts repeat
// work (each its tile's rows and taps, and before sm_90 the whole depthwise
// step), so the split pays where SMs are idle. Measured on lumenbridge-base
// (H100, benchmarks/NOTES.md, step 88): stage 3 at B = 4 in 2 parts (98
// blocks) 1.3 us faster than in 4 (196, two on some SMs), at B = 8 unsplit
// (98) 2.8 us faster than in 2; the last stage in 8 parts 1-1.5 us faster at
// B = 1 (32 blocks), 0.5 us slower at B = 2 (56).
template <typename T>
int column_parts(int64_t tiles, int64_t sms, const TileOutput<T>& o, bool wide) {
  if (!o.vector) return 1;
  const auto splits_again = [&](int parts) {
    const int next = parts * 2;
    const int64_t most_blocks = next <= kMaxNarrowParts ? sms : sms / 4;
    return next <= (wide ? kMaxColumnParts : kMaxNarrowParts) && tiles * next <= most_blocks &&
           (o.channels / 8) % next == 0;
  };
  int parts = 1;
  while (splits_again(parts)) parts *= 2;
  return parts;
}

// The runtime's answer to `ask` for a launch of `kernel` with `threads`,
// `shared_bytes` and `parts`, on the current device: asked once per kernel,
// device and shape and kept (one answer store per `ask`), since calls that
// split (small batches above all) spend most of their time on the host.
template <typename Kernel, typename Ask>
int64_t asked_once(Kernel kernel, int threads, size_t shared_bytes, int parts, Ask ask) {
  using Key = std::tuple<const void*, int, int, size_t, int>;
  static std::mutex mutex;
  static std::map<Key, int64_t> answers;
  const Key key{reinterpret_cast<const void*>(kernel), c10::cuda::current_device(), threads, shared_bytes, parts};
  const std::lock_guard<std::mutex> lock(mutex);
  const auto known = answers.find(key);
  if (known != answers.end()) return known->second;
  const int64_t answer = ask();
  answers.emplace(key, answer);
  return answer;
}

// Clusters of `parts` blocks of `kernel` that the current device holds at
// once: 0 where the kernel has no cluster code (compiled_for_sm90); else
// cudaOccupancyMaxActiveClusters (a cluster's blocks share one GPC,
// so a wave's worth of blocks in clusters may not all fit).
template <typename Kernel>
int64_t resident_clusters(Kernel kernel, int threads, size_t shared_bytes, int parts) {
  return asked_once(kernel, threads, shared_bytes, parts, [&]() -> int64_t {
    int resident = 0;
    if (compiled_for_sm90(kernel)) {
      allow_shared_bytes(kernel, shared_bytes);
      const KernelLaunch clustered(parts, threads, shared_bytes, parts, Follows::kAnyWork);
      C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&resident, kernel, &clustered.config));
    }
    return resident;
  });
}

// Where stage i writes: an intermediate NHWC tensor after the activation,
// or the tokens (and, for tokenize_for_training, `saved_output` before the
// activation or the token norm: SavedForward::saves_output).
template <typename T>
TileOutput<T> tile_output(at::Tensor& out, const at::Tensor& saved_output, const TokenizeStage& stage, bool last,
                          const TokenizeProblem& p) {
  TORCH_INTERNAL_ASSERT(!(last && saved_output.defined()) || p.has_token_norm(),
                        "the last stage's output is saved only where the token norm follows it (no stage norm is fused)");
  TileOutput<T> o;
  o.out = out.data_ptr<T>();
  o.saved_output = saved_output.defined() ? saved_output.data_ptr<T>() : nullptr;
  o.activated = !last;
  o.act = activation_form<T>(p.activation);
  o.channels = static_cast<int>(stage.out_channels);
  o.plane = stage.out_h * stage.out_w;
  o.planes = last && p.format == TokenFormat::NCHW;
  o.norm_weight = last && p.has_token_norm() ? p.token_norm_weight.data_ptr<T>() : nullptr;
  o.norm_bias = last && p.has_token_norm() ? p.token_norm_bias.data_ptr<T>() : nullptr;
  o.vector = stage.out_channels % 8 == 0 && aligned16(o.out) && aligned16(o.saved_output) &&
             aligned16(o.norm_weight) && aligned16(o.norm_bias);
  o.eps = static_cast<float>(p.eps);
  split_columns(o, 1);
  return o;
}

// Parts per first-kernel tile: where the tiles split `parts` ways still fit
// one wave of `slots` blocks, all as clusters the device holds at once
// (resident_clusters: 0 for a kernel without cluster code, whose tiles do
// not split), the most parts up to kMaxNarrowParts that divide both stage
// 2's input channel groups (the parts share them) and its output's 16-byte
// units: lumenbridge-base at B = 1 has 49 tiles, 3 groups and 24 units, so
// 3 parts, 147 blocks of 264. The parts repeat the image window and the
// stage-1 depthwise step, which cost little next to the rest of a tile.
template <typename T, typename Kernel>
int first_kernel_parts(int64_t tiles, int64_t slots, const StageGemm<T>& g, Kernel split_kernel,
                       size_t shared_bytes) {
  if (!g.output.vector) return 1;
  const int groups = g.channel_groups.value;
  for (int parts = std::min(kMaxNarrowParts, groups); parts > 1; --parts) {
    if (groups % parts == 0 && (g.output.channels / 8) % parts == 0 && tiles * parts <= slots &&
        resident_clusters(split_kernel, kThreads, shared_bytes, parts) >= tiles) {
      return parts;
    }
  }
  return 1;
}

// Blocks of `kernel` an SM holds at once with `shared_bytes` each, with the
// kernel's shared-memory carve-out at its largest (asked once: asked_once).
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int threads, size_t shared_bytes) {
  return asked_once(kernel, threads, shared_bytes, 1, [&]() -> int64_t {
    allow_shared_bytes(kernel, shared_bytes);
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
    int resident = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, threads, shared_bytes));
    return resident;
  });
}

// The first kernel for tiles that do not split, and its blocks an SM: for
// tokenize_for_training (`saves`), the instance whose registers are bounded
// for three blocks where three fit (compiled for K = 3 alone: wider
// kernels' windows leave no room for three at any stage width worth it);
// else the one for two, or one where only one fits. Measured on an H100
// (lumenbridge-base, B = 256, bf16; benchmarks/NOTES.md, step 113): three
// blocks took the training forward's first kernel from 727.6 to 702.6 us,
// whose stores of the saved rows they hide, but the inference forward's
// from 608.4 to 616.5 us (its GEMM reads A three times).
template <typename T, int K>
std::pair<void (*)(FirstArgs<T>), int> whole_first_kernel(size_t shared_bytes, bool saves) {
  if constexpr (K == 3) {
    const auto three = fused_first_kernel<T, K, false, 3>;
    if (saves && resident_blocks(three, kThreads, shared_bytes) >= 3) return {three, 3};
  }
  return {fused_first_kernel<T, K, false, 2>, two_blocks_fit(shared_bytes) ? 2 : 1};
}

// Sets the windows and shared memory of a first-kernel launch.
template <typename T>
void use_geometry(FirstArgs<T>& a, const FirstGeometry& g) {
  a.win1_h = g.win1_h;
  a.win1_w = Divisor::of(g.win1_w);
  a.win0_h = g.win0_h;
  a.win0_w = Divisor::of(g.win0_w);
  a.plane = g.plane;
  a.s1_stride = g.s1_stride;
  a.layout = g.layout;
  a.d1_offset = g.d1_offset;
  a.w1_offset = g.w1_offset;
  a.taps_offset = g.taps_offset;
  a.taps1_offset = g.taps1_offset;
}

// Launches the first kernel; returns how the next stage kernel follows it.
template <typename T, int K>
Follows launch_first(const at::Tensor& images, const TokenizeProblem& p, at::Tensor& out, bool last,
                     const at::Tensor& saved_rows1, const SavedStage& saved) {
  const TokenizeStage& s1 = p.stages[0];
  const TokenizeStage& s2 = p.stages[1];
  FirstArgs<T> a;
  a.gemm = stage_gemm<T>(s2, tile_output<T>(out, saved.output, s2, last, p), saved.rows);
  a.part_groups = a.gemm.channel_groups;  // a tile's parts divide them below, where it splits
  a.images = images.data_ptr();
  a.uint8_input = p.uint8_input;
  a.nhwc = p.layout == Layout::NHWC;
  a.C0 = static_cast<int>(p.C);
  a.H0 = static_cast<int>(p.H);
  a.W0 = static_cast<int>(p.W);
  a.stride1 = static_cast<int>(s1.stride);
  a.stride2 = static_cast<int>(s2.stride);
  a.act1 = activation_form<T>(p.activation);
  a.normalization = image_normalization(p);
  a.dw1_weight = s1.dw_weight.data_ptr<T>();
  a.dw1_bias = s1.dw_bias.data_ptr<T>();
  a.pw1_weight = s1.pw_weight.data_ptr<T>();
  a.pw1_bias = s1.pw_bias.data_ptr<T>();
  a.saved_rows1 = saved_rows1.defined() ? saved_rows1.data_ptr<T>() : nullptr;
  a.C1 = static_cast<int>(s1.out_channels);
  a.H1 = static_cast<int>(s1.out_h);
  a.W1 = static_cast<int>(s1.out_w);
  a.H2 = static_cast<int>(s2.out_h);
  a.W2 = static_cast<int>(s2.out_w);
  a.tiles_y = Divisor::of(ceil_div(a.H2, kTile));
  a.tiles_x = Divisor::of(ceil_div(a.W2, kTile));
  const int64_t tiles = p.N * a.tiles_y.value * a.tiles_x.value;
  a.tiles = static_cast<int>(grid_x(tiles));  // tile indices are ints
  const auto geometry = [&](bool splits) {
    return first_geometry(a.C0, K, a.stride1, a.stride2, a.gemm.k_padded, a.gemm.pw.out_channels, sizeof(T), splits);
  };
  const FirstGeometry whole = geometry(false);
  use_geometry(a, whole);
  const auto [kernel, per_sm] = whole_first_kernel<T, K>(whole.layout.total, saved_rows1.defined());
  const int64_t slots = one_wave(per_sm);
  const FirstGeometry split = geometry(true);
  const auto split_kernel = fused_first_kernel<T, K, true, 2>;
  const int parts = split.layout.total <= max_shared_bytes_per_block()
                        ? first_kernel_parts(tiles, slots, a.gemm, split_kernel, split.layout.total)
                        : 1;
  if (parts == 1) return launch(kernel, std::min(tiles, slots), kThreads, whole.layout.total, a, Follows::kAnyWork);
  use_geometry(a, split);
  split_columns(a.gemm.output, parts);
  a.part_groups = Divisor::of(a.gemm.channel_groups.value / parts);
  // Its blocks fill at most one wave of slots (first_kernel_parts), more
  // blocks than SMs at B = 1 but with slots free for the next kernel's to
  // start in: -0.7 us a forward at B = 1 on the H100 (benchmarks/NOTES.md,
  // step 83), where next_follows would count SMs.
  launch(split_kernel, tiles * parts, kThreads, split.layout.total, a, Follows::kAnyWork, parts);
  return Follows::kFusedKernel;
}

// Launches stage i's kernel (two launches where its last wave splits), the
// first as `follows` says; returns how the next stage kernel follows the last.
template <typename T, int K>
Follows launch_stage(const at::Tensor& input, const TokenizeProblem& p, size_t i, at::Tensor& out, bool last,
                     const SavedStage& saved, Follows follows) {
  const TokenizeStage& stage = p.stages[i];
  const TokenizeStage& before = p.stages[i - 1];
  StageArgs<T> a;
  a.gemm = stage_gemm<T>(stage, tile_output<T>(out, saved.output, stage, last, p), saved.rows);
  a.input = input.data_ptr<T>();
  a.H = static_cast<int>(before.out_h);
  a.W = static_cast<int>(before.out_w);
  a.Ho = static_cast<int>(stage.out_h);
  a.Wo = static_cast<int>(stage.out_w);
  a.stride = static_cast<int>(stage.stride);
  a.pixels = p.N * stage.out_h * stage.out_w;
  a.vector_input = stage.in_channels % 8 == 0 && aligned16(a.input);
  const StageLayout layout = stage_layout(K, a.gemm.k_padded, a.gemm.pw.out_channels, sizeof(T));
  a.layout = layout.shared;
  a.taps_offset = layout.taps_offset;
  a.reload_taps = layout.reload_taps;
  a.first_tile = 0;
  a.tiles = ceil_div64(a.pixels, kTileRows);
  const size_t shared_bytes = a.layout.total;
  const int threads = stage_threads(layout);
  const auto kernel = [threads](auto split) {
    return threads == kThreads ? fused_stage_kernel<T, K, kThreads, split.value>
                               : fused_stage_kernel<T, K, 2 * kThreads, split.value>;
  };
  const int64_t slots = one_wave(threads == kThreads ? 2 : 1);
  // Whole waves run unsplit; the tiles of a last wave that leaves SMs idle
  // (all of them at small batches) split their columns where column_parts
  // says, as a launch of their own.
  const int64_t tail = a.tiles <= slots ? a.tiles : a.tiles % slots;
  int parts = tail == 0 ? 1 : column_parts(tail, one_wave(1), a.gemm.output, threads != kThreads);
  // A tile's parts run as a thread-block cluster, all resident at once,
  // where the kernel has cluster code (sm_90 and later): they share the
  // depthwise step and a token norm's row statistics (over the whole row).
  // Elsewhere each part computes the whole depthwise step, and a token
  // norm's tiles do not split.
  const auto split_kernel = kernel(std::true_type{});
  const bool clustered = parts > 1 && compiled_for_sm90(split_kernel);
  const bool norm = a.gemm.output.norm_weight != nullptr;
  while ((clustered || norm) && parts > 1 && resident_clusters(split_kernel, threads, shared_bytes, parts) < tail) {
    parts /= 2;
  }
  const int64_t split_tiles = parts > 1 ? tail : 0;
  StageArgs<T> whole_waves = a;
  whole_waves.tiles = a.tiles - split_tiles;
  follows = launch(kernel(std::false_type{}), std::min(whole_waves.tiles, slots), threads, shared_bytes, whole_waves,
                   follows);
  if (split_tiles == 0) return follows;
  a.first_tile = whole_waves.tiles;
  split_columns(a.gemm.output, parts);
  return launch(split_kernel, split_tiles * parts, threads, shared_bytes, a, follows, clustered ? parts : 1);
}

// What tokenize_for_training saves of stage i, appended to `saved`: its
// depthwise rows, and its output before the activation or norm where
// SavedForward::saves_output says so. Each is an allocation of its own: an
// op's outputs may not share storage (opcheck's fake-tensor check compares
// their aliasing).
SavedStage save_stage(SavedForward& saved, const TokenizeProblem& p, size_t i, const at::TensorOptions& options) {
  TORCH_INTERNAL_ASSERT(saved.rows.size() == i, "save_stage takes the stages in order");
  const std::vector<int64_t> sizes = depthwise_rows_sizes(p, i);
  TORCH_INTERNAL_ASSERT(sizes[1] % 8 == 0 && (i > 0 || sizes[1] == 8),
                        "the fused kernels write the rows in 16-byte units, the images' stage's in one");
  saved.rows.push_back(new_output(sizes, options, at::MemoryFormat::Contiguous));
  if (SavedForward::saves_output(i, p)) {
    saved.outputs.push_back(new_output(saved_output_sizes(p, i), options, at::MemoryFormat::Contiguous));
  }
  return saved.stage(i);
}

// The tokens; with `saved` (tokenize_for_training's; null for tokenize) the
// kernels also write into it what save_stage allocates of each stage. Each
// tensor is allocated just before the launch that writes it: a call's first
// launch waits on the host, the later ones' allocations overlap the GPU's work.
template <typename T, int K>
at::Tensor run_fused(const at::Tensor& images, const TokenizeProblem& p, SavedForward* saved) {
  const size_t S = p.stages.size();
  const at::TensorOptions options = images.options().dtype(p.dtype);
  auto stage_output = [&](size_t i) {
    if (i + 1 == S) return new_output(p.output_sizes(), options, at::MemoryFormat::Contiguous);
    const TokenizeStage& s = p.stages[i];
    return at::empty({p.N, s.out_h, s.out_w, s.out_channels}, options);
  };
  auto stage_saves = [&](size_t i) { return saved == nullptr ? SavedStage{} : save_stage(*saved, p, i, options); };
  at::Tensor x = stage_output(1);
  const at::Tensor rows0 = stage_saves(0).rows;
  Follows follows = launch_first<T, K>(images, p, x, S == 2, rows0, stage_saves(1));
  for (size_t i = 2; i < S; ++i) {
    at::Tensor y = stage_output(i);
    follows = launch_stage<T, K>(x, p, i, y, i + 1 == S, stage_saves(i), follows);
    x = y;
  }
  return x;  // the tokens
}

}  // namespace
}  // namespace fused

std::string fused_unsupported_reason(at::ScalarType dtype, int64_t in_channels,
                                     const std::vector<int64_t>& widths, int64_t kernel_size,
                                     const std::vector<int64_t>& strides, StageNorm norm) {
  using namespace fused;
  if (dtype != at::kHalf && dtype != at::kBFloat16) {
    return "the fused kernels run float16 and bfloat16; other dtypes compose the depthwise "
           "convolutions (LumenBridge's for NCHW, cuDNN's for channels-last) with cuDNN";
  }
  if (widths.size() < 2) return "the fused kernels need at least two stages";
  if (in_channels > kMaxImageChannels) {
    return "the fused kernels take images of up to " + text(kMaxImageChannels) + " channels";
  }
  if (norm != StageNorm::NONE) return "stage norms are not fused";
  const size_t elem = 2;
  const int K = static_cast<int>(kernel_size);
  for (size_t i = 1; i < widths.size(); ++i) {
    const int k_padded = round_up(static_cast<int>(widths[i - 1]), kChannelGroup);
    const int out_channels = static_cast<int>(widths[i]);
    const size_t bytes =
        i == 1 ? first_geometry(static_cast<int>(in_channels), K, static_cast<int>(strides[0]),
                                static_cast<int>(strides[1]), k_padded, out_channels, elem, false)
                     .layout.total
               : stage_shared_bytes(stage_layout(K, k_padded, out_channels, elem));
    if (bytes > max_shared_bytes_per_block()) {
      return "stage " + text(static_cast<int64_t>(i)) + " (" + text(widths[i - 1]) + " -> " +
             text(widths[i]) + " channels) needs more shared memory than a block has";
    }
  }
  return "";
}

namespace {

// The configuration's answer (fused_unsupported_reason, which `lumenbridge
// info` reports), then the images': rows too wide for the window's int
// offsets (tens of millions of elements) run the composed kernels, with a
// warning, as the configuration alone cannot tell.
bool fused_covers(const TokenizeProblem& p) {
  std::vector<int64_t> widths, strides;
  for (const TokenizeStage& s : p.stages) {
    widths.push_back(s.out_channels);
    strides.push_back(s.stride);
  }
  if (!fused_unsupported_reason(p.dtype, p.C, widths, p.K, strides, p.stage_norm).empty()) return false;
  if (!fused::window_offsets_fit(p) || !fused::planes_fit(p)) {
    TORCH_WARN_ONCE("LumenBridge: images of ", text({p.H, p.W}), " pixels padded to ", text({p.Hp, p.Wp}),
                    " run the composed kernels: the fused kernels address an image window and each stage's ",
                    "output plane with 32-bit offsets");
    return false;
  }
  return true;
}

at::Tensor tokenize_fused(const at::Tensor& images, const TokenizeProblem& p, SavedForward* saved) {
  TORCH_CHECK(p.N * p.C * p.H * p.W < (int64_t{1} << 62), "LumenBridge: images too large for the fused kernels, got ",
              text({p.N, p.C, p.H, p.W}));
  at::Tensor result;
  const auto run = [&](auto element) {
    using T = decltype(element);
    dispatch_kernel_size(p.K, [&](auto k) { result = fused::run_fused<T, decltype(k)::value>(images, p, saved); });
  };
  LUMENBRIDGE_DISPATCH_HALF_TYPES(p.dtype, "lumenbridge_tokenize_fused", [&] { run(scalar_t{}); });
  return result;
}

}  // namespace

at::Tensor tokenize(const at::Tensor& images, const TokenizeProblem& p) {
  const c10::cuda::CUDAGuard guard(images.device());
  if (!fused_covers(p)) return tokenize_composed(images, p, &cuda::depthwise_forward);
  return tokenize_fused(images, p, nullptr);
}

TrainingResult tokenize_for_training(const at::Tensor& images, const TokenizeProblem& p) {
  const c10::cuda::CUDAGuard guard(images.device());
  if (!fused_covers(p)) return tokenize_for_training_composed(images, p, backward_kernels());
  SavedForward saved;
  at::Tensor tokens = tokenize_fused(images, p, &saved);
  return {tokens, saved.rows, saved.outputs};
}

}  // namespace cuda
}  // namespace lumenbridge

#ifdef LUMENBRIDGE_PHASE_CLOCKS
namespace lumenbridge {
namespace cuda {
namespace {

// The phase clocks' stamps since the last call on the current device, as
// int64 [2 * kClockKinds, kClockBlocks, kPhaseMarks, 2] (global timer ns,
// SM cycles; zero where a block stamped none), then cleared.
at::Tensor read_phase_clocks() {
  at::Tensor stamps =
      at::empty({2 * fused::kClockKinds, fused::kClockBlocks, fused::kPhaseMarks, 2}, at::TensorOptions(at::kLong));
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  C10_CUDA_CHECK(cudaMemcpyFromSymbol(stamps.data_ptr(), fused::phase_clocks, stamps.nbytes()));
  void* device_stamps = nullptr;
  C10_CUDA_CHECK(cudaGetSymbolAddress(&device_stamps, fused::phase_clocks));
  C10_CUDA_CHECK(cudaMemset(device_stamps, 0, stamps.nbytes()));
  return stamps;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lumenbridge, m) { m.def("phase_clocks() -> Tensor", &read_phase_clocks); }

}  // namespace cuda
}  // namespace lumenbridge
#endif

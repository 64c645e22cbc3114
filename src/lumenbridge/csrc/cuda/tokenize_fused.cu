// lumenbridge::tokenize on CUDA: the whole tokenizer in S - 1 launches for S
// stages, bf16 or fp16, intermediates in NHWC.
//
//   first kernel   images (uint8 or T, NCHW or NHWC) -> stage 1 -> stage 2 output.
//                  Stage 2's 8 x 8 output tiles compute the stage-1 outputs they
//                  need (halo included) straight from the image window, so the
//                  stage-1 activation never reaches device memory.
//   stage kernel   stage i output -> stage i + 1 output, one per later stage;
//                  blocks take 64 consecutive output pixels, so no tile is
//                  partly empty at 28 x 28 or 14 x 14.
// Either kernel's last instance writes the tokens: bias, token LayerNorm and
// the requested layout in its epilogue. Every kernel computes its depthwise
// tile into shared memory and multiplies it on the tensor cores
// (fused_parts.cuh); nothing but stage outputs leaves the SM.
#include <c10/cuda/CUDAGuard.h>

#include "depthwise_forward.cuh"
#include "fused_parts.cuh"

namespace lumenbridge {
namespace cuda {
namespace fused {
namespace {

constexpr int kTile = 8;  // first kernel: stage-2 tiles of kTile x kTile pixels
static_assert(kTile * kTile == kTileRows, "a first-kernel tile is one GEMM block");
constexpr int kMaxImageChannels = 4;

// Fields of one pointwise stage shared by both kernels.
template <typename T>
struct StageGemm {
  const T* dw_weight;  // [Cin, 1, K, K]
  const T* dw_bias;
  PointwiseWeight<T> pw;
  int k_padded;  // Cin rounded up to kChannelGroup
  Activation act;
  TileOutput<T> output;
};

// Shared memory of a block: row bookkeeping, A, then a region that holds the
// producer's scratch and, once A is complete, the output tile.
struct SharedLayout {
  size_t a_offset, region_offset, total;
};

SharedLayout shared_layout(int rows, int k_padded, size_t scratch_bytes, int out_channels, size_t elem) {
  SharedLayout l;
  l.a_offset = align16(sizeof(RowInfo));
  l.region_offset = l.a_offset + align16(rows * padded_stride(k_padded) * elem);
  const size_t out_bytes = rows * padded_stride(round_up(out_channels, 8)) * elem;
  l.total = l.region_offset + align16(std::max(scratch_bytes, out_bytes));
  return l;
}

// The GEMM and the epilogue, once a block's A tile is complete.
template <typename T, int Rows>
__device__ void finish_block(unsigned char* shared, const SharedLayout& layout, const StageGemm<T>& s,
                             RowInfo& rows) {
  const T* a_tile = reinterpret_cast<const T*>(shared + layout.a_offset);
  T* out_tile = reinterpret_cast<T*>(shared + layout.region_offset);
  const int out_stride = padded_stride(round_up(s.pw.out_channels, 8));
  gemm_tile<T, Rows>(a_tile, padded_stride(s.k_padded), s.k_padded, s.pw, s.act, out_tile, out_stride);
  __syncthreads();
  write_tile<T, Rows>(out_tile, out_stride, s.output, rows);
}

// Depthwise weights [C, 1, K, K] into shared memory as [K * K][Cp], so a
// thread's 8 channels of one tap are one 16-byte read; zeros past C.
template <typename T, int K>
__device__ void load_depthwise_taps(T* taps, const T* weight, int channels, int padded) {
  for (int i = threadIdx.x; i < padded * K * K; i += kThreads) {
    const int c = i / (K * K), tap = i % (K * K);
    taps[tap * padded + c] = c < channels ? weight[i] : T(0.0f);
  }
}

// ---- the stage kernel ----------------------------------------------------------

template <typename T>
struct StageArgs {
  StageGemm<T> gemm;
  const T* input;  // NHWC [N, H, W, Cin]
  int H, W, Ho, Wo, stride;
  int64_t pixels;  // N * Ho * Wo
  bool vector_input;
  SharedLayout layout;
};

// Where each row of a stage-kernel block reads its input: the element offset
// of its window's top-left pixel, and that pixel's coordinates (which may lie
// in the padding), computed once per block instead of once per channel group.
struct RowSource {
  int64_t offset[kTileRows];
  int y[kTileRows], x[kTileRows];
};

// Taps of one kernel row for 8 channels, all loads issued before any is used
// (out-of-image taps are zero), so a thread keeps K loads in flight.
template <typename T, int K>
__device__ __forceinline__ void depthwise_row(const T* row, int x0, int W, int Cin, bool vector, int c,
                                             const T* taps, int Kp, float (&acc)[8]) {
  uint4 pixel[K];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const bool inside = x0 + j >= 0 && x0 + j < W;
    const T* src = row + static_cast<int64_t>(x0 + j) * Cin + c;
    if (vector) {
      pixel[j] = inside ? __ldg(reinterpret_cast<const uint4*>(src)) : make_uint4(0, 0, 0, 0);
    } else {
      float v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = inside && c + e < Cin ? static_cast<float>(src[e]) : 0.0f;
      pixel[j] = pack8<T>(v);
    }
  }
#pragma unroll
  for (int j = 0; j < K; ++j) {
    float v[8], w[8];
    unpack8<T>(pixel[j], v);
    unpack8<T>(*reinterpret_cast<const uint4*>(taps + j * Kp + c), w);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = fmaf(w[e], v[e], acc[e]);
  }
}

template <typename T, int K, int Rows>
__global__ void __launch_bounds__(kThreads, 2) fused_stage_kernel(const StageArgs<T> args) {
  extern __shared__ __align__(16) unsigned char shared[];
  const StageGemm<T>& s = args.gemm;
  auto& rows = *reinterpret_cast<RowInfo*>(shared);
  __shared__ RowSource sources;
  T* a_tile = reinterpret_cast<T*>(shared + args.layout.a_offset);
  T* taps = reinterpret_cast<T*>(shared + args.layout.region_offset);
  const int a_stride = padded_stride(s.k_padded);
  const int Cin = s.pw.in_channels, Kp = s.k_padded;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * Rows;
  for (int r = threadIdx.x; r < kTileRows; r += kThreads) {
    const int64_t pixel = r < Rows && first + r < args.pixels ? first + r : -1;
    rows.pixel[r] = pixel;
    const int64_t plane = static_cast<int64_t>(args.Ho) * args.Wo;
    const int64_t image = pixel < 0 ? 0 : pixel / plane;
    const int offset = pixel < 0 ? 0 : static_cast<int>(pixel % plane);
    sources.y[r] = (offset / args.Wo) * args.stride - K / 2;
    sources.x[r] = (offset % args.Wo) * args.stride - K / 2;
    sources.offset[r] = image * args.H * args.W * Cin;
  }
  load_depthwise_taps<T, K>(taps, s.dw_weight, Cin, Kp);
  __syncthreads();

  const int groups = Kp / 8;
  for (int item = threadIdx.x; item < Rows * groups; item += kThreads) {
    const int r = item / groups, c = (item % groups) * 8;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = c + e < Cin ? static_cast<float>(s.dw_bias[c + e]) : 0.0f;
    if (rows.pixel[r] >= 0 && c < Cin) {
      const T* base = args.input + sources.offset[r];
#pragma unroll
      for (int i = 0; i < K; ++i) {
        const int y = sources.y[r] + i;
        if (y >= 0 && y < args.H) {
          depthwise_row<T, K>(base + static_cast<int64_t>(y) * args.W * Cin, sources.x[r], args.W, Cin,
                              args.vector_input, c, taps + i * K * Kp, Kp, acc);
        }
      }
    }
    store_a8<T>(a_tile + r * a_stride, c, acc);
  }
  __syncthreads();
  finish_block<T, Rows>(shared, args.layout, s, rows);
}

// ---- the first kernel: images -> stage 1 -> stage 2 ------------------------------

template <typename T>
struct FirstArgs {
  StageGemm<T> gemm;  // stage 2
  const void* images;
  bool uint8_input, nhwc;
  int C0, H0, W0;     // images as given; pixels outside are 0 after normalization
  int stride1, stride2;
  Activation act1;  // after stage 1 (stage 2's GEMM has its own, none when stage 2 is last)
  float mean[kMaxImageChannels], std[kMaxImageChannels];
  const T* dw1_weight;
  const T* dw1_bias;
  const T* pw1_weight;  // [C1, C0]
  const T* pw1_bias;
  int C1, H1, W1;       // stage-1 outputs
  int H2, W2, tiles_y, tiles_x;
  // Windows, in stage-1 and image pixels, of one stage-2 tile (halo included).
  int win1_h, win1_w, win0_h, win0_w;
  size_t image_offset, d1_offset, s1_offset, taps_offset;  // within the region
  SharedLayout layout;
};

// The image window of a tile, normalized, into shared memory as float
// [C0][win0_h][win0_w]; zero outside the image. Each warp takes rows, lanes
// take columns, so index math is per row and loads of a row are in flight together.
template <typename T>
__device__ void load_image_window(const FirstArgs<T>& a, int64_t n, int y_origin, int x_origin, float* image) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int row = warp; row < a.C0 * a.win0_h; row += kWarps) {
    const int c = row / a.win0_h, y = y_origin + row % a.win0_h;
    const bool row_inside = y >= 0 && y < a.H0;
    const int64_t row_start = a.nhwc ? ((n * a.H0 + y) * a.W0) * a.C0 + c : ((n * a.C0 + c) * a.H0 + y) * a.W0;
    const int64_t step = a.nhwc ? a.C0 : 1;
    for (int col = lane; col < a.win0_w; col += 32) {
      const int x = x_origin + col;
      float v = 0.0f;
      if (row_inside && x >= 0 && x < a.W0) {
        const int64_t index = row_start + x * step;
        v = a.uint8_input ? (static_cast<float>(static_cast<const uint8_t*>(a.images)[index]) - a.mean[c]) / a.std[c]
                          : static_cast<float>(static_cast<const T*>(a.images)[index]);
      }
      image[row * a.win0_w + col] = v;
    }
  }
}

// Stage-1 outputs for the 32 channels of a chunk (lane = channel) over the
// stage-1 window: pointwise from the depthwise results, the activation, and
// zero outside the stage-1 extent (stage 2's padding). Warps take rows.
template <Activation Act, typename T>
__device__ void fill_stage1(const FirstArgs<T>& a, T* s1, const float4* d1, const float4& w1, float b1, bool real,
                            int y_origin, int x_origin) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int win1 = a.win1_h * a.win1_w;
  // Positions warp, warp + 8, ...: balanced over the warps; the row and
  // column advance by kWarps columns at a time (win1_w >= kWarps).
  int row = warp / a.win1_w, col = warp % a.win1_w;
  for (int q = warp; q < win1; q += kWarps) {
    const int y = y_origin + row, x = x_origin + col;
    float v = 0.0f;
    if (real && y >= 0 && y < a.H1 && x >= 0 && x < a.W1) {
      const float4 d = d1[q];
      v = activate(fmaf(w1.w, d.w, fmaf(w1.z, d.z, fmaf(w1.y, d.y, fmaf(w1.x, d.x, b1)))), Act);
    }
    s1[q * kChannelGroup + lane] = static_cast<T>(v);
    col += kWarps;
    if (col >= a.win1_w) {
      col -= a.win1_w;
      ++row;
    }
  }
}

template <typename T, int K>
__global__ void __launch_bounds__(kThreads, 2) fused_first_kernel(const FirstArgs<T> args) {
  extern __shared__ __align__(16) unsigned char shared[];
  const StageGemm<T>& s = args.gemm;
  auto& rows = *reinterpret_cast<RowInfo*>(shared);
  T* a_tile = reinterpret_cast<T*>(shared + args.layout.a_offset);
  unsigned char* region = shared + args.layout.region_offset;
  float* image = reinterpret_cast<float*>(region + args.image_offset);  // [C0][win0_h][win0_w]
  float4* d1 = reinterpret_cast<float4*>(region + args.d1_offset);      // [win1_h * win1_w], channels padded to 4
  T* s1 = reinterpret_cast<T*>(region + args.s1_offset);                // [win1_h * win1_w][32]
  T* taps = reinterpret_cast<T*>(region + args.taps_offset);            // [K * K][Kp]
  const int a_stride = padded_stride(s.k_padded);
  const int Kp = s.k_padded;

  int64_t tile = blockIdx.x;
  const int tx = static_cast<int>(tile % args.tiles_x) * kTile;
  tile /= args.tiles_x;
  const int ty = static_cast<int>(tile % args.tiles_y) * kTile;
  const int64_t n = tile / args.tiles_y;
  constexpr int pad = K / 2;
  const int y1_origin = ty * args.stride2 - pad, x1_origin = tx * args.stride2 - pad;
  const int y0_origin = y1_origin * args.stride1 - pad, x0_origin = x1_origin * args.stride1 - pad;
  const int win1 = args.win1_h * args.win1_w, win0 = args.win0_h * args.win0_w;

  for (int r = threadIdx.x; r < kTileRows; r += kThreads) {
    const int y = ty + r / kTile, x = tx + r % kTile;
    rows.pixel[r] = y < args.H2 && x < args.W2 ? (n * args.H2 + y) * args.W2 + x : -1;
  }
  load_image_window(args, n, y0_origin, x0_origin, image);
  load_depthwise_taps<T, K>(taps, s.dw_weight, s.pw.in_channels, Kp);
  __syncthreads();

  // Stage-1 depthwise outputs over the stage-1 window, kept in float; channels
  // past C0 are zero, so the pointwise step is four FMAs with no tests.
  for (int q = threadIdx.x; q < win1; q += kThreads) {
    const int y = q / args.win1_w, x = q % args.win1_w;
    float out[kMaxImageChannels];
#pragma unroll
    for (int c = 0; c < kMaxImageChannels; ++c) {
      out[c] = 0.0f;
      if (c >= args.C0) continue;
      const float* src = image + c * win0 + (y * args.stride1) * args.win0_w + x * args.stride1;
      float acc = static_cast<float>(args.dw1_bias[c]);
#pragma unroll
      for (int ky = 0; ky < K; ++ky) {
#pragma unroll
        for (int kx = 0; kx < K; ++kx) {
          acc = fmaf(static_cast<float>(args.dw1_weight[(c * K + ky) * K + kx]), src[ky * args.win0_w + kx], acc);
        }
      }
      out[c] = acc;
    }
    d1[q] = make_float4(out[0], out[1], out[2], out[3]);
  }
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int r = threadIdx.x / 4, cg = (threadIdx.x % 4) * 8;  // this thread's A row and channels
  const int py = r / kTile, px = r % kTile;
  for (int c0 = 0; c0 < Kp; c0 += kChannelGroup) {
    // Stage-1 outputs for 32 channels over the window: pointwise, activation,
    // and zero outside the stage-1 extent (stage 2's padding).
    const int c = c0 + lane;
    const bool real = c < args.C1;
    float w[kMaxImageChannels];
#pragma unroll
    for (int j = 0; j < kMaxImageChannels; ++j) {
      w[j] = real && j < args.C0 ? static_cast<float>(args.pw1_weight[c * args.C0 + j]) : 0.0f;
    }
    const float4 w1 = make_float4(w[0], w[1], w[2], w[3]);
    const float b1 = real ? static_cast<float>(args.pw1_bias[c]) : 0.0f;
    switch (args.act1) {
      case Activation::GELU: fill_stage1<Activation::GELU>(args, s1, d1, w1, b1, real, y1_origin, x1_origin); break;
      case Activation::RELU: fill_stage1<Activation::RELU>(args, s1, d1, w1, b1, real, y1_origin, x1_origin); break;
      case Activation::SILU: fill_stage1<Activation::SILU>(args, s1, d1, w1, b1, real, y1_origin, x1_origin); break;
      case Activation::NONE: fill_stage1<Activation::NONE>(args, s1, d1, w1, b1, real, y1_origin, x1_origin); break;
    }
    __syncthreads();

    // Stage-2 depthwise for this thread's pixel and 8 of the 32 channels.
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      acc[e] = c0 + cg + e < s.pw.in_channels ? static_cast<float>(s.dw_bias[c0 + cg + e]) : 0.0f;
    }
#pragma unroll
    for (int ky = 0; ky < K; ++ky) {
#pragma unroll
      for (int kx = 0; kx < K; ++kx) {
        const int q = (py * args.stride2 + ky) * args.win1_w + px * args.stride2 + kx;
        float v[8], w[8];
        unpack8<T>(*reinterpret_cast<const uint4*>(s1 + q * kChannelGroup + cg), v);
        unpack8<T>(*reinterpret_cast<const uint4*>(taps + (ky * K + kx) * Kp + c0 + cg), w);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = fmaf(w[e], v[e], acc[e]);
      }
    }
    store_a8<T>(a_tile + r * a_stride, c0 + cg, acc);
    __syncthreads();
  }
  finish_block<T, kTileRows>(shared, args.layout, s, rows);
}

// ---- host side -------------------------------------------------------------------

struct FirstGeometry {
  int win1_h, win1_w, win0_h, win0_w;
  size_t image_offset, d1_offset, s1_offset, taps_offset, scratch;
};

FirstGeometry first_geometry(int C0, int K, int stride1, int stride2, int k_padded, size_t elem) {
  FirstGeometry g;
  g.win1_h = g.win1_w = (kTile - 1) * stride2 + K;
  g.win0_h = g.win0_w = (g.win1_h - 1) * stride1 + K;
  g.image_offset = 0;
  g.d1_offset = align16(sizeof(float) * C0 * g.win0_h * g.win0_w);
  g.s1_offset = g.d1_offset + align16(sizeof(float4) * g.win1_h * g.win1_w);
  g.taps_offset = g.s1_offset + align16(elem * g.win1_h * g.win1_w * kChannelGroup);
  g.scratch = g.taps_offset + align16(elem * K * K * k_padded);
  return g;
}

size_t first_shared_bytes(const FirstGeometry& g, int k_padded, int out_channels, size_t elem) {
  return shared_layout(kTileRows, k_padded, g.scratch, out_channels, elem).total;
}

SharedLayout stage_layout(int rows, int K, int k_padded, int out_channels, size_t elem) {
  return shared_layout(rows, k_padded, elem * K * K * k_padded, out_channels, elem);
}

// Rows per stage-kernel block: 64, unless that leaves room for only one
// block per SM (the last stage's full-width LayerNorm tile); then 32.
int stage_rows(int K, int k_padded, int out_channels, size_t elem) {
  const size_t two_blocks = kMaxSharedBytes / 2 - sizeof(RowSource) - 1024;
  return stage_layout(kTileRows, K, k_padded, out_channels, elem).total <= two_blocks ? kTileRows : kTileRows / 2;
}

size_t stage_shared_bytes(int K, int k_padded, int out_channels, size_t elem) {
  const int rows = stage_rows(K, k_padded, out_channels, elem);
  return stage_layout(rows, K, k_padded, out_channels, elem).total + sizeof(RowSource);
}

template <typename Kernel, typename Args>
void launch(Kernel kernel, int64_t blocks, size_t shared_bytes, const Args& args) {
  if (blocks == 0) return;
  allow_shared_bytes(kernel, shared_bytes);
  kernel<<<grid_x(blocks), kThreads, shared_bytes, at::cuda::getCurrentCUDAStream()>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
StageGemm<T> stage_gemm(const TokenizeStage& stage, Activation act, const TileOutput<T>& output) {
  StageGemm<T> g;
  g.dw_weight = stage.dw_weight.data_ptr<T>();
  g.dw_bias = stage.dw_bias.data_ptr<T>();
  g.pw.weight = stage.pw_weight.data_ptr<T>();
  g.pw.bias = stage.pw_bias.data_ptr<T>();
  g.pw.in_channels = static_cast<int>(stage.in_channels);
  g.pw.out_channels = static_cast<int>(stage.out_channels);
  g.pw.vector = stage.in_channels % 8 == 0 && aligned16(g.pw.weight);
  g.k_padded = round_up(static_cast<int>(stage.in_channels), kChannelGroup);
  g.act = act;
  g.output = output;
  return g;
}

// Where stage i writes: an intermediate NHWC tensor, or the tokens.
template <typename T>
TileOutput<T> tile_output(at::Tensor& out, const TokenizeStage& stage, bool last, const TokenizeProblem& p) {
  TileOutput<T> o;
  o.out = out.data_ptr<T>();
  o.channels = static_cast<int>(stage.out_channels);
  o.plane = stage.out_h * stage.out_w;
  o.planes = last && p.format == TokenFormat::NCHW;
  o.vector = stage.out_channels % 8 == 0 && aligned16(o.out);
  o.norm_weight = last && p.has_token_norm() ? p.token_norm_weight.data_ptr<T>() : nullptr;
  o.norm_bias = last && p.has_token_norm() ? p.token_norm_bias.data_ptr<T>() : nullptr;
  o.eps = static_cast<float>(p.eps);
  return o;
}

template <typename T, int K>
void launch_first(const at::Tensor& images, const TokenizeProblem& p, at::Tensor& out, bool last) {
  const TokenizeStage& s1 = p.stages[0];
  const TokenizeStage& s2 = p.stages[1];
  FirstArgs<T> a;
  a.gemm = stage_gemm<T>(s2, last ? Activation::NONE : p.activation, tile_output<T>(out, s2, last, p));
  a.images = images.data_ptr();
  a.uint8_input = p.uint8_input;
  a.nhwc = p.layout == Layout::NHWC;
  a.C0 = static_cast<int>(p.C);
  a.H0 = static_cast<int>(p.H);
  a.W0 = static_cast<int>(p.W);
  a.stride1 = static_cast<int>(s1.stride);
  a.stride2 = static_cast<int>(s2.stride);
  a.act1 = p.activation;
  for (int c = 0; c < kMaxImageChannels; ++c) {
    a.mean[c] = c < p.C ? static_cast<float>(p.mean[c]) : 0.0f;
    a.std[c] = c < p.C ? static_cast<float>(p.std[c]) : 1.0f;
  }
  a.dw1_weight = s1.dw_weight.data_ptr<T>();
  a.dw1_bias = s1.dw_bias.data_ptr<T>();
  a.pw1_weight = s1.pw_weight.data_ptr<T>();
  a.pw1_bias = s1.pw_bias.data_ptr<T>();
  a.C1 = static_cast<int>(s1.out_channels);
  a.H1 = static_cast<int>(s1.out_h);
  a.W1 = static_cast<int>(s1.out_w);
  a.H2 = static_cast<int>(s2.out_h);
  a.W2 = static_cast<int>(s2.out_w);
  a.tiles_y = ceil_div(a.H2, kTile);
  a.tiles_x = ceil_div(a.W2, kTile);
  const FirstGeometry g = first_geometry(a.C0, K, a.stride1, a.stride2, a.gemm.k_padded, sizeof(T));
  a.win1_h = g.win1_h;
  a.win1_w = g.win1_w;
  a.win0_h = g.win0_h;
  a.win0_w = g.win0_w;
  a.image_offset = g.image_offset;
  a.d1_offset = g.d1_offset;
  a.s1_offset = g.s1_offset;
  a.taps_offset = g.taps_offset;
  a.layout = shared_layout(kTileRows, a.gemm.k_padded, g.scratch, a.gemm.pw.out_channels, sizeof(T));
  launch(fused_first_kernel<T, K>, p.N * a.tiles_y * a.tiles_x, a.layout.total, a);
}

template <typename T, int K>
void launch_stage(const at::Tensor& input, const TokenizeProblem& p, size_t i, at::Tensor& out, bool last) {
  const TokenizeStage& stage = p.stages[i];
  const TokenizeStage& before = p.stages[i - 1];
  StageArgs<T> a;
  a.gemm = stage_gemm<T>(stage, last ? Activation::NONE : p.activation, tile_output<T>(out, stage, last, p));
  a.input = input.data_ptr<T>();
  a.H = static_cast<int>(before.out_h);
  a.W = static_cast<int>(before.out_w);
  a.Ho = static_cast<int>(stage.out_h);
  a.Wo = static_cast<int>(stage.out_w);
  a.stride = static_cast<int>(stage.stride);
  a.pixels = p.N * stage.out_h * stage.out_w;
  a.vector_input = stage.in_channels % 8 == 0 && aligned16(a.input);
  const int rows = stage_rows(K, a.gemm.k_padded, a.gemm.pw.out_channels, sizeof(T));
  a.layout = stage_layout(rows, K, a.gemm.k_padded, a.gemm.pw.out_channels, sizeof(T));
  if (rows == kTileRows) {
    launch(fused_stage_kernel<T, K, kTileRows>, ceil_div64(a.pixels, rows), a.layout.total, a);
  } else {
    launch(fused_stage_kernel<T, K, kTileRows / 2>, ceil_div64(a.pixels, rows), a.layout.total, a);
  }
}

template <typename T, int K>
at::Tensor run_fused(const at::Tensor& images, const TokenizeProblem& p) {
  at::Tensor tokens = new_output(p.output_sizes(), images.options().dtype(p.dtype), at::MemoryFormat::Contiguous);
  const size_t S = p.stages.size();
  auto stage_output = [&](size_t i) {
    if (i + 1 == S) return tokens;
    const TokenizeStage& s = p.stages[i];
    return at::empty({p.N, s.out_h, s.out_w, s.out_channels}, images.options().dtype(p.dtype));
  };
  at::Tensor x = stage_output(1);
  launch_first<T, K>(images, p, x, S == 2);
  for (size_t i = 2; i < S; ++i) {
    at::Tensor y = stage_output(i);
    launch_stage<T, K>(x, p, i, y, i + 1 == S);
    x = y;
  }
  return tokens;
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
        i == 1 ? first_shared_bytes(first_geometry(static_cast<int>(in_channels), K, static_cast<int>(strides[0]),
                                                   static_cast<int>(strides[1]), k_padded, elem),
                                    k_padded, out_channels, elem)
               : stage_shared_bytes(K, k_padded, out_channels, elem);
    if (bytes > static_cast<size_t>(kMaxSharedBytes)) {
      return "stage " + text(static_cast<int64_t>(i)) + " (" + text(widths[i - 1]) + " -> " +
             text(widths[i]) + " channels) needs more shared memory than a block has";
    }
  }
  return "";
}

at::Tensor tokenize(const at::Tensor& images, const TokenizeProblem& p) {
  const c10::cuda::CUDAGuard guard(images.device());
  std::vector<int64_t> widths, strides;
  for (const TokenizeStage& s : p.stages) {
    widths.push_back(s.out_channels);
    strides.push_back(s.stride);
  }
  if (!fused_unsupported_reason(p.dtype, p.C, widths, p.K, strides, p.stage_norm).empty()) {
    return tokenize_composed(images, p, &cuda::depthwise_forward);
  }
  TORCH_CHECK(p.N * p.C * p.H * p.W < (int64_t{1} << 62) && p.H <= kMaxExtent && p.W <= kMaxExtent,
              "LumenBridge: images too large for the fused kernels, got ", text({p.N, p.C, p.H, p.W}));
  at::Tensor result;
  AT_DISPATCH_SWITCH(p.dtype, "lumenbridge_tokenize_fused",
                     AT_DISPATCH_CASE(at::ScalarType::Half, [&] {
                       dispatch_kernel_size(p.K, [&](auto k) { result = fused::run_fused<scalar_t, decltype(k)::value>(images, p); });
                     }) AT_DISPATCH_CASE(at::ScalarType::BFloat16, [&] {
                       dispatch_kernel_size(p.K, [&](auto k) { result = fused::run_fused<scalar_t, decltype(k)::value>(images, p); });
                     }));
  return result;
}

}  // namespace cuda
}  // namespace lumenbridge

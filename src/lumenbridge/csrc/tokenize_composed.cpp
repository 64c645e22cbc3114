// The tokenizer composed from per-layer kernels: for NCHW problems
// LumenBridge's depthwise kernels, for channels-last ones (every CPU problem)
// ATen's depthwise convolution; ATen for the pointwise convolutions (cuDNN,
// honouring PyTorch's TF32 switch; oneDNN on the CPU), activations and
// norms. It is the CPU implementation of lumenbridge::tokenize and the
// CUDA one for configurations the fused kernels do not cover; it follows the
// reference model step by step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <limits>

#include <vector>

#include "tokenize_steps.h"

namespace lumenbridge {

at::Tensor normalized_images(const at::Tensor& images, const TokenizeProblem& p) {
  at::Tensor x;
  if (p.uint8_input) {
    // (x - mean) / std in the parameters' dtype, as the reference model does
    // it, with the statistics broadcast over the channels: each step one
    // pass over the whole tensor in its layout, where per-channel views of a
    // channels-last tensor are strided (fp32 at B = 256 from uint8: 5.68 ms
    // per channel, 5.44 ms broadcast, 5.20 ms from float). The statistics
    // are filled in place on the device, each rounded from double to the
    // dtype as the reference's buffers are: a copy from host memory would
    // stall the host and is refused while a CUDA graph is being captured.
    // The subtraction reads the uint8 pixels directly (type promotion
    // converts them exactly, as the reference's separate conversion does):
    // on CUDA its kernel converts each pixel as it reads it, a pass fewer; on
    // the CPU ATen converts first, as before.
    const at::Tensor both = at::empty({2, p.C}, images.options().dtype(p.dtype));
    for (int64_t c = 0; c < p.C; ++c) {
      both[0][c].fill_(p.mean[c]);
      both[1][c].fill_(p.std[c]);
    }
    x = (images - both[0].view({1, p.C, 1, 1})).div_(both[1].view({1, p.C, 1, 1}));
  } else {
    x = images.to(p.dtype);
  }
  if (p.Hp != p.H || p.Wp != p.W) {
    // Zero padding after normalization: padded pixels are 0, not `mean`.
    x = at::constant_pad_nd(x, {0, p.Wp - p.W, 0, p.Hp - p.H});
  }
  return dense(x, p.layout);
}

at::Tensor apply_stage_norm(const at::Tensor& x, const TokenizeStage& stage, const TokenizeProblem& p) {
  switch (p.stage_norm) {
    case StageNorm::NONE: return x;
    case StageNorm::AFFINE:
      return x * stage.norm_weight.view({1, -1, 1, 1}) + stage.norm_bias.view({1, -1, 1, 1});
    case StageNorm::LAYERNORM:
      return at::layer_norm(x.permute({0, 2, 3, 1}), {stage.out_channels}, stage.norm_weight,
                            stage.norm_bias, p.eps)
          .permute({0, 3, 1, 2});
  }
  return x;
}

DepthwiseProblem stage_depthwise_problem(const TokenizeProblem& p, size_t stage, Layout layout) {
  DepthwiseProblem dw;
  dw.N = p.N;
  dw.C = p.stages[stage].in_channels;
  dw.H = stage == 0 ? p.Hp : p.stages[stage - 1].out_h;
  dw.W = stage == 0 ? p.Wp : p.stages[stage - 1].out_w;
  dw.K = p.K;
  dw.stride = p.stages[stage].stride;
  dw.pad = p.K / 2;
  dw.Ho = p.stages[stage].out_h;
  dw.Wo = p.stages[stage].out_w;
  dw.layout = layout;
  return dw;
}

at::Tensor dense(const at::Tensor& x, Layout layout) {
  return x.contiguous(layout == Layout::NHWC ? at::MemoryFormat::ChannelsLast
                                             : at::MemoryFormat::Contiguous);
}

namespace {

// cuDNN's / oneDNN's depthwise convolution: faster than LumenBridge's NHWC
// kernels on the tokenizer's stages (benchmarks/RESULTS.md), so channels-last
// problems compose with it.
at::Tensor aten_depthwise(const at::Tensor& input, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias, const DepthwiseProblem& p) {
  return at::conv2d(input, weight, bias, {p.stride, p.stride}, {p.pad, p.pad}, {1, 1}, p.C);
}

}  // namespace

std::vector<int64_t> TokenizeProblem::output_sizes() const {
  switch (format) {
    case TokenFormat::NLC: return {N, grid_h() * grid_w(), embed_dim()};
    case TokenFormat::NHWC: return {N, grid_h(), grid_w(), embed_dim()};
    case TokenFormat::NCHW: return {N, embed_dim(), grid_h(), grid_w()};
  }
  return {};
}

namespace {

// The last stage's normed output [N, D, h, w], stage by stage.
at::Tensor last_stage_output(const at::Tensor& images, const TokenizeProblem& p, DepthwiseEntry depthwise) {
  at::Tensor x = normalized_images(images, p);
  for (size_t i = 0; i < p.stages.size(); ++i) {
    const TokenizeStage& stage = p.stages[i];
    const DepthwiseEntry run = p.layout == Layout::NHWC ? &aten_depthwise : depthwise;
    x = run(dense(x, p.layout), stage.dw_weight, stage.dw_bias, stage_depthwise_problem(p, i, p.layout));
    x = apply_stage_norm(at::conv2d(x, stage.pw_weight, stage.pw_bias), stage, p);
    if (i + 1 < p.stages.size()) activate_(x, p.activation);  // x is this loop's own intermediate
  }
  return x;
}

// tokens_from written into `out` (contiguous, of p.output_sizes()).
void write_tokens(const at::Tensor& last, const TokenizeProblem& p, const at::Tensor& out) {
  at::Tensor tokens = last.permute({0, 2, 3, 1});  // [N, h, w, D]
  if (p.has_token_norm()) {
    tokens = at::layer_norm(tokens, {p.embed_dim()}, p.token_norm_weight, p.token_norm_bias, p.eps);
  }
  switch (p.format) {
    case TokenFormat::NLC: out.copy_(tokens.reshape({p.N, p.grid_h() * p.grid_w(), p.embed_dim()})); break;
    case TokenFormat::NHWC: out.copy_(tokens); break;
    case TokenFormat::NCHW: out.copy_(tokens.permute({0, 3, 1, 2})); break;
  }
}

}  // namespace

at::Tensor tokenize_composed(const at::Tensor& images, const TokenizeProblem& p,
                             DepthwiseEntry depthwise) {
  return tokens_from(last_stage_output(images, p, depthwise), p);
}

at::Tensor tokens_from(const at::Tensor& last, const TokenizeProblem& p) {
  at::Tensor out = new_output(p.output_sizes(), last.options(), at::MemoryFormat::Contiguous);
  write_tokens(last, p, out);
  return out;
}

namespace cpu {
namespace {

// The most bytes of one activation a chunk of images may take (a chunk holds
// one image at least). Run whole, a batch's larger activations are blocks
// that the C library maps afresh on each call (above 32 MB) and faults in
// page by page, which cost as much as the arithmetic on this project's CPU;
// a chunk's are a few MB, and the batch took 35-60% less time in chunks
// (benchmarks/NOTES.md, fifty-eighth session).
constexpr int64_t kChunkBytes = int64_t{8} << 20;

int64_t images_per_chunk(const TokenizeProblem& p) {
  int64_t largest = p.C * p.Hp * p.Wp;
  for (const TokenizeStage& stage : p.stages) {
    largest = std::max(largest, std::max(stage.in_channels, stage.out_channels) * stage.out_h * stage.out_w);
  }
  return std::max<int64_t>(1, kChunkBytes / (largest * static_cast<int64_t>(at::elementSize(p.dtype))));
}

// The chunk of at most `largest` images whose chunks, dealt out whole and in
// order to `threads` threads (as at::parallel_for does), leave the fewest
// images on the busiest thread; of those, the largest.
int64_t balanced_chunk(int64_t images, int64_t largest, int64_t threads) {
  int64_t best = largest, fewest = std::numeric_limits<int64_t>::max();
  for (int64_t chunk = largest; chunk >= 1; --chunk) {
    const int64_t busiest = at::divup(at::divup(images, chunk), threads) * chunk;
    if (busiest < fewest) {
      best = chunk;
      fewest = busiest;
    }
  }
  return best;
}

}  // namespace

// Every layout runs channels-last, on ATen's (oneDNN's) depthwise and 1x1
// convolutions: from NCHW images too, that took 25-45% less time than
// LumenBridge's NCHW kernels and batched GEMMs (benchmarks/NOTES.md,
// fifty-eighth session). Each image's tokens depend on that image alone, so
// the batch runs in chunks, each chunk's tokens written into its rows of the
// output.
at::Tensor tokenize(const at::Tensor& images, const TokenizeProblem& problem) {
  TokenizeProblem p = problem;
  p.layout = Layout::NHWC;
  int64_t chunk = images_per_chunk(p);
  if (chunk >= p.N) return tokenize_composed(images, p, &aten_depthwise);
  const at::Tensor out =
      new_output(p.output_sizes(), images.options().dtype(p.dtype), at::MemoryFormat::Contiguous);
  const int64_t threads = at::get_num_threads();
  const bool across_threads = at::divup(p.N, chunk) >= threads;
  if (across_threads) chunk = balanced_chunk(p.N, chunk, threads);
  const int64_t chunks = at::divup(p.N, chunk);
  const at::ThreadLocalState state;  // inference mode, grad mode: for the pool's threads as for this one
  const auto run = [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    // A pool thread's first chunk can see one thread where this one sees
    // `threads` (ATen sets a pool thread's count lazily), and oneDNN's
    // convolutions block their sums by that count: its images' tokens would
    // differ by rounding from the same images' on any later call. So it
    // takes this thread's count first.
    if (at::get_num_threads() != threads) at::set_num_threads(static_cast<int>(threads));
    for (int64_t c = begin; c < end; ++c) {
      TokenizeProblem part = p;
      const int64_t start = c * chunk;
      part.N = std::min(chunk, p.N - start);
      write_tokens(last_stage_output(images.narrow(0, start, part.N), part, &aten_depthwise), part,
                   out.narrow(0, start, part.N));
    }
  };
  // Whole chunks a thread where every thread gets one; with fewer, each op spreads over the threads.
  if (across_threads) {
    at::parallel_for(0, chunks, 1, run);
  } else {
    run(0, chunks);
  }
  return out;
}

}  // namespace cpu

}  // namespace lumenbridge

// CPU kernels for the depthwise convolution, reading NCHW and NHWC natively.
//
// NCHW: one task per output (or input) row of one (n, c) plane; each tap adds
// a strided row segment into a row of opmath accumulators, so the innermost
// loop is a plain axpy along x.
// NHWC: one task per image row; each pixel accumulates its valid taps with the
// innermost loop running over contiguous channels.
// The gateway has validated every argument; nothing is re-checked here.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../gateway.h"

namespace lumenbridge::cpu {
namespace {

// Multiply-adds a parallel_for chunk should hold at least, so that small
// problems are not split across threads.
constexpr int64_t kMinTaskWork = 32768;

int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kMinTaskWork / std::max<int64_t>(1, work_per_item));
}

// Half-open range [lo, hi) of positions o in [0, n_out) whose source position
// o * s + off lies in [0, n_in). Used both for output columns of one tap and,
// with s = 1, for the taps of one output pixel; hi <= lo means empty.
struct Range {
  int64_t lo, hi;
};

Range valid_range(int64_t off, int64_t s, int64_t n_out, int64_t n_in) {
  const int64_t lo = off < 0 ? (-off + s - 1) / s : 0;
  const int64_t last = n_in - 1 - off;
  return {lo, last < 0 ? 0 : std::min(n_out, last / s + 1)};
}

// Calls f with the stride as a compile-time constant, so that the row loops
// below have a constant step and vectorize.
template <typename F>
void with_stride(int64_t stride, F&& f) {
  if (stride == 1) {
    f(std::integral_constant<int64_t, 1>{});
  } else {
    f(std::integral_constant<int64_t, 2>{});
  }
}

constexpr int64_t kMaxTaps = 7 * 7;
// Accumulators a register block holds: enough independent chains to hide
// the add latency, few enough to stay in registers.
constexpr int64_t kLanes = 16;
constexpr int64_t kNarrowLanes = 4;

// The taps feeding one NCHW row: lane l (an output column) adds
// w[k] * src[off[k] + l * SS] when its column l * SS + dx[k] is inside the row.
template <typename acc_t>
struct RowTaps {
  int64_t count = 0, dx_min = 0, dx_max = 0;
  acc_t w[kMaxTaps];
  int64_t off[kMaxTaps], dx[kMaxTaps];
  void add(acc_t weight, int64_t offset, int64_t column_offset) {
    w[count] = weight;
    off[count] = offset;
    dx[count++] = column_offset;
    dx_min = std::min(dx_min, column_offset);
    dx_max = std::max(dx_max, column_offset);
  }
};

// Lanes [lo, hi) (hi - lo >= L), whose taps all read inside the row, in
// register blocks of L lanes. The last block is shifted back to end at hi;
// the lanes it recomputes get the same values, cheaper than a scalar tail.
template <int64_t L, int64_t SS, int64_t DS, typename scalar_t, typename acc_t>
void conv_row_interior(scalar_t* dst, int64_t lo, int64_t hi, acc_t init, const scalar_t* src,
                       const RowTaps<acc_t>& t) {
  for (int64_t l0 = lo; l0 < hi; l0 += L) {
    const int64_t b = std::min(l0, hi - L);
    acc_t a[L];
    std::fill(a, a + L, init);
    for (int64_t k = 0; k < t.count; ++k) {
      const acc_t w = t.w[k];
      const scalar_t* s = src + (t.off[k] + b * SS);
      for (int64_t v = 0; v < L; ++v) a[v] += w * static_cast<acc_t>(s[v * SS]);
    }
    for (int64_t v = 0; v < L; ++v) dst[(b + v) * DS] = static_cast<scalar_t>(a[v]);
  }
}

// dst[l * DS] = init + the taps of lane l, for l in [0, lanes). Only the few
// border lanes, whose taps may fall into the padding, test each tap.
template <int64_t SS, int64_t DS, typename scalar_t, typename acc_t>
void conv_row(scalar_t* dst, int64_t lanes, acc_t init, const scalar_t* src, int64_t src_w,
              const RowTaps<acc_t>& t) {
  int64_t lo = valid_range(t.dx_min, SS, lanes, src_w).lo;
  int64_t hi = valid_range(t.dx_max, SS, lanes, src_w).hi;
  if (hi - lo >= kLanes) {
    conv_row_interior<kLanes, SS, DS>(dst, lo, hi, init, src, t);
  } else if (hi - lo >= kNarrowLanes) {  // narrow rows (small feature maps)
    conv_row_interior<kNarrowLanes, SS, DS>(dst, lo, hi, init, src, t);
  } else {
    lo = hi = lanes;
  }
  const auto checked_lane = [&](int64_t l) {
    acc_t a = init;
    for (int64_t k = 0; k < t.count; ++k) {
      const int64_t x = l * SS + t.dx[k];
      if (x >= 0 && x < src_w) a += t.w[k] * static_cast<acc_t>(src[t.off[k] + l * SS]);
    }
    dst[l * DS] = static_cast<scalar_t>(a);
  };
  for (int64_t l = 0; l < lo; ++l) checked_lane(l);
  for (int64_t l = hi; l < lanes; ++l) checked_lane(l);
}

// The taps feeding one NHWC pixel: channel c adds w[k][c] * src[k][c].
template <typename scalar_t, typename acc_t>
struct PixelTaps {
  int64_t count = 0;
  const acc_t* w[kMaxTaps];
  const scalar_t* src[kMaxTaps];
  void add(const acc_t* weights, const scalar_t* source) {
    w[count] = weights;
    src[count++] = source;
  }
};

template <int64_t L, typename scalar_t, typename acc_t>
void conv_pixel_block(scalar_t* dst, const acc_t* init, const PixelTaps<scalar_t, acc_t>& t,
                      int64_t c0) {
  acc_t a[L];
  for (int64_t v = 0; v < L; ++v) a[v] = init[c0 + v];
  for (int64_t k = 0; k < t.count; ++k) {
    const acc_t* w = t.w[k] + c0;
    const scalar_t* s = t.src[k] + c0;
    for (int64_t v = 0; v < L; ++v) a[v] += w[v] * static_cast<acc_t>(s[v]);
  }
  for (int64_t v = 0; v < L; ++v) dst[c0 + v] = static_cast<scalar_t>(a[v]);
}

// dst[c] = init[c] + the taps of channel c, kLanes channels at a time.
template <typename scalar_t, typename acc_t>
void conv_pixel(scalar_t* dst, const acc_t* init, const PixelTaps<scalar_t, acc_t>& t, int64_t C) {
  if (C < kLanes) {
    for (int64_t c = 0; c < C; ++c) conv_pixel_block<1>(dst, init, t, c);
    return;
  }
  // As in conv_row, the last block overlaps the previous one instead of a tail.
  for (int64_t c0 = 0; c0 < C; c0 += kLanes) {
    conv_pixel_block<kLanes>(dst, init, t, std::min(c0, C - kLanes));
  }
}

// acc[o] += g[o] * src[o * S + off]: per-column partial products of one tap's
// weight gradient, summed over x only at the end (keeps the loop vectorizable).
template <int64_t S, typename acc_t, typename src_t>
void row_products(acc_t* __restrict acc, const src_t* __restrict g, const src_t* __restrict src,
                  Range r, int64_t off) {
  for (int64_t o = r.lo; o < r.hi; ++o) {
    acc[o] += static_cast<acc_t>(g[o]) * static_cast<acc_t>(src[o * S + off]);
  }
}

// acc[c] += a[c] * b[c] over contiguous channels (NHWC weight gradient).
template <typename acc_t, typename src_t>
void channel_products(acc_t* __restrict acc, const src_t* __restrict a,
                      const src_t* __restrict b, int64_t n) {
  for (int64_t c = 0; c < n; ++c) acc[c] += static_cast<acc_t>(a[c]) * static_cast<acc_t>(b[c]);
}

// Weight [C, 1, K, K] as opmath [K*K][C], so NHWC loops read one tap's
// weights for all channels contiguously.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
std::vector<acc_t> taps_by_channel(const scalar_t* w, const DepthwiseProblem& p) {
  const int64_t KK = p.K * p.K;
  std::vector<acc_t> wt(KK * p.C);
  for (int64_t c = 0; c < p.C; ++c) {
    for (int64_t t = 0; t < KK; ++t) wt[t * p.C + c] = static_cast<acc_t>(w[c * KK + t]);
  }
  return wt;
}

template <typename scalar_t, int64_t S>
void forward_nchw(const scalar_t* in, const scalar_t* w, const scalar_t* bias, scalar_t* out,
                  const DepthwiseProblem& p) {
  using acc_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, p.N * p.C * p.Ho, grain_for(p.Wo * p.K * p.K), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t plane = row / p.Ho, y = row % p.Ho, c = plane % p.C;
      RowTaps<acc_t> taps;
      const Range taps_i = valid_range(y * S - p.pad, 1, p.K, p.H);
      for (int64_t i = taps_i.lo; i < taps_i.hi; ++i) {
        for (int64_t j = 0; j < p.K; ++j) {
          taps.add(static_cast<acc_t>(w[(c * p.K + i) * p.K + j]),
                   (y * S + i - p.pad) * p.W + j - p.pad, j - p.pad);
        }
      }
      conv_row<S, 1>(out + row * p.Wo, p.Wo, bias ? static_cast<acc_t>(bias[c]) : acc_t(0),
                     in + plane * p.H * p.W, p.W, taps);
    }
  });
}

template <typename scalar_t>
void forward_nhwc(const scalar_t* in, const scalar_t* w, const scalar_t* bias, scalar_t* out,
                  const DepthwiseProblem& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const std::vector<acc_t> wt = taps_by_channel(w, p);
  std::vector<acc_t> init(p.C, acc_t(0));
  if (bias) std::copy(bias, bias + p.C, init.begin());
  const int64_t C = p.C, s = p.stride;
  at::parallel_for(0, p.N * p.Ho, grain_for(p.Wo * C * p.K * p.K), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n = row / p.Ho, y = row % p.Ho;
      const Range taps_i = valid_range(y * s - p.pad, 1, p.K, p.H);
      for (int64_t x = 0; x < p.Wo; ++x) {
        const Range taps_j = valid_range(x * s - p.pad, 1, p.K, p.W);
        PixelTaps<scalar_t, acc_t> taps;
        for (int64_t i = taps_i.lo; i < taps_i.hi; ++i) {
          for (int64_t j = taps_j.lo; j < taps_j.hi; ++j) {
            taps.add(wt.data() + (i * p.K + j) * C,
                     in + ((n * p.H + y * s + i - p.pad) * p.W + x * s + j - p.pad) * C);
          }
        }
        conv_pixel(out + (row * p.Wo + x) * C, init.data(), taps, C);
      }
    }
  });
}

// grad_input gathers: input (q, ix) meets output (y, x) through tap (i, j)
// when y * S + i - pad == q and x * S + j - pad == ix. For S == 2 the input
// columns of one parity r share their taps, so each parity is one conv_row
// whose lanes are written S apart.
template <typename scalar_t, int64_t S>
void backward_input_nchw(const scalar_t* go, const scalar_t* w, scalar_t* gi,
                         const DepthwiseProblem& p) {
  using acc_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, p.N * p.C * p.H, grain_for(p.W * p.K * p.K / (S * S)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t plane = row / p.H, q = row % p.H, c = plane % p.C;
      for (int64_t r = 0; r < S; ++r) {
        RowTaps<acc_t> taps;
        for (int64_t i = 0; i < p.K; ++i) {
          const int64_t ty = q + p.pad - i;
          if (ty < 0 || ty % S != 0 || ty / S >= p.Ho) continue;
          for (int64_t j = 0; j < p.K; ++j) {
            const int64_t tx = r + p.pad - j;
            if (tx % S != 0) continue;
            taps.add(static_cast<acc_t>(w[(c * p.K + i) * p.K + j]), ty / S * p.Wo + tx / S, tx / S);
          }
        }
        conv_row<1, S>(gi + row * p.W + r, (p.W - r + S - 1) / S, acc_t(0),
                       go + plane * p.Ho * p.Wo, p.Wo, taps);
      }
    }
  });
}

template <typename scalar_t>
void backward_input_nhwc(const scalar_t* go, const scalar_t* w, scalar_t* gi,
                         const DepthwiseProblem& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const std::vector<acc_t> wt = taps_by_channel(w, p);
  const std::vector<acc_t> zeros(p.C, acc_t(0));
  const int64_t C = p.C, s = p.stride;
  at::parallel_for(0, p.N * p.H, grain_for(p.W * C * p.K * p.K / (s * s)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n = row / p.H, q = row % p.H;
      for (int64_t ix = 0; ix < p.W; ++ix) {
        PixelTaps<scalar_t, acc_t> taps;
        for (int64_t i = 0; i < p.K; ++i) {
          const int64_t ty = q + p.pad - i;
          if (ty < 0 || ty % s != 0 || ty / s >= p.Ho) continue;
          for (int64_t j = 0; j < p.K; ++j) {
            const int64_t tx = ix + p.pad - j;
            if (tx < 0 || tx % s != 0 || tx / s >= p.Wo) continue;
            taps.add(wt.data() + (i * p.K + j) * C,
                     go + ((n * p.Ho + ty / s) * p.Wo + tx / s) * C);
          }
        }
        conv_pixel(gi + (row * p.W + ix) * C, zeros.data(), taps, C);
      }
    }
  });
}

// One task per channel, reducing over (n, y) into per-column partials and
// then over x, always in the same order: bitwise deterministic whatever the
// thread count.
template <typename scalar_t, int64_t S>
void backward_weight_nchw(const scalar_t* go, const scalar_t* in, scalar_t* gw, scalar_t* gb,
                          const DepthwiseProblem& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t KK = p.K * p.K, Wo = p.Wo;
  at::parallel_for(0, p.C, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> part((KK + 1) * Wo);  // KK tap rows, then the bias row
    acc_t* part_bias = part.data() + KK * Wo;
    for (int64_t c = begin; c < end; ++c) {
      std::fill(part.begin(), part.end(), acc_t(0));
      for (int64_t n = 0; n < p.N; ++n) {
        const int64_t plane = n * p.C + c;
        for (int64_t y = 0; y < p.Ho; ++y) {
          const scalar_t* go_row = go + (plane * p.Ho + y) * Wo;
          for (int64_t x = 0; x < Wo; ++x) part_bias[x] += static_cast<acc_t>(go_row[x]);
          const Range taps_i = valid_range(y * S - p.pad, 1, p.K, p.H);
          for (int64_t i = taps_i.lo; i < taps_i.hi; ++i) {
            const scalar_t* in_row = in + (plane * p.H + y * S + i - p.pad) * p.W;
            for (int64_t j = 0; j < p.K; ++j) {
              const int64_t off = j - p.pad;
              row_products<S>(part.data() + (i * p.K + j) * Wo, go_row, in_row,
                              valid_range(off, S, Wo, p.W), off);
            }
          }
        }
      }
      for (int64_t t = 0; t <= KK; ++t) {
        acc_t sum = 0;
        for (int64_t x = 0; x < Wo; ++x) sum += part[t * Wo + x];
        if (t < KK) {
          gw[c * KK + t] = static_cast<scalar_t>(sum);
        } else {
          gb[c] = static_cast<scalar_t>(sum);
        }
      }
    }
  });
}

// One task per block of channels; each channel is reduced per image row, then
// over rows, in an order that depends on neither the block size nor the
// threads: bitwise deterministic.
template <typename scalar_t>
void backward_weight_nhwc(const scalar_t* go, const scalar_t* in, scalar_t* gw, scalar_t* gb,
                          const DepthwiseProblem& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t KK = p.K * p.K, C = p.C, s = p.stride;
  // Blocks of at most 64 channels, balanced (e.g. 96 -> 2 x 48).
  const int64_t num_blocks = (C + 63) / 64;
  const int64_t block = (C + num_blocks - 1) / num_blocks;
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> total((KK + 1) * block), row_acc((KK + 1) * block);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t c0 = b * block, nc = std::min(block, C - c0);
      std::fill(total.begin(), total.end(), acc_t(0));
      for (int64_t n = 0; n < p.N; ++n) {
        for (int64_t y = 0; y < p.Ho; ++y) {
          std::fill(row_acc.begin(), row_acc.end(), acc_t(0));
          const Range taps_i = valid_range(y * s - p.pad, 1, p.K, p.H);
          for (int64_t x = 0; x < p.Wo; ++x) {
            const Range taps_j = valid_range(x * s - p.pad, 1, p.K, p.W);
            const scalar_t* go_px = go + ((n * p.Ho + y) * p.Wo + x) * C + c0;
            acc_t* row_bias = row_acc.data() + KK * nc;
            for (int64_t c = 0; c < nc; ++c) row_bias[c] += static_cast<acc_t>(go_px[c]);
            for (int64_t i = taps_i.lo; i < taps_i.hi; ++i) {
              const int64_t iy = y * s + i - p.pad;
              for (int64_t j = taps_j.lo; j < taps_j.hi; ++j) {
                const int64_t ix = x * s + j - p.pad;
                channel_products(row_acc.data() + (i * p.K + j) * nc, go_px,
                                 in + ((n * p.H + iy) * p.W + ix) * C + c0, nc);
              }
            }
          }
          for (int64_t k = 0; k < (KK + 1) * nc; ++k) total[k] += row_acc[k];
        }
      }
      for (int64_t c = 0; c < nc; ++c) {
        for (int64_t t = 0; t < KK; ++t) gw[(c0 + c) * KK + t] = static_cast<scalar_t>(total[t * nc + c]);
        gb[c0 + c] = static_cast<scalar_t>(total[KK * nc + c]);
      }
    }
  });
}

}  // namespace

at::Tensor depthwise_forward(const at::Tensor& input, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, const DepthwiseProblem& p) {
  at::Tensor out = new_output({p.N, p.C, p.Ho, p.Wo}, input.options(), p.memory_format());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, input.scalar_type(),
                                  "lumenbridge_depthwise_forward_cpu", [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    const scalar_t* b = bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    if (p.layout == Layout::NHWC) {
      forward_nhwc(in, w, b, o, p);
    } else {
      with_stride(p.stride, [&](auto S) { forward_nchw<scalar_t, S>(in, w, b, o, p); });
    }
  });
  return out;
}

at::Tensor depthwise_backward_input(const at::Tensor& grad_output, const at::Tensor& weight,
                                    const DepthwiseProblem& p) {
  at::Tensor gi = new_output({p.N, p.C, p.H, p.W}, grad_output.options(), p.memory_format());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16,
                                  grad_output.scalar_type(), "lumenbridge_depthwise_backward_input_cpu", [&] {
    const scalar_t* go = grad_output.const_data_ptr<scalar_t>();
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    scalar_t* g = gi.mutable_data_ptr<scalar_t>();
    if (p.layout == Layout::NHWC) {
      backward_input_nhwc(go, w, g, p);
    } else {
      with_stride(p.stride, [&](auto S) { backward_input_nchw<scalar_t, S>(go, w, g, p); });
    }
  });
  return gi;
}

std::tuple<at::Tensor, at::Tensor> depthwise_backward_weight(const at::Tensor& grad_output,
                                                             const at::Tensor& input,
                                                             const DepthwiseProblem& p) {
  // The weight is always contiguous [C, 1, K, K], whatever the activation layout.
  at::Tensor gw = new_output({p.C, 1, p.K, p.K}, input.options(), at::MemoryFormat::Contiguous);
  at::Tensor gb = new_output({p.C}, input.options(), at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, input.scalar_type(),
                                  "lumenbridge_depthwise_backward_weight_cpu", [&] {
    const scalar_t* go = grad_output.const_data_ptr<scalar_t>();
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    scalar_t* w = gw.mutable_data_ptr<scalar_t>();
    scalar_t* b = gb.mutable_data_ptr<scalar_t>();
    if (p.layout == Layout::NHWC) {
      backward_weight_nhwc(go, in, w, b, p);
    } else {
      with_stride(p.stride, [&](auto S) { backward_weight_nchw<scalar_t, S>(go, in, w, b, p); });
    }
  });
  return {gw, gb};
}

}  // namespace lumenbridge::cpu

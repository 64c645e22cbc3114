// CPU kernels for the depthwise convolution, reading NCHW and NHWC natively.
//
// Every kernel accumulates in registers over a block of "lanes" that share
// their taps: consecutive output columns for NCHW, consecutive channels for
// NHWC. The lane loops have a fixed width and no branches, so they
// vectorize. NCHW kernels read a zero-padded opmath copy of the rows they
// need, which removes all border tests; NHWC kernels skip the taps that fall
// into the padding per pixel. The gateway has validated every argument.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../activated_depthwise.h"
#include "../gateway.h"
#include "../kernel_sizes.h"

namespace lumenbridge::cpu {
namespace {

constexpr int64_t kMaxTaps = kMaxKernelSize * kMaxKernelSize;
// Lanes per register block: enough independent add chains to hide their
// latency, few enough to stay in registers. Narrow blocks take what is left
// of a row in the NCHW weight gradient.
constexpr int64_t kLanes = 16;
constexpr int64_t kNarrowLanes = 4;
// Multiply-adds a parallel_for chunk should hold at least, so that small
// problems are not split across threads.
constexpr int64_t kMinTaskWork = 32768;

int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kMinTaskWork / std::max<int64_t>(1, work_per_item));
}

template <int64_t V>
using Int = std::integral_constant<int64_t, V>;

// Calls f with the stride as a compile-time constant, for the NCHW index math.
template <typename F>
void with_stride(int64_t stride, F&& f) {
  if (stride == 1) {
    f(Int<1>{});
  } else {
    f(Int<2>{});
  }
}

// Half-open range [lo, hi) of positions o in [0, n_out) whose source position
// o * s + off lies in [0, n_in); hi <= lo means empty.
struct Range {
  int64_t lo, hi;
};

Range valid_range(int64_t off, int64_t s, int64_t n_out, int64_t n_in) {
  const int64_t lo = off < 0 ? (-off + s - 1) / s : 0;
  const int64_t last = n_in - 1 - off;
  return {lo, last < 0 ? 0 : std::min(n_out, last / s + 1)};
}

// Covers lanes [0, n) with blocks of kLanes, the last one shifted back to end
// at n: the lanes it computes twice get identical values, which beats a
// scalar tail. Single lanes when n < kLanes. Depends on n only, never on the
// thread count.
struct LaneBlocks {
  int64_t n;
  int64_t count() const { return n < kLanes ? n : (n + kLanes - 1) / kLanes; }
  // Calls f(Int<width>{}, first lane) for block b.
  template <typename F>
  void run(int64_t b, F&& f) const {
    if (n < kLanes) {
      f(Int<1>{}, b);
    } else {
      f(Int<kLanes>{}, std::min(b * kLanes, n - kLanes));
    }
  }
};

// NCHW kernels first copy the source rows a task reads into a padded buffer:
// opmath values, `pad` zero columns on both sides, zero rows outside the
// plane, zero slack at the end. Register blocks then read it without border
// tests, and lanes past the row end just compute values nobody stores. For
// stride 2 a padded row holds its even columns, then its odd ones, so the
// lanes of a block (outputs x, x + 1, ... reading columns 2x + j) read
// consecutive values.
constexpr int64_t kRowsPerTask = 16;
constexpr int64_t kSlack = kLanes + kMaxKernelSize;

// Padded row length: room for the padded columns, divisible by the stride.
int64_t padded_pitch(int64_t width, int64_t pad, int64_t stride) {
  return (width + 2 * pad + stride - 1) / stride * stride;
}

// Source rows [first_row, first_row + rows) of a plane [height, width].
template <int64_t S, typename scalar_t, typename acc_t>
void copy_padded_rows(std::vector<acc_t>& buf, const scalar_t* plane, int64_t height,
                      int64_t width, int64_t first_row, int64_t rows, int64_t pad, int64_t pitch) {
  const int64_t phase_len = pitch / S;
  buf.assign(rows * pitch + kSlack, acc_t(0));
  for (int64_t i = std::max<int64_t>(0, -first_row); i < std::min(rows, height - first_row); ++i) {
    const scalar_t* src = plane + (first_row + i) * width;
    for (int64_t phase = 0; phase < S; ++phase) {
      // Padded column m * S + phase is source column m * S + phase - pad.
      acc_t* dst = buf.data() + i * pitch + phase * phase_len;
      const Range m = valid_range(phase - pad, S, phase_len, width);
      for (int64_t k = m.lo; k < m.hi; ++k) dst[k] = static_cast<acc_t>(src[k * S + phase - pad]);
    }
  }
}

// The taps of one NCHW output: weight w[k] reads the padded buffer at
// off[k] from the output's own position.
template <typename acc_t>
struct PlaneTaps {
  int64_t count = 0;
  acc_t w[kMaxTaps];
  int64_t off[kMaxTaps];
  void add(acc_t weight, int64_t offset) {
    w[count] = weight;
    off[count++] = offset;
  }
};

// dst[r * dst_row + x * dst_col] = init + sum_k w[k] * src[r * src_row + x + off[k]]
// for r < rows, x < cols, in register blocks of kLanes consecutive x.
template <typename scalar_t, typename acc_t>
void conv_rows(scalar_t* dst, int64_t dst_row, int64_t dst_col, int64_t rows, int64_t cols,
               acc_t init, const acc_t* src, int64_t src_row, const PlaneTaps<acc_t>& t) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t x0 = 0; x0 < cols; x0 += kLanes) {
      acc_t a[kLanes];
      std::fill(a, a + kLanes, init);
      const acc_t* s0 = src + r * src_row + x0;
      for (int64_t k = 0; k < t.count; ++k) {
        const acc_t w = t.w[k];
        const acc_t* s = s0 + t.off[k];
        for (int64_t v = 0; v < kLanes; ++v) a[v] += w * s[v];
      }
      scalar_t* d = dst + r * dst_row + x0 * dst_col;
      for (int64_t v = 0; v < std::min(kLanes, cols - x0); ++v) {
        d[v * dst_col] = static_cast<scalar_t>(a[v]);
      }
    }
  }
}

// The taps of one NHWC pixel: channel c adds w[k][c] * src[k][c].
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

// dst[c] = init[c] + the taps of channel c, for c in [0, C).
template <typename scalar_t, typename acc_t>
void conv_pixel(scalar_t* dst, const acc_t* init, const PixelTaps<scalar_t, acc_t>& t,
                int64_t C) {
  const auto block = [&](auto L, int64_t c0) {
    acc_t a[L];
    for (int64_t v = 0; v < L; ++v) a[v] = init[c0 + v];
    for (int64_t k = 0; k < t.count; ++k) {
      const acc_t* w = t.w[k] + c0;
      const scalar_t* s = t.src[k] + c0;
      for (int64_t v = 0; v < L; ++v) a[v] += w[v] * static_cast<acc_t>(s[v]);
    }
    for (int64_t v = 0; v < L; ++v) dst[c0 + v] = static_cast<scalar_t>(a[v]);
  };
  const LaneBlocks blocks{C};
  for (int64_t b = 0; b < blocks.count(); ++b) blocks.run(b, block);
}

// One task per block of kRowsPerTask output rows of one plane. Output row r
// of the block reads padded rows r * S + i; column x + j of tap (i, j) sits
// in phase j % S at x + j / S.
template <typename scalar_t, int64_t S>
void forward_nchw(const scalar_t* in, const scalar_t* w, const scalar_t* bias, scalar_t* out,
                  const DepthwiseProblem& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t K = p.K, pitch = padded_pitch(p.W, p.pad, S);
  const int64_t blocks = (p.Ho + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t grain = grain_for(kRowsPerTask * p.Wo * K * K);
  at::parallel_for(0, p.N * p.C * blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t plane = task / blocks, c = plane % p.C;
      const int64_t y0 = task % blocks * kRowsPerTask, ny = std::min(kRowsPerTask, p.Ho - y0);
      copy_padded_rows<S>(rows, in + plane * p.H * p.W, p.H, p.W, y0 * S - p.pad,
                          (ny - 1) * S + K, p.pad, pitch);
      PlaneTaps<acc_t> taps;
      for (int64_t i = 0; i < K; ++i) {
        for (int64_t j = 0; j < K; ++j) {
          taps.add(static_cast<acc_t>(w[(c * K + i) * K + j]),
                   i * pitch + j % S * (pitch / S) + j / S);
        }
      }
      conv_rows(out + (plane * p.Ho + y0) * p.Wo, p.Wo, 1, ny, p.Wo,
                bias ? static_cast<acc_t>(bias[c]) : acc_t(0), rows.data(), S * pitch, taps);
    }
  });
}

// grad_input is gathered: input (q, ix) meets output (y, x) through tap
// (i, j) when y * S + i - pad == q and x * S + j - pad == ix. Split by the
// parities (rq, rx) of (q, ix), each part is a stride-1 correlation of
// grad_output, q = S * m + rq, with the taps of matching parity. One task per
// block of kRowsPerTask values of m of one plane.
template <typename scalar_t, int64_t S>
void backward_input_nchw(const scalar_t* go, const scalar_t* w, scalar_t* gi,
                         const DepthwiseProblem& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t K = p.K, pad = p.pad, pitch = padded_pitch(p.Wo, pad, 1);
  const int64_t sub_rows = (p.H + S - 1) / S;
  const int64_t blocks = (sub_rows + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t grain = grain_for(kRowsPerTask * p.W * K * K / S);
  at::parallel_for(0, p.N * p.C * blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t plane = task / blocks, c = plane % p.C;
      const int64_t m0 = task % blocks * kRowsPerTask, nm = std::min(kRowsPerTask, sub_rows - m0);
      // grad_output rows [m0 - pad, m0 + nm + pad): padded row r + dy + pad is row m0 + r + dy.
      copy_padded_rows<1>(rows, go + plane * p.Ho * p.Wo, p.Ho, p.Wo, m0 - pad, nm + 2 * pad, pad,
                          pitch);
      for (int64_t rq = 0; rq < S; ++rq) {
        for (int64_t rx = 0; rx < S; ++rx) {
          PlaneTaps<acc_t> taps;
          for (int64_t i = 0; i < K; ++i) {
            for (int64_t j = 0; j < K; ++j) {
              const int64_t ty = rq + pad - i, tx = rx + pad - j;  // % and / truncate toward 0
              if (ty % S != 0 || tx % S != 0) continue;
              taps.add(static_cast<acc_t>(w[(c * K + i) * K + j]),
                       (ty / S + pad) * pitch + tx / S + pad);
            }
          }
          const int64_t nr = std::min(nm, (p.H - rq + S - 1) / S - m0);
          conv_rows(gi + (plane * p.H + S * m0 + rq) * p.W + rx, S * p.W, S, nr,
                    (p.W - rx + S - 1) / S, acc_t(0), rows.data(), pitch, taps);
        }
      }
    }
  });
}

// One NHWC pass over dst [N, rows, cols, C]: pixel (q, x) gathers each tap
// (i, j) whose source pixel (source(q, i, src_rows), source(x, j, src_cols))
// exists (>= 0) in src [N, src_rows, src_cols, C]. The forward and grad_input
// differ only in `source`.
template <typename scalar_t, typename acc_t, typename Source>
void conv_nhwc(scalar_t* dst, int64_t rows, int64_t cols, const scalar_t* src, int64_t src_rows,
               int64_t src_cols, const scalar_t* w, const acc_t* init, const DepthwiseProblem& p,
               Source source) {
  const int64_t C = p.C, K = p.K;
  // Weight [C, 1, K, K] as [K*K][C], so a block reads one tap's weights for
  // consecutive channels.
  std::vector<acc_t> wt(K * K * C);
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t t = 0; t < K * K; ++t) wt[t * C + c] = static_cast<acc_t>(w[c * K * K + t]);
  }
  at::parallel_for(0, p.N * rows, grain_for(cols * C * K * K), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n = row / rows, q = row % rows;
      for (int64_t x = 0; x < cols; ++x) {
        PixelTaps<scalar_t, acc_t> taps;
        for (int64_t i = 0; i < K; ++i) {
          const int64_t sy = source(q, i, src_rows);
          if (sy < 0) continue;
          for (int64_t j = 0; j < K; ++j) {
            const int64_t sx = source(x, j, src_cols);
            if (sx < 0) continue;
            taps.add(wt.data() + (i * K + j) * C, src + ((n * src_rows + sy) * src_cols + sx) * C);
          }
        }
        conv_pixel(dst + (row * cols + x) * C, init, taps, C);
      }
    }
  });
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void forward_nhwc(const scalar_t* in, const scalar_t* w, const scalar_t* bias, scalar_t* out,
                  const DepthwiseProblem& p) {
  std::vector<acc_t> init(p.C, acc_t(0));
  if (bias) std::copy(bias, bias + p.C, init.begin());
  conv_nhwc(out, p.Ho, p.Wo, in, p.H, p.W, w, init.data(), p,
            [s = p.stride, pad = p.pad](int64_t t, int64_t k, int64_t n) {
              const int64_t u = t * s + k - pad;
              return u >= 0 && u < n ? u : int64_t{-1};
            });
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void backward_input_nhwc(const scalar_t* go, const scalar_t* w, scalar_t* gi,
                         const DepthwiseProblem& p) {
  const std::vector<acc_t> zeros(p.C, acc_t(0));
  conv_nhwc(gi, p.H, p.W, go, p.Ho, p.Wo, w, zeros.data(), p,
            [s = p.stride, pad = p.pad](int64_t t, int64_t k, int64_t n) {
              const int64_t u = t + pad - k;
              return u >= 0 && u % s == 0 && u / s < n ? u / s : int64_t{-1};
            });
}

// sum over r < rows, x < cols of g[r * cols + x] * src[r * src_row + x]:
// register partial sums in blocks of kLanes, then kNarrowLanes, then one
// lane for what is left of each row, added across at the end: a fixed order.
template <typename acc_t>
acc_t lane_sum(const acc_t* g, const acc_t* src, int64_t src_row, int64_t rows, int64_t cols) {
  acc_t wide[kLanes] = {}, narrow[kNarrowLanes] = {}, sum = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const acc_t* gr = g + r * cols;
    const acc_t* sr = src + r * src_row;
    int64_t x = 0;
    for (; x + kLanes <= cols; x += kLanes) {
      for (int64_t v = 0; v < kLanes; ++v) wide[v] += gr[x + v] * sr[x + v];
    }
    for (; x + kNarrowLanes <= cols; x += kNarrowLanes) {
      for (int64_t v = 0; v < kNarrowLanes; ++v) narrow[v] += gr[x + v] * sr[x + v];
    }
    for (; x < cols; ++x) sum += gr[x] * sr[x];
  }
  for (int64_t v = 0; v < kLanes; ++v) sum += wide[v];
  for (int64_t v = 0; v < kNarrowLanes; ++v) sum += narrow[v];
  return sum;
}

// One task per channel, so each weight gradient is reduced by one thread in
// a fixed order (bitwise deterministic whatever the thread count): per
// image and block of kRowsPerTask output rows, one lane_sum per tap.
template <typename scalar_t, int64_t S>
void backward_weight_nchw(const scalar_t* go, const scalar_t* in, scalar_t* gw, scalar_t* gb,
                          const DepthwiseProblem& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t K = p.K, KK = K * K, pitch = padded_pitch(p.W, p.pad, S);
  const std::vector<acc_t> ones(p.Wo, acc_t(1));  // the bias "input"
  at::parallel_for(0, p.C, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> rows, g, total(KK + 1);
    for (int64_t c = begin; c < end; ++c) {
      std::fill(total.begin(), total.end(), acc_t(0));
      for (int64_t n = 0; n < p.N; ++n) {
        const int64_t plane = n * p.C + c;
        for (int64_t y0 = 0; y0 < p.Ho; y0 += kRowsPerTask) {
          const int64_t ny = std::min(kRowsPerTask, p.Ho - y0);
          copy_padded_rows<S>(rows, in + plane * p.H * p.W, p.H, p.W, y0 * S - p.pad,
                              (ny - 1) * S + K, p.pad, pitch);
          copy_padded_rows<1>(g, go + plane * p.Ho * p.Wo, p.Ho, p.Wo, y0, ny, 0, p.Wo);
          for (int64_t i = 0; i < K; ++i) {
            for (int64_t j = 0; j < K; ++j) {
              const acc_t* src = rows.data() + i * pitch + j % S * (pitch / S) + j / S;
              total[i * K + j] += lane_sum(g.data(), src, S * pitch, ny, p.Wo);
            }
          }
          total[KK] += lane_sum(g.data(), ones.data(), 0, ny, p.Wo);
        }
      }
      for (int64_t t = 0; t < KK; ++t) gw[c * KK + t] = static_cast<scalar_t>(total[t]);
      gb[c] = static_cast<scalar_t>(total[KK]);
    }
  });
}

// One task per block of channels (LaneBlocks of C). Per image row and tap,
// the block's register accumulators sum over x; the row sums then join the
// totals in a fixed order, so the result is bitwise deterministic.
template <typename scalar_t>
void backward_weight_nhwc(const scalar_t* go, const scalar_t* in, scalar_t* gw, scalar_t* gb,
                          const DepthwiseProblem& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = p.C, K = p.K, KK = K * K, s = p.stride;
  const LaneBlocks blocks{C};
  at::parallel_for(0, blocks.count(), 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> total((KK + 1) * kLanes);  // [tap or bias][lane]
    for (int64_t b = begin; b < end; ++b) {
      blocks.run(b, [&](auto L, int64_t c0) {
        std::fill(total.begin(), total.end(), acc_t(0));
        for (int64_t n = 0; n < p.N; ++n) {
          for (int64_t y = 0; y < p.Ho; ++y) {
            const scalar_t* go_row = go + (n * p.Ho + y) * p.Wo * C + c0;
            acc_t a[L] = {};
            for (int64_t x = 0; x < p.Wo; ++x) {
              for (int64_t v = 0; v < L; ++v) a[v] += static_cast<acc_t>(go_row[x * C + v]);
            }
            for (int64_t v = 0; v < L; ++v) total[KK * L + v] += a[v];
            const Range taps_i = valid_range(y * s - p.pad, 1, K, p.H);
            for (int64_t i = taps_i.lo; i < taps_i.hi; ++i) {
              const int64_t in_row = (n * p.H + y * s + i - p.pad) * p.W;
              for (int64_t j = 0; j < K; ++j) {
                const Range xs = valid_range(j - p.pad, s, p.Wo, p.W);
                std::fill(a, a + L, acc_t(0));
                for (int64_t x = xs.lo; x < xs.hi; ++x) {
                  const scalar_t* g = go_row + x * C;
                  const scalar_t* src = in + (in_row + x * s + j - p.pad) * C + c0;
                  for (int64_t v = 0; v < L; ++v) {
                    a[v] += static_cast<acc_t>(g[v]) * static_cast<acc_t>(src[v]);
                  }
                }
                for (int64_t v = 0; v < L; ++v) total[(i * K + j) * L + v] += a[v];
              }
            }
          }
        }
        for (int64_t v = 0; v < L; ++v) {
          for (int64_t t = 0; t < KK; ++t) {
            gw[(c0 + v) * KK + t] = static_cast<scalar_t>(total[t * L + v]);
          }
          gb[c0 + v] = static_cast<scalar_t>(total[KK * L + v]);
        }
      });
    }
  });
}

}  // namespace

at::Tensor depthwise_forward(const at::Tensor& input, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, const DepthwiseProblem& p) {
  at::Tensor out = new_output({p.N, p.C, p.Ho, p.Wo}, input.options(), p.memory_format());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, input.scalar_type(),
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
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, grad_output.scalar_type(),
      "lumenbridge_depthwise_backward_input_cpu", [&] {
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
  // The weight is contiguous [C, 1, K, K] whatever the activation layout.
  at::Tensor gw = new_output({p.C, 1, p.K, p.K}, input.options(), at::MemoryFormat::Contiguous);
  at::Tensor gb = new_output({p.C}, input.options(), at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::Half, at::ScalarType::BFloat16, input.scalar_type(),
      "lumenbridge_depthwise_backward_weight_cpu", [&] {
        const scalar_t* go = grad_output.const_data_ptr<scalar_t>();
        const scalar_t* in = input.const_data_ptr<scalar_t>();
        scalar_t* w = gw.mutable_data_ptr<scalar_t>();
        scalar_t* b = gb.mutable_data_ptr<scalar_t>();
        if (p.layout == Layout::NHWC) {
          backward_weight_nhwc(go, in, w, b, p);
        } else {
          with_stride(p.stride,
                      [&](auto S) { backward_weight_nchw<scalar_t, S>(go, in, w, b, p); });
        }
      });
  return {gw, gb};
}

// The CPU folds nothing: the activation's ATen form runs before the kernels.
void activated_depthwise_forward_into(const at::Tensor& pre, const at::Tensor& weight, const at::Tensor& bias,
                                      const DepthwiseProblem& p, Activation activation, at::Tensor& out) {
  out.copy_(depthwise_forward(activate(pre, activation), weight, bias, p));
}

std::tuple<at::Tensor, at::Tensor> activated_depthwise_backward_weight(const at::Tensor& grad_output,
                                                                       const at::Tensor& pre,
                                                                       const DepthwiseProblem& p,
                                                                       Activation activation) {
  return depthwise_backward_weight(grad_output, activate(pre, activation), p);
}

at::Tensor activated_depthwise_backward_input(const at::Tensor& grad_output, const at::Tensor& weight,
                                              const at::Tensor& pre, const DepthwiseProblem& p,
                                              Activation activation) {
  at::Tensor grad = depthwise_backward_input(grad_output, weight, p);
  activation_backward_(grad, pre, activation);
  return grad;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> activated_depthwise_backward(const at::Tensor& grad_output,
                                                                          const at::Tensor& weight, at::Tensor pre,
                                                                          const DepthwiseProblem& p,
                                                                          Activation activation) {
  return depthwise_backward_in_two_passes(&activated_depthwise_backward_input, &activated_depthwise_backward_weight,
                                         grad_output, weight, pre, p, activation);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> activated_depthwise_backward_from_rows(
    const at::Tensor& grad_output, const at::Tensor& weight, const at::Tensor& rows, const at::Tensor& pointwise,
    const DepthwiseProblem& p, Activation activation) {
  return activated_depthwise_backward(grad_output, weight, pre_from_rows(rows, pointwise, p), p, activation);
}

}  // namespace lumenbridge::cpu

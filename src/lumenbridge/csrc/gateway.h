// The contract between the operator gateway (gateway.cpp) and the per-device
// kernels (cpu/, cuda/). The gateway validates every argument once and hands
// the kernels a DepthwiseProblem whose fields they may trust without checking.
#pragma once

#include <torch/types.h>

#include <initializer_list>
#include <limits>

namespace lumenbridge {

// Memory layouts the kernels read natively. Anything else is rejected by the
// gateway; the Python layer makes tensors dense explicitly before calling.
enum class Layout { NCHW, NHWC };

// One depthwise convolution: input [N, C, H, W] -> output [N, C, Ho, Wo],
// weight [C, 1, K, K], zero padding K / 2 on every side.
struct DepthwiseProblem {
  int64_t N, C, H, W;    // input (or grad_input) extents
  int64_t Ho, Wo;        // output (or grad_output) extents
  int64_t K, stride, pad;
  Layout layout;
  at::MemoryFormat memory_format() const {
    return layout == Layout::NHWC ? at::MemoryFormat::ChannelsLast
                                  : at::MemoryFormat::Contiguous;
  }
};

// The largest extent the kernels take: they hold channels, heights, widths
// and tile coordinates in 32-bit integers (offsets into tensors are 64-bit),
// and coordinates run a tile past an extent, so extents stop short of 2^31
// by a margin wider than any tile.
constexpr int64_t kMaxExtent = std::numeric_limits<int32_t>::max() - 65536;

// Output extent of one spatial dimension (native.py mirrors it for fake tensors).
inline int64_t depthwise_output_extent(int64_t in, int64_t K, int64_t stride) {
  return (in + 2 * (K / 2) - K) / stride + 1;
}

// Error messages are built from strings only. Numbers, shapes, dtypes and
// devices are turned into std::string here rather than streamed: a toolchain
// that links its own copy of libstdc++ into the extension crashes when a
// number is streamed into libtorch's message builder (seen on a CUDA image
// whose default g++ does this).
std::string text(int64_t value);
inline std::string text(int value) { return text(static_cast<int64_t>(value)); }
std::string text(double value);
std::string text(at::IntArrayRef values);
std::string text(at::ScalarType dtype);
std::string text(const at::Device& device);

// Forward-mode AD would pass through the kernels with its tangents dropped,
// so tensors that carry one are refused: at the ops' entries
// (torch.autograd.forward_ad's dual tensors reach them), and by the tokenize
// ops' autograd kernels, which see torch.func.jvp's tensors before functorch
// unwraps them. Where no dual level is open (the usual case) this is one
// lookup, not one per tensor.
void check_no_tangents(std::initializer_list<at::TensorList> arguments);
at::TensorList as_list(const c10::optional<at::Tensor>& t);

// Allocates a kernel output through ATen (so CUDA graphs and the caching
// allocator see it). When poisoning is on (tests only, via the op
// lumenbridge::_set_poison_outputs), floating outputs are filled with NaN
// first (integer ones with a fixed byte), so an element the kernel fails to
// write shows up.
at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options,
                      at::MemoryFormat memory_format);

// Whether `t` is the only tensor that refers to its memory, needing no
// gradient: a kernel handed it (by value, or as its caller's last use) may
// write over it. (The composed backward turns view tracking off for this:
// tokenize_backward.cpp.)
bool sole_reference(const at::Tensor& t);

// Kernel entry points. Each allocates its outputs with ATen (in the problem's
// memory format) and launches on the current stream.
//   forward:          out[n,c,y,x] = bias[c] + sum_{i,j} w[c,i,j] * in[n,c,y*s+i-p,x*s+j-p]
//   backward_input:   grad_input  [N, C, H, W]   from grad_output and weight
//   backward_weight:  (grad_weight [C, 1, K, K], grad_bias [C]) from grad_output and input;
//                     accumulated in float32 in a fixed order (bitwise deterministic).
namespace cpu {
at::Tensor depthwise_forward(const at::Tensor& input, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, const DepthwiseProblem& p);
at::Tensor depthwise_backward_input(const at::Tensor& grad_output, const at::Tensor& weight,
                                    const DepthwiseProblem& p);
std::tuple<at::Tensor, at::Tensor> depthwise_backward_weight(const at::Tensor& grad_output,
                                                             const at::Tensor& input,
                                                             const DepthwiseProblem& p);
}  // namespace cpu

namespace cuda {
at::Tensor depthwise_forward(const at::Tensor& input, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, const DepthwiseProblem& p);
at::Tensor depthwise_backward_input(const at::Tensor& grad_output, const at::Tensor& weight,
                                    const DepthwiseProblem& p);
std::tuple<at::Tensor, at::Tensor> depthwise_backward_weight(const at::Tensor& grad_output,
                                                             const at::Tensor& input,
                                                             const DepthwiseProblem& p);
}  // namespace cuda

}  // namespace lumenbridge

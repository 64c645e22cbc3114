// The depthwise kernel sizes the native kernels implement. The list itself is
// config.KERNEL_SIZES in Python, which extension.py passes to both compilers
// as LUMENBRIDGE_KERNEL_SIZE_MASK; the gateway's check, its message, the CPU
// buffers and the CUDA instantiations all derive from it here.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>

#ifndef LUMENBRIDGE_KERNEL_SIZE_MASK
#error "LUMENBRIDGE_KERNEL_SIZE_MASK is not defined: extension.py passes config.KERNEL_SIZES"
#endif

namespace lumenbridge {

namespace detail {

// The sizes arrive as a bit mask (bit K set for each K), a flag with no
// commas, which nvcc would split and the shell would need quoted.
constexpr uint64_t kKernelSizeMask = LUMENBRIDGE_KERNEL_SIZE_MASK;

constexpr size_t kernel_size_count() {
  size_t n = 0;
  for (int k = 0; k < 64; ++k) n += (kKernelSizeMask >> k) & 1;
  return n;
}

}  // namespace detail

// The list as values, in increasing order, for messages.
inline constexpr std::array<int64_t, detail::kernel_size_count()> kKernelSizes = [] {
  std::array<int64_t, detail::kernel_size_count()> sizes{};
  size_t n = 0;
  for (int k = 0; k < 64; ++k) {
    if ((detail::kKernelSizeMask >> k) & 1) sizes[n++] = k;
  }
  return sizes;
}();

namespace detail {

template <size_t... I>
constexpr auto kernel_size_sequence(std::index_sequence<I...>) {
  return std::integer_sequence<int, static_cast<int>(kKernelSizes[I])...>{};
}

}  // namespace detail

using KernelSizes = decltype(detail::kernel_size_sequence(std::make_index_sequence<kKernelSizes.size()>{}));

namespace detail {

template <int... Ks>
constexpr bool all_odd_and_positive(std::integer_sequence<int, Ks...>) {
  return ((Ks > 0 && Ks % 2 == 1) && ...);
}

template <int... Ks>
constexpr int64_t max_of(std::integer_sequence<int, Ks...>) {
  return std::max({Ks...});
}

template <int... Ks, typename Body>
bool visit(std::integer_sequence<int, Ks...>, int64_t k, Body& body) {
  return ((k == Ks && (body(std::integral_constant<int, Ks>{}), true)) || ...);
}

}  // namespace detail

// Padding K / 2 on each side keeps the output grid centred only for odd K.
static_assert(detail::all_odd_and_positive(KernelSizes{}),
              "config.KERNEL_SIZES must list odd, positive kernel sizes");

// The largest size, for fixed tap buffers.
inline constexpr int64_t kMaxKernelSize = detail::max_of(KernelSizes{});

// Calls body(std::integral_constant<int, K>{}) for the listed K equal to k, so
// the code in body sees K as a compile-time constant; false if k is not listed.
template <typename Body>
bool visit_kernel_size(int64_t k, Body&& body) {
  return detail::visit(KernelSizes{}, k, body);
}

inline bool is_supported_kernel_size(int64_t k) {
  return visit_kernel_size(k, [](auto) {});
}

}  // namespace lumenbridge

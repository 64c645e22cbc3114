// The depthwise kernel sizes the native kernels implement. The list itself is
// config.KERNEL_SIZES in Python, which extension.py passes to both compilers
// as LUMENBRIDGE_KERNEL_SIZES; the gateway's check, its message, the CPU
// buffers and the CUDA instantiations all derive from it here.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>

#ifndef LUMENBRIDGE_KERNEL_SIZES
#error "LUMENBRIDGE_KERNEL_SIZES is not defined: extension.py passes config.KERNEL_SIZES"
#endif

namespace lumenbridge {

using KernelSizes = std::integer_sequence<int, LUMENBRIDGE_KERNEL_SIZES>;

namespace detail {

template <int... Ks>
constexpr bool all_odd_and_positive(std::integer_sequence<int, Ks...>) {
  return ((Ks > 0 && Ks % 2 == 1) && ...);
}

template <int... Ks>
constexpr std::array<int64_t, sizeof...(Ks)> as_array(std::integer_sequence<int, Ks...>) {
  return {Ks...};
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
              "LUMENBRIDGE_KERNEL_SIZES must list odd, positive kernel sizes");

// The list as values, for messages; its maximum sizes fixed tap buffers.
inline constexpr auto kKernelSizes = detail::as_array(KernelSizes{});
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

// ``gemflow::shared_context_attend`` (shared_context_attend.cpp) for the other kernels of the library.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace gemflow {

// (N, H * d) queries -> (N, H * d) attention outputs over one context: keys (H, d, T) pre-scaled by log2(e) /
// sqrt(d), values (H, T, d) (``models.attention.shared_context.context_layout``). ``max_bits`` caps the SIMD width.
at::Tensor shared_context_attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                 int64_t max_bits = 512);

}  // namespace gemflow

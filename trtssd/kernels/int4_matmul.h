// A few-row int4 matmul for the draft (CPU): y = x @ W.T with W held as GGUF Q4_1 groups.
//
// Layout (trtssd.kernels.int4_matmul.Int4Weight): W[n, 32g + i] = scales[n, g] * code + mins[n, g],
// the codes of group g packed in 16 bytes as Q4_1 stores them: byte i holds element i in its
// low nibble and element i + 16 in its high nibble.
//
// Arithmetic (llama.cpp's Q4_1 x Q8_1 dot product): each row of x is quantized per 32 inputs to
// 8-bit codes with a scale of max|x| / 127; a group's dot product is then exact in integers, and
// y[t, n] = sum over g of scales[n, g] * step[t, g] * (codes . x codes) + mins[n, g] * sum(x[t, group g]).
// Only the draft uses it: every proposal is verified against the q it was drawn from, so the
// draft's rounding changes acceptance, never the output.

#pragma once

#include <torch/extension.h>

namespace trtssd {

// x [T, K] fp32 contiguous; nibbles [N, K / 2] uint8; scales, mins [N, K / 32] int16
// holding fp16 bits (a float dtype would be cast by model.to()) -> [T, N] fp32.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                       const at::Tensor& mins);

}  // namespace trtssd

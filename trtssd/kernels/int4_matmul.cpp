// The few-row int4 matmul declared in int4_matmul.h.
//
// Why not aten's int4 kernel: on this project's AVX2 CPUs it ran the draft's projections at
// ~2 GB/s of weights (bf16 activations, its only fast input type), well below what a core reads
// from memory. Here a group's 4-bit codes, widened once to 16 bits, meet 16-bit activation codes
// in AVX2 integer multiply-adds (16 products an instruction), and one unpacking of a
// group serves up to four rows of x.

#include "int4_matmul.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace trtssd {
namespace {

constexpr int64_t kGroup = 32;
constexpr int kRowBlock = 4;  // rows of x that share one unpacking of a group's codes
// Activation codes in [-32767, 32767]: a finer grid than bf16's 8-bit mantissa, and the integer
// sums stay exact (a group's dot product is at most 32 * 15 * 32767 < 2^24, exact in fp32 too).
constexpr float kLevels = 32767.f;

// x's rows as 16-bit codes per 32 inputs: x ~ step * code, and each group's float sum (for the
// weights' mins).
struct QuantizedRows {
  std::vector<int16_t> codes;  // [T, K]
  std::vector<float> step;    // [T, K / 32]
  std::vector<float> sum;     // [T, K / 32]
};

struct Int4Weight {
  const uint8_t* nibbles;  // [N, K / 2]
  const uint16_t* scales;  // [N, K / 32], fp16 bits as Q4_1 stores them: half the bytes of fp32
  const uint16_t* mins;    // [N, K / 32]
  int64_t n, k;
};

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  QuantizedRows q{std::vector<int16_t>(rows * k), std::vector<float>(rows * groups), std::vector<float>(rows * groups)};
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = x + t * k + g * kGroup;
      float amax = 0.f, sum = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) {
        amax = std::max(amax, std::fabs(v[i]));
        sum += v[i];
      }
      const float inv = amax > 0.f ? kLevels / amax : 0.f;
      int16_t* c = q.codes.data() + t * k + g * kGroup;
      for (int64_t i = 0; i < kGroup; ++i)
        c[i] = static_cast<int16_t>(std::clamp(std::nearbyint(v[i] * inv), -kLevels, kLevels));
      q.step[t * groups + g] = amax / kLevels;
      q.sum[t * groups + g] = sum;
    }
  }
  return q;
}

#if defined(__AVX2__) && defined(__FMA__)

// A group's 32 codes as 16-bit integers: elements 0..15 (low nibbles), then 16..31 (high ones).
struct GroupCodes {
  __m256i low, high;
};

inline GroupCodes unpack_group(const uint8_t* packed) {
  // Each byte widened to 16 bits: its low nibble is a mask away, its high nibble a shift.
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed)));
  return {_mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16(bytes, 4)};
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[g] = half[g] * f[g]: an output's group scales times a row's activation steps.
void scale_steps(const uint16_t* half, const float* f, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 h = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(half + i)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(h, _mm256_loadu_ps(f + i)));
  }
  for (; i < n; ++i) out[i] = _cvtsh_ss(half[i]) * f[i];
}

// sum of half[g] * f[g], in one fixed order: an output's group mins against a row's group sums.
float fp16_dot(const uint16_t* half, const float* f, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(half + i))),
                          _mm256_loadu_ps(f + i), acc);
  float total = horizontal_sum(acc);
  for (; i < n; ++i) total = std::fma(_cvtsh_ss(half[i]), f[i], total);
  return total;
}

// A tile of the output: y[t, n] for NO outputs n0.. and R rows t0.. Each group's codes are
// unpacked once for R rows, and NO outputs give independent chains of multiply-adds. Each
// (row, output) is summed in the same order whatever the tile, so a row's result does not
// depend on the rows beside it. ``scratch``: NO * R * groups floats.
template <int NO, int R>
void tile(const Int4Weight& w, const QuantizedRows& x, int64_t n0, int64_t t0, float* y, float* scratch) {
  const int64_t k = w.k, groups = k / kGroup;
  __m256 acc[NO][R];
  float from_mins[NO][R];
  for (int o = 0; o < NO; ++o)
    for (int r = 0; r < R; ++r) {
      acc[o][r] = _mm256_setzero_ps();
      scale_steps(w.scales + (n0 + o) * groups, x.step.data() + (t0 + r) * groups, groups, scratch + (o * R + r) * groups);
      from_mins[o][r] = fp16_dot(w.mins + (n0 + o) * groups, x.sum.data() + (t0 + r) * groups, groups);
    }
  for (int64_t g = 0; g < groups; ++g) {
    __m256i x_low[R], x_high[R];
    for (int r = 0; r < R; ++r) {
      const int16_t* xc = x.codes.data() + (t0 + r) * k + g * kGroup;
      x_low[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc));
      x_high[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + kGroup / 2));
    }
    for (int o = 0; o < NO; ++o) {
      const GroupCodes codes = unpack_group(w.nibbles + ((n0 + o) * groups + g) * (kGroup / 2));
      for (int r = 0; r < R; ++r) {
        // 16-bit products summed in pairs to int32, eight lanes per group.
        const __m256i dots =
            _mm256_add_epi32(_mm256_madd_epi16(codes.low, x_low[r]), _mm256_madd_epi16(codes.high, x_high[r]));
        acc[o][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_broadcast_ss(scratch + (o * R + r) * groups + g),
                                    acc[o][r]);
      }
    }
  }
  for (int o = 0; o < NO; ++o)
    for (int r = 0; r < R; ++r) y[(t0 + r) * w.n + n0 + o] = horizontal_sum(acc[o][r]) + from_mins[o][r];
}

#else

template <int NO, int R>
void tile(const Int4Weight& w, const QuantizedRows& x, int64_t n0, int64_t t0, float* y, float* /*scratch*/) {
  const int64_t k = w.k, groups = k / kGroup;
  for (int o = 0; o < NO; ++o)
    for (int r = 0; r < R; ++r) {
      const int64_t n = n0 + o, t = t0 + r;
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = n * groups + g;
        const uint8_t* packed = w.nibbles + at * (kGroup / 2);
        const int16_t* xc = x.codes.data() + t * k + g * kGroup;
        int32_t dot = 0;
        for (int64_t i = 0; i < kGroup / 2; ++i)
          dot += (packed[i] & 0x0F) * xc[i] + (packed[i] >> 4) * xc[i + kGroup / 2];
        const float scale = c10::detail::fp16_ieee_to_fp32_value(w.scales[at]);
        const float min = c10::detail::fp16_ieee_to_fp32_value(w.mins[at]);
        total += static_cast<float>(dot) * (scale * x.step[t * groups + g]) + min * x.sum[t * groups + g];
      }
      y[t * w.n + n] = total;
    }
}

#endif

// Rows t0..t0+R-1 for every output: tiles of NO outputs, then one output at a time for the rest.
template <int NO, int R>
void rows(const Int4Weight& w, const QuantizedRows& x, int64_t t0, float* y) {
  std::vector<float> scratch(NO * R * (w.k / kGroup));
  int64_t n = 0;
  for (; n + NO <= w.n; n += NO) tile<NO, R>(w, x, n, t0, y, scratch.data());
  for (; n < w.n; ++n) tile<1, R>(w, x, n, t0, y, scratch.data());
}

}  // namespace

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                       const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "int4_linear: x must be contiguous fp32 [T, K]");
  const int64_t n_rows = x.size(0), k = x.size(1), n_out = nibbles.size(0);
  TORCH_CHECK(k % kGroup == 0, "int4_linear: K must be a multiple of 32, got ", k);
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.is_contiguous() && nibbles.dim() == 2 && nibbles.size(1) == k / 2,
              "int4_linear: nibbles must be contiguous uint8 [N, K / 2]");
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kShort && t->is_contiguous() && t->dim() == 2 && t->size(0) == n_out &&
                    t->size(1) == k / kGroup,
                "int4_linear: scales and mins must be contiguous int16 [N, K / 32] (fp16 bits)");
  at::Tensor y = at::empty({n_rows, n_out}, x.options());
  const QuantizedRows q = quantize_rows(x.data_ptr<float>(), n_rows, k);
  const Int4Weight w{nibbles.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>()),
                     reinterpret_cast<const uint16_t*>(mins.data_ptr<int16_t>()), n_out, k};
  float* out = y.data_ptr<float>();
  // Fewer rows leave room for more outputs a tile (at most eight accumulators).
  int64_t t = 0;
  for (; t + kRowBlock <= n_rows; t += kRowBlock) rows<2, kRowBlock>(w, q, t, out);
  switch (n_rows - t) {
    case 3: rows<2, 3>(w, q, t, out); break;
    case 2: rows<4, 2>(w, q, t, out); break;
    case 1: rows<4, 1>(w, q, t, out); break;
    default: break;
  }
  return y;
}

}  // namespace trtssd

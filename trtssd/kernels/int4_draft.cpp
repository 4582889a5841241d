// The int4 draft's decoder layers in one call (CPU).
//
// Same arithmetic as LlamaModel with Int4Linear projections (trtssd/models/llama.py,
// trtssd/models/quant.py): fp32 residual stream, RMSNorm, RoPE, KV cache and attention;
// projections through aten's int4 kernel with bf16 inputs and outputs. What it removes is the
// ~30 small aten calls per layer (and the Python around them) that cost the draft as much as its
// weight reads; the int4 matmuls are the same aten calls.
//
// Attention is a direct loop (one key vector loaded per query group), meant for the few-row
// forwards of decoding; wide forwards (prefill) stay on the torch path.

#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

using at::BFloat16;

constexpr int64_t kGroupSize = 32;

// out[t] = bf16(x[t] * rsqrt(mean(x[t]^2) + eps) * w)
void rms_norm_bf16(const float* x, const float* w, BFloat16* out, int64_t rows, int64_t dim, float eps) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = x + t * dim;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
    BFloat16* o = out + t * dim;
    for (int64_t i = 0; i < dim; ++i) o[i] = BFloat16(xr[i] * inv * w[i]);
  }
}

// x[t, 0:n] += float(y[t, 0:n]) (+ bias[0:n], fp32, when given) with y's row stride `stride`
void add_bf16(float* x, const BFloat16* y, int64_t rows, int64_t n, int64_t stride, const at::Tensor& bias) {
  const float* b = bias.numel() > 0 ? bias.data_ptr<float>() : nullptr;
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < n; ++i) x[t * n + i] += static_cast<float>(y[t * stride + i]) + (b ? b[i] : 0.f);
}

// Half-split rotation of one head: out = v * cos + rotate_half(v) * sin (sin table signed).
template <typename T>
void rope(const T* v, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float partner = static_cast<float>(v[i < half ? i + half : i - half]);
    out[i] = static_cast<float>(v[i]) * cos[i] + partner * sin[i];
  }
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_zeros) {
  return at::_weight_int4pack_mm_for_cpu(x, packed, kGroupSize, scale_zeros);
}

// float(y) + bias in fp32, as the torch layers compute a biased projection (Qwen2's q/k/v, or
// gate|up); the bias is fp32 [n], n up to the kernel's padded width. (Projections added to the
// residual stream take their bias there, in add_bf16.)
at::Tensor add_bias(const at::Tensor& y, const at::Tensor& bias) {
  at::Tensor out = y.to(at::kFloat);
  out.narrow(1, 0, bias.size(0)).add_(bias);
  return out;
}

struct Shape {
  int64_t tokens, hidden, heads, kv_heads, head_dim, key_len;
  int64_t pool_heads_stride, pool_slot_stride, pool_row_stride;
};

// Write every token's rotated K and its V into the pools (before any token attends: tokens of
// one forward see each other's slots as their masks allow).
template <typename T>
void write_kv(const Shape& s, const T* qkv, int64_t qkv_stride, const float* cos, const float* sin,
              const int64_t* rows, const int64_t* slots, float* kc, float* vc) {
  const int64_t D = s.head_dim, q_width = s.heads * D;
  for (int64_t t = 0; t < s.tokens; ++t) {
    const T* k = qkv + t * qkv_stride + q_width;
    const T* v = k + s.kv_heads * D;
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      const int64_t at = rows[t] * s.pool_row_stride + g * s.pool_heads_stride + slots[t] * s.pool_slot_stride;
      rope(k + g * D, cos + t * D, sin + t * D, kc + at, D);
      for (int64_t i = 0; i < D; ++i) vc[at + i] = static_cast<float>(v[g * D + i]);
    }
  }
}

// out[t, h*D:(h+1)*D] = softmax(q_h . K^T * scale over visible keys) V, written as bf16.
template <typename T>
void attend(const Shape& s, const T* qkv, int64_t qkv_stride, const float* cos, const float* sin,
            const int64_t* rows, const bool* visible, const float* kc, const float* vc, float scale,
            BFloat16* out) {
  const int64_t D = s.head_dim, G = s.heads / s.kv_heads, L = s.key_len;
  std::vector<float> q(G * D), scores(G * L), acc(G * D), best(G), total(G);
  for (int64_t t = 0; t < s.tokens; ++t) {
    const bool* vis = visible + t * L;
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      for (int64_t j = 0; j < G; ++j)
        rope(qkv + t * qkv_stride + (g * G + j) * D, cos + t * D, sin + t * D, q.data() + j * D, D);
      const int64_t base = rows[t] * s.pool_row_stride + g * s.pool_heads_stride;
      std::fill(best.begin(), best.end(), -std::numeric_limits<float>::infinity());
      for (int64_t key = 0; key < L; ++key) {
        if (!vis[key]) continue;
        const float* k = kc + base + key * s.pool_slot_stride;
        for (int64_t j = 0; j < G; ++j) {
          const float* qj = q.data() + j * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < D; ++i) dot += qj[i] * k[i];
          dot *= scale;
          scores[j * L + key] = dot;
          if (dot > best[j]) best[j] = dot;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(total.begin(), total.end(), 0.f);
      for (int64_t key = 0; key < L; ++key) {
        if (!vis[key]) continue;
        const float* v = vc + base + key * s.pool_slot_stride;
        for (int64_t j = 0; j < G; ++j) {
          const float p = std::exp(scores[j * L + key] - best[j]);
          total[j] += p;
          float* a = acc.data() + j * D;
          for (int64_t i = 0; i < D; ++i) a[i] += p * v[i];
        }
      }
      for (int64_t j = 0; j < G; ++j) {
        BFloat16* o = out + t * s.heads * D + (g * G + j) * D;
        const float inv = 1.f / total[j];
        for (int64_t i = 0; i < D; ++i) o[i] = BFloat16(acc[j * D + i] * inv);
      }
    }
  }
}

// bf16(silu(gate) * up) from the fused gate|up projection output.
template <typename T>
void silu_mul(const T* gu, int64_t stride, int64_t rows, int64_t n, BFloat16* out) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* g = gu + t * stride;
    const T* u = g + n;
    for (int64_t i = 0; i < n; ++i) {
      const float gf = static_cast<float>(g[i]);
      out[t * n + i] = BFloat16(gf / (1.f + std::exp(-gf)) * static_cast<float>(u[i]));
    }
  }
}

// Write the forward's K/V into the pools, then attend: qkv as the projection left it (bf16, or
// fp32 once a bias was added).
template <typename T>
void attention(const Shape& s, const T* qkv, int64_t qkv_stride, const float* cos, const float* sin,
               const int64_t* rows, const int64_t* slots, const bool* visible, const at::Tensor& kc,
               const at::Tensor& vc, float scale, at::Tensor& out) {
  write_kv(s, qkv, qkv_stride, cos, sin, rows, slots, kc.data_ptr<float>(), vc.data_ptr<float>());
  attend(s, qkv, qkv_stride, cos, sin, rows, visible, kc.data_ptr<float>(), vc.data_ptr<float>(), scale,
         out.data_ptr<BFloat16>());
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "int4 draft layers: ", what); }

}  // namespace

// x: [T, hidden] fp32, updated in place and returned. Per layer l: norms[2l] / norms[2l+1]
// (attention / MLP RMSNorm weights, fp32), packed[4l..4l+3] and scale_zeros[4l..4l+3] for the
// qkv, o, gate|up and down projections (aten int4 pack, bf16 scale/zero), biases[4l..4l+3] their
// fp32 biases (empty for none), k_pools[l] / v_pools[l]
// [rows, Hkv, max_len, D] fp32. cos/sin [T, D] fp32 (sin signed as in apply_rope), rows/slots [T]
// int64, visible [T, key_len] bool.
at::Tensor decoder_layers(at::Tensor x, const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& packed,
                          const std::vector<at::Tensor>& scale_zeros, const std::vector<at::Tensor>& biases,
                          const std::vector<at::Tensor>& k_pools,
                          const std::vector<at::Tensor>& v_pools, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& visible, int64_t heads,
                          int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(k_pools.size());
  check(x.dtype() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x must be contiguous fp32 [T, hidden]");
  check(static_cast<int64_t>(norms.size()) == 2 * layers && static_cast<int64_t>(packed.size()) == 4 * layers &&
            static_cast<int64_t>(scale_zeros.size()) == 4 * layers && static_cast<int64_t>(biases.size()) == 4 * layers &&
            static_cast<int64_t>(v_pools.size()) == layers,
        "weights must come as 2 norms and 4 projections per layer");
  check(cos.is_contiguous() && sin.is_contiguous() && cos.dtype() == at::kFloat && sin.dtype() == at::kFloat,
        "cos/sin must be contiguous fp32 [T, D]");
  check(rows.dtype() == at::kLong && slots.dtype() == at::kLong && rows.is_contiguous() && slots.is_contiguous(),
        "rows/slots must be contiguous int64");
  check(visible.dtype() == at::kBool && visible.is_contiguous() && visible.dim() == 2 && visible.size(0) == x.size(0),
        "visible must be contiguous bool [T, key_len]");
  check(heads % kv_heads == 0 && head_dim % 2 == 0, "heads must be a multiple of kv_heads, head_dim even");

  const at::Tensor& pool0 = k_pools[0];
  Shape s{x.size(0), x.size(1), heads, kv_heads, head_dim, visible.size(1),
          pool0.stride(1), pool0.stride(2), pool0.stride(0)};
  check(pool0.stride(3) == 1 && pool0.size(3) == head_dim && visible.size(1) <= pool0.size(2),
        "KV pools must be [rows, Hkv, max_len, D] with unit stride in D");
  const int64_t T = s.tokens, H = s.hidden;
  auto bf16 = x.options().dtype(at::kBFloat16);
  at::Tensor normed = at::empty({T, H}, bf16);
  at::Tensor attn = at::empty({T, heads * head_dim}, bf16);
  at::Tensor act = at::empty({T, intermediate}, bf16);
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* slp = slots.data_ptr<int64_t>();
  const bool* vp = visible.data_ptr<bool>();
  const float eps_f = static_cast<float>(eps), scale_f = static_cast<float>(scale);

  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& kc = k_pools[l];
    const at::Tensor& vc = v_pools[l];
    check(kc.dtype() == at::kFloat && vc.dtype() == at::kFloat && kc.strides() == pool0.strides() &&
              vc.strides() == pool0.strides(),
          "KV pools must be fp32 with one layout");
    rms_norm_bf16(xp, norms[2 * l].data_ptr<float>(), normed.data_ptr<BFloat16>(), T, H, eps_f);
    at::Tensor qkv = int4_mm(normed, packed[4 * l], scale_zeros[4 * l]);
    if (biases[4 * l].numel() > 0) {
      qkv = add_bias(qkv, biases[4 * l]);
      attention(s, qkv.data_ptr<float>(), qkv.size(1), cp, sp, rp, slp, vp, kc, vc, scale_f, attn);
    } else {
      attention(s, qkv.data_ptr<BFloat16>(), qkv.size(1), cp, sp, rp, slp, vp, kc, vc, scale_f, attn);
    }
    at::Tensor o = int4_mm(attn, packed[4 * l + 1], scale_zeros[4 * l + 1]);
    add_bf16(xp, o.data_ptr<BFloat16>(), T, H, o.size(1), biases[4 * l + 1]);

    rms_norm_bf16(xp, norms[2 * l + 1].data_ptr<float>(), normed.data_ptr<BFloat16>(), T, H, eps_f);
    at::Tensor gu = int4_mm(normed, packed[4 * l + 2], scale_zeros[4 * l + 2]);
    if (biases[4 * l + 2].numel() > 0) {
      gu = add_bias(gu, biases[4 * l + 2]);
      silu_mul(gu.data_ptr<float>(), gu.size(1), T, intermediate, act.data_ptr<BFloat16>());
    } else {
      silu_mul(gu.data_ptr<BFloat16>(), gu.size(1), T, intermediate, act.data_ptr<BFloat16>());
    }
    at::Tensor down = int4_mm(act, packed[4 * l + 3], scale_zeros[4 * l + 3]);
    add_bf16(xp, down.data_ptr<BFloat16>(), T, H, down.size(1), biases[4 * l + 3]);
  }
  return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decoder_layers", &decoder_layers, "int4 draft decoder layers (CPU)");
}

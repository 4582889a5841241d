// The draft's decoder layers in one call (CPU), with int4 or int8 projections.
//
// Same arithmetic as LlamaModel with Int4Linear or Int8DynamicLinear projections
// (trtssd/models/llama.py, quant.py, int8_dynamic.py): fp32 residual stream, RMSNorm, RoPE, KV
// cache and attention. int4: our few-row int4 matmul (int4_matmul.h); int8: fbgemm's dynamic
// linear, one activation scale per row. Both fp32 in and out. What it removes is the ~30 small aten calls
// per layer (and the Python around them) that cost the draft as much as its weight reads; the
// matmuls are the same calls the torch layers make.
//
// Attention is a direct loop (one key vector loaded per query group), meant for the few-row
// forwards of decoding; wide forwards (prefill) stay on the torch path.

#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <ATen/native/quantized/PackedParams.h>

#include "int4_matmul.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

// out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w
void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = x + t * dim;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
    float* o = out + t * dim;
    for (int64_t i = 0; i < dim; ++i) o[i] = xr[i] * inv * w[i];
  }
}

// x[t, 0:n] += y[t, 0:n] (+ bias[0:n], fp32, when given) with y's row stride `stride`
void add_residual(float* x, const float* y, int64_t rows, int64_t n, int64_t stride, const at::Tensor& bias) {
  const float* b = bias.numel() > 0 ? bias.data_ptr<float>() : nullptr;
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < n; ++i) x[t * n + i] += y[t * stride + i] + (b ? b[i] : 0.f);
}

// Half-split rotation of one head: out = v * cos + rotate_half(v) * sin (sin table signed).
void rope(const float* v, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float partner = v[i < half ? i + half : i - half];
    out[i] = v[i] * cos[i] + partner * sin[i];
  }
}

struct Shape {
  int64_t tokens, hidden, heads, kv_heads, head_dim, key_len;
  int64_t pool_heads_stride, pool_slot_stride, pool_row_stride;
};

// Write every token's rotated K and its V into the pools (before any token attends: tokens of
// one forward see each other's slots as their masks allow).
void write_kv(const Shape& s, const float* qkv, int64_t qkv_stride, const float* cos, const float* sin,
              const int64_t* rows, const int64_t* slots, float* kc, float* vc) {
  const int64_t D = s.head_dim, q_width = s.heads * D;
  for (int64_t t = 0; t < s.tokens; ++t) {
    const float* k = qkv + t * qkv_stride + q_width;
    const float* v = k + s.kv_heads * D;
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      const int64_t at = rows[t] * s.pool_row_stride + g * s.pool_heads_stride + slots[t] * s.pool_slot_stride;
      rope(k + g * D, cos + t * D, sin + t * D, kc + at, D);
      for (int64_t i = 0; i < D; ++i) vc[at + i] = v[g * D + i];
    }
  }
}

// out[t, h*D:(h+1)*D] = softmax(q_h . K^T * scale over visible keys) V, written as A.
void attend(const Shape& s, const float* qkv, int64_t qkv_stride, const float* cos, const float* sin,
            const int64_t* rows, const bool* visible, const float* kc, const float* vc, float scale,
            float* out) {
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
        float* o = out + t * s.heads * D + (g * G + j) * D;
        const float inv = 1.f / total[j];
        for (int64_t i = 0; i < D; ++i) o[i] = acc[j * D + i] * inv;
      }
    }
  }
}

// silu(gate) * up from the fused gate|up projection output.
void silu_mul(const float* gu, int64_t stride, int64_t rows, int64_t n, float* out) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* g = gu + t * stride;
    const float* u = g + n;
    for (int64_t i = 0; i < n; ++i) {
      const float gf = g[i];
      out[t * n + i] = gf / (1.f + std::exp(-gf)) * u[i];
    }
  }
}

// Write the forward's K/V into the pools, then attend (qkv: the projection's fp32 output).
void attention(const Shape& s, const float* qkv, int64_t qkv_stride, const float* cos, const float* sin,
               const int64_t* rows, const int64_t* slots, const bool* visible, const at::Tensor& kc,
               const at::Tensor& vc, float scale, float* out) {
  write_kv(s, qkv, qkv_stride, cos, sin, rows, slots, kc.data_ptr<float>(), vc.data_ptr<float>());
  attend(s, qkv, qkv_stride, cos, sin, rows, visible, kc.data_ptr<float>(), vc.data_ptr<float>(), scale, out);
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "draft layers: ", what); }

// int4 projections: our int4 matmul, fp32 in and out, as Int4Linear runs it.
struct Int4Projections {
  const std::vector<at::Tensor>& nibbles;
  const std::vector<at::Tensor>& scales;
  const std::vector<at::Tensor>& mins;
  const std::vector<at::Tensor>& biases;

  at::Tensor operator()(int64_t i, const at::Tensor& x) const {
    at::Tensor y = residual_input(i, x);
    return biases[i].numel() > 0 ? y.add_(biases[i]) : y;
  }
  // The o and down projections add their bias to the residual stream instead (in fp32).
  at::Tensor residual_input(int64_t i, const at::Tensor& x) const {
    return trtssd::int4_linear(x, nibbles[i], scales[i], mins[i]);
  }
  const at::Tensor& residual_bias(int64_t i) const { return biases[i]; }
};

// int8 projections: fbgemm's dynamic linear with one activation scale per row, fp32 in and out;
// the same ops in the same order as rowwise_linear_dynamic (trtssd/models/int8_dynamic.py), so
// the torch layers and these agree bit for bit. The o and down biases go to the residual stream.
class Int8Projections {
 public:

  Int8Projections(const std::vector<py::handle>& packed, std::vector<at::Tensor> biases, int64_t levels)
      : biases_(std::move(biases)), levels_(levels) {
    static const auto type = c10::getCustomClassType<c10::intrusive_ptr<LinearPackedParamsBase>>();
    for (const auto& p : packed) params_.push_back(torch::jit::toIValue(p, type).toCustomClass<LinearPackedParamsBase>());
    TORCH_CHECK(biases_.size() == params_.size(), "draft layers: one bias per int8 projection");
    TORCH_CHECK(levels_ == 1 || levels_ == 2, "draft layers: activation levels must be 1 or 2");
  }
  int64_t size() const { return static_cast<int64_t>(params_.size()); }
  at::Tensor operator()(int64_t i, const at::Tensor& x) const {
    at::Tensor y = residual_input(i, x);
    return biases_[i].numel() > 0 ? y + biases_[i] : y;
  }
  at::Tensor residual_input(int64_t i, const at::Tensor& x) const {
    const int64_t rows = x.size(0);
    at::Tensor absmax = x.abs().amax({1}, true).clamp_min(std::numeric_limits<float>::min());
    at::Tensor unit = x / absmax * kRowRange;
    at::Tensor anchor = at::zeros({1, x.size(1)}, x.options());
    anchor.data_ptr<float>()[0] = 1.f;
    anchor.data_ptr<float>()[x.size(1) - 1] = -1.f;
    std::vector<at::Tensor> parts{unit};
    if (levels_ == 2) parts.push_back((unit - at::round(unit / kStep) * kStep) * kRemainderGain);
    parts.push_back(anchor);
    at::Tensor y = params_[i]->apply_dynamic(at::cat(parts), kReduceRange);
    at::Tensor out = y.narrow(0, 0, rows);
    if (levels_ == 2) out = out + y.narrow(0, rows, rows) / kRemainderGain;
    return (out * (absmax / kRowRange)).contiguous();
  }
  const at::Tensor& residual_bias(int64_t i) const { return biases_[i]; }

 private:
  // As trtssd/models/int8_dynamic.py: 7-bit activations, fbgemm's grid over [-1, 1].
  static constexpr bool kReduceRange = true;
  static constexpr double kStep = 2.0 / 127.0;
  static constexpr double kRowRange = 0.99;
  static constexpr double kRemainderGain = 2.0 * kRowRange / kStep;
  std::vector<c10::intrusive_ptr<LinearPackedParamsBase>> params_;
  std::vector<at::Tensor> biases_;
  int64_t levels_;
};

struct Inputs {
  const std::vector<at::Tensor>& norms;
  const std::vector<at::Tensor>& k_pools;
  const std::vector<at::Tensor>& v_pools;
  const at::Tensor& cos;
  const at::Tensor& sin;
  const at::Tensor& rows;
  const at::Tensor& slots;
  const at::Tensor& visible;
  int64_t heads, kv_heads, head_dim, intermediate;
  double eps, scale;
};

void check_inputs(const at::Tensor& x, const Inputs& in, int64_t projections) {
  const int64_t layers = static_cast<int64_t>(in.k_pools.size());
  check(x.dtype() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x must be contiguous fp32 [T, hidden]");
  check(static_cast<int64_t>(in.norms.size()) == 2 * layers && projections == 4 * layers &&
            static_cast<int64_t>(in.v_pools.size()) == layers,
        "weights must come as 2 norms and 4 projections per layer");
  check(in.cos.is_contiguous() && in.sin.is_contiguous() && in.cos.dtype() == at::kFloat && in.sin.dtype() == at::kFloat,
        "cos/sin must be contiguous fp32 [T, D]");
  check(in.rows.dtype() == at::kLong && in.slots.dtype() == at::kLong && in.rows.is_contiguous() &&
            in.slots.is_contiguous(),
        "rows/slots must be contiguous int64");
  check(in.visible.dtype() == at::kBool && in.visible.is_contiguous() && in.visible.dim() == 2 &&
            in.visible.size(0) == x.size(0),
        "visible must be contiguous bool [T, key_len]");
  check(in.heads % in.kv_heads == 0 && in.head_dim % 2 == 0, "heads must be a multiple of kv_heads, head_dim even");
  const at::Tensor& pool0 = in.k_pools[0];
  check(pool0.stride(3) == 1 && pool0.size(3) == in.head_dim && in.visible.size(1) <= pool0.size(2),
        "KV pools must be [rows, Hkv, max_len, D] with unit stride in D");
}

template <typename P>
at::Tensor run_layers(at::Tensor x, const P& proj, const Inputs& in) {
  const at::Tensor& pool0 = in.k_pools[0];
  Shape s{x.size(0), x.size(1), in.heads, in.kv_heads, in.head_dim, in.visible.size(1),
          pool0.stride(1), pool0.stride(2), pool0.stride(0)};
  const int64_t T = s.tokens, H = s.hidden, layers = static_cast<int64_t>(in.k_pools.size());
  auto opts = x.options();
  at::Tensor normed = at::empty({T, H}, opts);
  at::Tensor attn = at::empty({T, in.heads * in.head_dim}, opts);
  at::Tensor act = at::empty({T, in.intermediate}, opts);
  float* xp = x.data_ptr<float>();
  const float* cp = in.cos.data_ptr<float>();
  const float* sp = in.sin.data_ptr<float>();
  const int64_t* rp = in.rows.data_ptr<int64_t>();
  const int64_t* slp = in.slots.data_ptr<int64_t>();
  const bool* vp = in.visible.data_ptr<bool>();
  const float eps = static_cast<float>(in.eps), scale = static_cast<float>(in.scale);

  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& kc = in.k_pools[l];
    const at::Tensor& vc = in.v_pools[l];
    check(kc.dtype() == at::kFloat && vc.dtype() == at::kFloat && kc.strides() == pool0.strides() &&
              vc.strides() == pool0.strides(),
          "KV pools must be fp32 with one layout");
    rms_norm(xp, in.norms[2 * l].data_ptr<float>(), normed.data_ptr<float>(), T, H, eps);
    at::Tensor qkv = proj(4 * l, normed);
    attention(s, qkv.data_ptr<float>(), qkv.size(1), cp, sp, rp, slp, vp, kc, vc, scale, attn.data_ptr<float>());
    at::Tensor o = proj.residual_input(4 * l + 1, attn);
    add_residual(xp, o.data_ptr<float>(), T, H, o.size(1), proj.residual_bias(4 * l + 1));

    rms_norm(xp, in.norms[2 * l + 1].data_ptr<float>(), normed.data_ptr<float>(), T, H, eps);
    at::Tensor gu = proj(4 * l + 2, normed);
    silu_mul(gu.data_ptr<float>(), gu.size(1), T, in.intermediate, act.data_ptr<float>());
    at::Tensor down = proj.residual_input(4 * l + 3, act);
    add_residual(xp, down.data_ptr<float>(), T, H, down.size(1), proj.residual_bias(4 * l + 3));
  }
  return x;
}

}  // namespace

// x: [T, hidden] fp32, updated in place and returned. Per layer l: norms[2l] / norms[2l+1]
// (attention / MLP RMSNorm weights, fp32); the qkv, o, gate|up and down projections are entries
// 4l..4l+3 of the projection lists; k_pools[l] / v_pools[l] [rows, Hkv, max_len, D] fp32.
// cos/sin [T, D] fp32 (sin signed as in apply_rope), rows/slots [T] int64, visible [T, key_len] bool.
//
// int4: nibbles / scales / mins (int4_matmul.h's layout) and biases (fp32, empty for none).
at::Tensor decoder_layers_int4(at::Tensor x, const std::vector<at::Tensor>& norms, const std::vector<at::Tensor>& nibbles,
                               const std::vector<at::Tensor>& scales, const std::vector<at::Tensor>& mins,
                               const std::vector<at::Tensor>& biases,
                               const std::vector<at::Tensor>& k_pools, const std::vector<at::Tensor>& v_pools,
                               const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& rows,
                               const at::Tensor& slots, const at::Tensor& visible, int64_t heads, int64_t kv_heads,
                               int64_t head_dim, int64_t intermediate, double eps, double scale) {
  Inputs in{norms, k_pools, v_pools, cos, sin, rows, slots, visible, heads, kv_heads, head_dim, intermediate, eps, scale};
  check(scales.size() == nibbles.size() && mins.size() == nibbles.size() && biases.size() == nibbles.size(),
        "one scales, mins and bias per projection");
  check_inputs(x, in, static_cast<int64_t>(nibbles.size()));
  return run_layers(x, Int4Projections{nibbles, scales, mins, biases}, in);
}

// int8: the projections' fbgemm packed parameters, converted once (Int8Projections).
at::Tensor decoder_layers_int8(at::Tensor x, const std::vector<at::Tensor>& norms, const Int8Projections& projections,
                               const std::vector<at::Tensor>& k_pools, const std::vector<at::Tensor>& v_pools,
                               const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& rows,
                               const at::Tensor& slots, const at::Tensor& visible, int64_t heads, int64_t kv_heads,
                               int64_t head_dim, int64_t intermediate, double eps, double scale) {
  Inputs in{norms, k_pools, v_pools, cos, sin, rows, slots, visible, heads, kv_heads, head_dim, intermediate, eps, scale};
  check_inputs(x, in, projections.size());
  return run_layers(x, projections, in);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Int8Projections>(m, "Int8Projections")
      .def(py::init<const std::vector<py::handle>&, std::vector<at::Tensor>, int64_t>());
  m.def("decoder_layers_int4", &decoder_layers_int4, "int4 draft decoder layers (CPU)");
  m.def("decoder_layers_int8", &decoder_layers_int8, "int8 draft decoder layers (CPU)");
  m.def("int4_linear", &trtssd::int4_linear, "few-row int4 matmul (CPU): x [T, K] fp32 -> [T, N] fp32");
}

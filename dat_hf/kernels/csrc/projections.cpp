// A layer's input projections for a few rows (decoding): out = [x W_1^T | x W_2^T | ...] in one op (fp32). At one
// row per sequence each projection is a matrix-vector product bound by reading its weight: one call reads every
// weight once, a few rows of weights at a time for all rows of x, asking for the rows it reads next ahead of time.
// Symbolic attention for a few rows (decoding) in one op: the query projection, then per head a softmax over the
// symbols' templates and the weighted sum of the library.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "vec_rows.h"

namespace {

using namespace dat_hf_vec;
constexpr int64_t kGroup = 4;  // weight rows per step: independent accumulators for the same loads of x
constexpr int64_t kAhead = 4;  // steps whose weight rows are prefetched ahead

// out[r * ldo + k] = <W[k], x[r]> for the M <= kGroup weight rows W[0:M] (row stride d) and the rows of x
template <int M>
void group_dots(const float* W, int64_t d, const float* X, int64_t rows, float* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = X + r * d;
    Vec acc[M];
    for (int k = 0; k < M; ++k) acc[k] = Vec(0.f);
    int64_t e = 0;
    for (; e + kLanes <= d; e += kLanes) {
      const Vec xv = Vec::loadu(x + e);
      for (int k = 0; k < M; ++k) acc[k] = at::vec::fmadd(Vec::loadu(W + k * d + e), xv, acc[k]);
    }
    for (int k = 0; k < M; ++k) {
      float s = horizontal_sum(acc[k]);
      for (int64_t t = e; t < d; ++t) s += W[k * d + t] * x[t];
      out[r * ldo + k] = s;
    }
  }
}

// x [rows, d], weights [out_i, d] (contiguous float32) -> [rows, sum of out_i]
at::Tensor multi_linear(const at::Tensor& x, const std::vector<at::Tensor>& weights) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "multi_linear: x must be a contiguous float32 CPU tensor [rows, d], got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t rows = x.size(0), d = x.size(1);
  struct Step { const float* w; int64_t count, column; };  // kGroup (or fewer) rows of one weight, output column
  std::vector<Step> steps;
  int64_t total = 0;
  for (const at::Tensor& w : weights) {
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(1) == d &&
                w.is_contiguous(), "multi_linear: each weight must be a contiguous float32 CPU tensor [out, ", d,
                "], got ", w.scalar_type(), " ", w.sizes());
    const float* W = w.data_ptr<float>();
    for (int64_t o = 0; o < w.size(0); o += kGroup)
      steps.push_back({W + o * d, std::min(kGroup, w.size(0) - o), total + o});
    total += w.size(0);
  }
  auto out = at::empty({rows, total}, x.options());
  const float* X = x.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, (int64_t)steps.size(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + kAhead < end) {
        const Step& next = steps[i + kAhead];
        for (int64_t e = 0; e < next.count * d; e += 16) __builtin_prefetch(next.w + e);
      }
      const Step& s = steps[i];
      switch (s.count) {
        case 4: group_dots<4>(s.w, d, X, rows, O + s.column, total); break;
        case 3: group_dots<3>(s.w, d, X, rows, O + s.column, total); break;
        case 2: group_dots<2>(s.w, d, X, rows, O + s.column, total); break;
        default: group_dots<1>(s.w, d, X, rows, O + s.column, total); break;
      }
    }
  });
  return out;
}

// y += alpha x (n elements)
inline void axpy(float* y, float alpha, const float* x, int64_t n) {
  const Vec a(alpha);
  int64_t e = 0;
  for (; e + kLanes <= n; e += kLanes) at::vec::fmadd(a, Vec::loadu(x + e), Vec::loadu(y + e)).store(y + e);
  for (; e < n; ++e) y[e] += alpha * x[e];
}

// p[j] = exp(scale <q, K[j]> - max) for the n rows of K (row stride ld, width w) -> sum of p
inline float softmax_scores(const float* q, const float* K, int64_t ld, int64_t n, int64_t w, float scale, float* p) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    p[j] = scale * dot(q, K + j * ld, w);
    top = std::max(top, p[j]);
  }
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) total += (p[j] = std::exp(p[j] - top));
  return total;
}

void check_matrix(const at::Tensor& t, int64_t cols, const char* name, const char* op = "symbolic_attention") {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(1) == cols &&
              t.is_contiguous(), op, ": ", name, " must be a contiguous float32 CPU tensor [*, ", cols, "], got ",
              t.scalar_type(), " ", t.sizes());
}

const float* optional_vector(const std::optional<at::Tensor>& t, int64_t size, const char* name, const char* op) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == size &&
              t->is_contiguous(), op, ": ", name, " must be a contiguous float32 CPU tensor [", size, "], got ",
              t->scalar_type(), " ", t->sizes());
  return t->data_ptr<float>();
}

// out[r * ldo + o] = <W[o], x[r]> (+ bias[o]) for W [d_out, d_in] and the rows of x (row stride d_in)
void linear_rows(const float* W, const float* bias, int64_t d_out, int64_t d_in, const float* X, int64_t rows,
                 float* out, int64_t ldo) {
  at::parallel_for(0, (d_out + kGroup - 1) / kGroup, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t o = g * kGroup, count = std::min(kGroup, d_out - o);
      switch (count) {
        case 4: group_dots<4>(W + o * d_in, d_in, X, rows, out + o, ldo); break;
        case 3: group_dots<3>(W + o * d_in, d_in, X, rows, out + o, ldo); break;
        case 2: group_dots<2>(W + o * d_in, d_in, X, rows, out + o, ldo); break;
        default: group_dots<1>(W + o * d_in, d_in, X, rows, out + o, ldo); break;
      }
      if (bias != nullptr)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < count; ++k) out[r * ldo + o + k] += bias[o + k];
    }
  });
}

// x [rows, d], weight [d, d], bias [d] or None, templates and library [S, d] (contiguous float32), heads dividing d
// -> symbols [rows, d]: per head h, softmax(scale <x W_q^T + b_q, templates>) over the S symbols, times the library
at::Tensor symbolic_attention(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              const at::Tensor& templates, const at::Tensor& library, int64_t heads, double scale) {
  TORCH_CHECK(x.dim() == 2, "symbolic_attention: x must be [rows, d], got ", x.sizes());
  const int64_t rows = x.size(0), d = x.size(1), S = templates.size(0);
  check_matrix(x, d, "x");
  check_matrix(weight, d, "the query weight");
  check_matrix(templates, d, "the templates");
  check_matrix(library, d, "the library");
  TORCH_CHECK(weight.size(0) == d && library.size(0) == S && heads > 0 && d % heads == 0,
              "symbolic_attention: a [d, d] query weight, templates and library of one size, heads dividing d; got ",
              weight.sizes(), " ", templates.sizes(), " ", library.sizes(), " heads ", heads);
  const float* B = optional_vector(bias, d, "the query bias", "symbolic_attention");
  const int64_t dk = d / heads;
  auto query = at::empty({rows, d}, x.options());
  auto out = at::zeros({rows, d}, x.options());
  const float *X = x.data_ptr<float>(), *W = weight.data_ptr<float>(), *T = templates.data_ptr<float>(),
              *L = library.data_ptr<float>();
  float *Q = query.data_ptr<float>(), *O = out.data_ptr<float>();
  linear_rows(W, B, d, d, X, rows, Q, d);
  const float s = static_cast<float>(scale);
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(S);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / heads, h = i % heads;
      const float* q = Q + r * d + h * dk;
      const float total = softmax_scores(q, T + h * dk, d, S, dk, s, p.data());
      float* o = O + r * d + h * dk;
      for (int64_t j = 0; j < S; ++j) axpy(o, p[j] / total, L + j * d + h * dk, dk);
    }
  });
  return out;
}

// ---- one decoding step of a dual-attention layer -------------------------------------------------------------------
// For rows of one new token each, with every cached token visible (causal order or no mask) and the packed cache's
// buffers written in place at slot `length`:
//   [k_r | k_s | q_r | q_s | v_s | q_rel (| k_rel)] = x [W_1 | W_2 | ...]^T        (symmetric relations: k_rel = q_rel)
//   RoPE on the keys and queries (rotate-half; cos, sin [b or 1, d_h]), symbol values s W_s^T (+ b_s)
//   keys [b, h_kv_r + h_kv_s, cap, d_h] <- [k_r | k_s];  values [b, 1, cap, W] <- [v_s | symbol values | k_rel]
//   sensory head h:    softmax(scale <q_h, k_j>) v_j                     over the n = length + 1 cached tokens
//   relational head h: sum_j a_hj (sv_j + sum_l rel_jl W_r[h, :, l]),  rel_jl = relation_scaling <q_rel_l, k_rel_jl>
//   out = [o_s(sensory heads) | o_r(relational heads)]  [b, (h_s + h_r) d_h]
// heads = [h_s, h_kv_s, h_r, h_kv_r, R, d_r]; scalings = [sensory, relational, relation].
at::Tensor dual_attention_decode(const at::Tensor& x, const std::vector<at::Tensor>& in_weights,
                                 const at::Tensor& symbols, const at::Tensor& symbol_weight,
                                 const std::optional<at::Tensor>& symbol_bias, const std::optional<at::Tensor>& cos,
                                 const std::optional<at::Tensor>& sin, at::Tensor& key_buffer, at::Tensor& value_buffer,
                                 int64_t length, const at::Tensor& relation_proj, const at::Tensor& o_s_weight,
                                 const std::optional<at::Tensor>& o_s_bias, const at::Tensor& o_r_weight,
                                 const std::optional<at::Tensor>& o_r_bias, at::IntArrayRef heads,
                                 at::ArrayRef<double> scalings, bool symmetric) {
  const char* op = "dual_attention_decode";
  TORCH_CHECK(heads.size() == 6 && scalings.size() == 3, op, ": heads [h_s, h_kv_s, h_r, h_kv_r, R, d_r] and "
              "scalings [sensory, relational, relation]");
  const int64_t hs = heads[0], hks = heads[1], hr = heads[2], hkr = heads[3], R = heads[4], dr = heads[5];
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, d], got ", x.sizes());
  const int64_t b = x.size(0), d = x.size(1);
  check_matrix(x, d, "x", op);
  TORCH_CHECK(key_buffer.dim() == 4 && value_buffer.dim() == 4 && key_buffer.is_contiguous() &&
              value_buffer.is_contiguous() && key_buffer.scalar_type() == at::kFloat &&
              value_buffer.scalar_type() == at::kFloat && key_buffer.device().is_cpu() &&
              value_buffer.device().is_cpu(), op, ": the cache buffers must be contiguous float32 CPU tensors "
              "[b, heads, capacity, d_h] and [b, 1, capacity, width], got ", key_buffer.sizes(), " and ",
              value_buffer.sizes());
  const int64_t Hk = key_buffer.size(1), cap = key_buffer.size(2), dh = key_buffer.size(3);
  const int64_t W = value_buffer.size(3), n = length + 1;
  TORCH_CHECK(hs > 0 && hr > 0 && hks > 0 && hkr > 0 && hs % hks == 0 && hr % hkr == 0 && Hk == hkr + hks &&
              key_buffer.size(0) == b && value_buffer.size(0) == b && value_buffer.size(1) == 1 &&
              value_buffer.size(2) == cap && W == (hks + hkr) * dh + R * dr && length >= 0 && n <= cap, op,
              ": heads ", heads, " do not fit the cache buffers ", key_buffer.sizes(), " and ", value_buffer.sizes(),
              " at length ", length);
  const int64_t kr_at = 0, qr_at = Hk * dh, qs_at = qr_at + hr * dh, vs_at = qs_at + hs * dh;
  const int64_t qrel_at = vs_at + hks * dh, krel_at = symmetric ? qrel_at : qrel_at + R * dr;
  const int64_t P = krel_at + R * dr;
  int64_t total = 0;
  for (const at::Tensor& w : in_weights) {
    check_matrix(w, d, "each input projection's weight", op);
    total += w.size(0);
  }
  TORCH_CHECK(total == P, op, ": the input projections give ", total, " features, the heads need ", P);
  TORCH_CHECK(symbols.dim() == 2 && (symbols.size(0) == b || symbols.size(0) == 1), op, ": symbols must be [b or 1, ",
              d, "], got ", symbols.sizes());
  check_matrix(symbols, d, "symbols", op);
  check_matrix(symbol_weight, d, "the symbol projection's weight", op);
  TORCH_CHECK(symbol_weight.size(0) == hkr * dh, op, ": the symbol projection must give ", hkr * dh, " features");
  check_matrix(o_s_weight, hs * dh, "the sensory output projection's weight", op);
  check_matrix(o_r_weight, hr * dh, "the relational output projection's weight", op);
  TORCH_CHECK(relation_proj.dim() == 3 && relation_proj.is_contiguous() && relation_proj.scalar_type() == at::kFloat &&
              relation_proj.size(0) == hr && relation_proj.size(1) == dh && relation_proj.size(2) == R, op,
              ": relation_proj must be a contiguous float32 [", hr, ", ", dh, ", ", R, "] tensor, got ",
              relation_proj.sizes());
  const float* bs = optional_vector(symbol_bias, hkr * dh, "the symbol projection's bias", op);
  const float* bos = optional_vector(o_s_bias, o_s_weight.size(0), "the sensory output projection's bias", op);
  const float* bor = optional_vector(o_r_bias, o_r_weight.size(0), "the relational output projection's bias", op);
  const bool rope = cos.has_value();
  TORCH_CHECK(rope == sin.has_value(), op, ": give both cos and sin or neither");
  if (rope) {
    check_matrix(*cos, dh, "cos", op);
    check_matrix(*sin, dh, "sin", op);
    TORCH_CHECK((cos->size(0) == b || cos->size(0) == 1) && sin->size(0) == cos->size(0) && dh % 2 == 0, op,
                ": cos and sin must be [b or 1, ", dh, "], got ", cos->sizes(), " and ", sin->sizes());
  }

  // the projections, RoPE in place on the keys and queries
  auto proj = at::empty({b, P}, x.options());
  float* PR = proj.data_ptr<float>();
  const float* X = x.data_ptr<float>();
  for (int64_t i = 0, at = 0; i < (int64_t)in_weights.size(); at += in_weights[i].size(0), ++i)
    linear_rows(in_weights[i].data_ptr<float>(), nullptr, in_weights[i].size(0), d, X, b, PR + at, P);
  if (rope) {
    const int64_t half = dh / 2, rows = cos->size(0);
    const float *C = cos->data_ptr<float>(), *S = sin->data_ptr<float>();
    std::vector<float> t(dh);
    for (int64_t r = 0; r < b; ++r) {
      const float *c = C + (rows > 1 ? r : 0) * dh, *sn = S + (rows > 1 ? r : 0) * dh;
      for (int64_t h = 0; h < Hk + hr + hs; ++h) {
        float* v = PR + r * P + h * dh;
        std::copy(v, v + dh, t.begin());
        for (int64_t e = 0; e < half; ++e) v[e] = t[e] * c[e] - t[e + half] * sn[e];
        for (int64_t e = half; e < dh; ++e) v[e] = t[e] * c[e] + t[e - half] * sn[e];
      }
    }
  }
  // the new token into the cache
  auto symbol_values = at::empty({symbols.size(0), hkr * dh}, x.options());
  linear_rows(symbol_weight.data_ptr<float>(), bs, hkr * dh, d, symbols.data_ptr<float>(), symbols.size(0),
              symbol_values.data_ptr<float>(), hkr * dh);
  float *KB = key_buffer.data_ptr<float>(), *VB = value_buffer.data_ptr<float>();
  const float* SV = symbol_values.data_ptr<float>();
  for (int64_t r = 0; r < b; ++r) {
    for (int64_t h = 0; h < Hk; ++h)
      std::copy(PR + r * P + kr_at + h * dh, PR + r * P + kr_at + (h + 1) * dh, KB + ((r * Hk + h) * cap + length) * dh);
    float* row = VB + (r * cap + length) * W;
    std::copy(PR + r * P + vs_at, PR + r * P + vs_at + hks * dh, row);
    const float* sv = SV + (symbols.size(0) > 1 ? r : 0) * hkr * dh;
    std::copy(sv, sv + hkr * dh, row + hks * dh);
    std::copy(PR + r * P + krel_at, PR + r * P + krel_at + R * dr, row + (hks + hkr) * dh);
  }
  // both head types over the n cached tokens
  auto attended_s = at::empty({b, hs * dh}, x.options()), attended_r = at::empty({b, hr * dh}, x.options());
  auto rel = at::empty({b, R, n}, x.options());
  float *AS = attended_s.data_ptr<float>(), *AR = attended_r.data_ptr<float>(), *REL = rel.data_ptr<float>();
  const float* WR = relation_proj.data_ptr<float>();
  const float ss = static_cast<float>(scalings[0]), sr = static_cast<float>(scalings[1]);
  const float srel = static_cast<float>(scalings[2]);
  at::parallel_for(0, b * R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / R, l = t % R;
      const float* q = PR + r * P + qrel_at + l * dr;
      const float* k = VB + r * cap * W + (hks + hkr) * dh + l * dr;
      for (int64_t j = 0; j < n; ++j) REL[t * n + j] = srel * dot(q, k + j * W, dr);
    }
  });
  at::parallel_for(0, b * (hs + hr), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(n), agg(R);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / (hs + hr), h = t % (hs + hr);
      const bool sensory = h < hs;
      const int64_t head = sensory ? h : h - hs;
      const int64_t g = sensory ? hkr + head / (hs / hks) : head / (hr / hkr);  // key head in the buffer
      const float* q = PR + r * P + (sensory ? qs_at : qr_at) + head * dh;
      const float* keys = KB + (r * Hk + g) * cap * dh;
      const float* values = VB + r * cap * W + (sensory ? (g - hkr) * dh : (hks + g) * dh);
      const float total = softmax_scores(q, keys, dh, n, dh, sensory ? ss : sr, p.data());
      float* o = sensory ? AS + (r * hs + head) * dh : AR + (r * hr + head) * dh;
      std::fill(o, o + dh, 0.f);
      for (int64_t j = 0; j < n; ++j) axpy(o, p[j], values + j * W, dh);
      if (!sensory) {
        for (int64_t l = 0; l < R; ++l) agg[l] = dot(p.data(), REL + (r * R + l) * n, n);
        const float* w = WR + head * dh * R;  // W_r[head] is [d_h, R]
        for (int64_t e = 0; e < dh; ++e) o[e] += dot(w + e * R, agg.data(), R);
      }
      const float inv = 1.f / total;
      for (int64_t e = 0; e < dh; ++e) o[e] *= inv;
    }
  });
  // the output projections
  const int64_t ds = o_s_weight.size(0), drr = o_r_weight.size(0);
  auto out = at::empty({b, ds + drr}, x.options());
  float* O = out.data_ptr<float>();
  linear_rows(o_s_weight.data_ptr<float>(), bos, ds, hs * dh, AS, b, O, ds + drr);
  linear_rows(o_r_weight.data_ptr<float>(), bor, drr, hr * dh, AR, b, O + ds, ds + drr);
  return out;
}

// rows of x [b, d] -> x / rms(x) * w (float32), as the model's RMSNorm
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps, const char* op) {
  const int64_t b = x.size(0), d = x.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == d && w.is_contiguous() && w.scalar_type() == at::kFloat &&
              w.device().is_cpu(), op, ": a norm weight must be a contiguous float32 CPU tensor [", d, "], got ",
              w.sizes());
  auto out = at::empty({b, d}, x.options());
  const float *X = x.data_ptr<float>(), *W = w.data_ptr<float>();
  float* O = out.data_ptr<float>();
  for (int64_t r = 0; r < b; ++r) {
    const float* xr = X + r * d;
    const float scale = 1.f / std::sqrt(dot(xr, xr, d) / static_cast<float>(d) + static_cast<float>(eps));
    for (int64_t e = 0; e < d; ++e) O[r * d + e] = xr[e] * scale * W[e];
  }
  return out;
}

// One decoding step of a pre-norm DAT decoder layer with a SwiGLU MLP (fp32): h = x + DualAttention(RMSNorm_1(x)),
// out = h + down(silu(gate(n)) * up(n)) with n = RMSNorm_2(h); the attention as `dual_attention_decode` (its cache
// write included). x [b, d] -> [b, d].
at::Tensor decoder_layer_decode(const at::Tensor& x, const at::Tensor& input_norm, double input_eps,
                                const std::vector<at::Tensor>& in_weights, const at::Tensor& symbols,
                                const at::Tensor& symbol_weight, const std::optional<at::Tensor>& symbol_bias,
                                const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin,
                                at::Tensor& key_buffer, at::Tensor& value_buffer, int64_t length,
                                const at::Tensor& relation_proj, const at::Tensor& o_s_weight,
                                const std::optional<at::Tensor>& o_s_bias, const at::Tensor& o_r_weight,
                                const std::optional<at::Tensor>& o_r_bias, at::IntArrayRef heads,
                                at::ArrayRef<double> scalings, bool symmetric, const at::Tensor& post_norm,
                                double post_eps, const at::Tensor& gate_weight, const at::Tensor& up_weight,
                                const at::Tensor& down_weight) {
  const char* op = "decoder_layer_decode";
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, d], got ", x.sizes());
  const int64_t b = x.size(0), d = x.size(1), f = gate_weight.size(0);
  check_matrix(x, d, "x", op);
  check_matrix(gate_weight, d, "the gate projection's weight", op);
  check_matrix(up_weight, d, "the up projection's weight", op);
  check_matrix(down_weight, f, "the down projection's weight", op);
  TORCH_CHECK(up_weight.size(0) == f && down_weight.size(0) == d, op, ": the MLP's weights must be [f, d], [f, d] "
              "and [d, f], got ", gate_weight.sizes(), ", ", up_weight.sizes(), ", ", down_weight.sizes());
  auto attended = dual_attention_decode(rms_norm_rows(x, input_norm, input_eps, op), in_weights, symbols,
                                        symbol_weight, symbol_bias, cos, sin, key_buffer, value_buffer, length,
                                        relation_proj, o_s_weight, o_s_bias, o_r_weight, o_r_bias, heads, scalings,
                                        symmetric);
  TORCH_CHECK(attended.size(1) == d, op, ": the attention gives ", attended.size(1), " features, the layer has ", d);
  float* H = attended.data_ptr<float>();  // h = x + attention, in place
  const float* X = x.data_ptr<float>();
  for (int64_t i = 0; i < b * d; ++i) H[i] += X[i];
  auto normed = rms_norm_rows(attended, post_norm, post_eps, op);
  auto gate = at::empty({b, f}, x.options()), up = at::empty({b, f}, x.options());
  float *G = gate.data_ptr<float>(), *U = up.data_ptr<float>();
  linear_rows(gate_weight.data_ptr<float>(), nullptr, f, d, normed.data_ptr<float>(), b, G, f);
  linear_rows(up_weight.data_ptr<float>(), nullptr, f, d, normed.data_ptr<float>(), b, U, f);
  for (int64_t i = 0; i < b * f; ++i) G[i] = G[i] / (1.f + std::exp(-G[i])) * U[i];
  auto out = at::empty({b, d}, x.options());
  float* O = out.data_ptr<float>();
  linear_rows(down_weight.data_ptr<float>(), nullptr, d, f, G, b, O, d);
  for (int64_t i = 0; i < b * d; ++i) O[i] += H[i];
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dat_hf, m) {
  m.def("multi_linear(Tensor x, Tensor[] weights) -> Tensor");
  m.def("symbolic_attention(Tensor x, Tensor weight, Tensor? bias, Tensor templates, Tensor library, int heads, "
        "float scale) -> Tensor");
  m.def("dual_attention_decode(Tensor x, Tensor[] in_weights, Tensor symbols, Tensor symbol_weight, "
        "Tensor? symbol_bias, Tensor? cos, Tensor? sin, Tensor(a!) key_buffer, Tensor(b!) value_buffer, int length, "
        "Tensor relation_proj, Tensor o_s_weight, Tensor? o_s_bias, Tensor o_r_weight, Tensor? o_r_bias, int[] heads, "
        "float[] scalings, bool symmetric) -> Tensor");
  m.def("decoder_layer_decode(Tensor x, Tensor input_norm, float input_eps, Tensor[] in_weights, Tensor symbols, "
        "Tensor symbol_weight, Tensor? symbol_bias, Tensor? cos, Tensor? sin, Tensor(a!) key_buffer, "
        "Tensor(b!) value_buffer, int length, Tensor relation_proj, Tensor o_s_weight, Tensor? o_s_bias, "
        "Tensor o_r_weight, Tensor? o_r_bias, int[] heads, float[] scalings, bool symmetric, Tensor post_norm, "
        "float post_eps, Tensor gate_weight, Tensor up_weight, Tensor down_weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(dat_hf, CPU, m) {
  m.impl("multi_linear", &multi_linear);
  m.impl("symbolic_attention", &symbolic_attention);
  m.impl("dual_attention_decode", &dual_attention_decode);
  m.impl("decoder_layer_decode", &decoder_layer_decode);
}

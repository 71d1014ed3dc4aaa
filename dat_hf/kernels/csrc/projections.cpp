// A layer's input projections for a few rows (decoding): out = [x W_1^T | x W_2^T | ...] in one op (fp32). At one
// row per sequence each projection is a matrix-vector product bound by reading its weight: one call reads every
// weight once, a few rows of weights at a time for all rows of x, asking for the rows it reads next ahead of time.
// Symbolic attention for a few rows (decoding) in one op: the query projection, then per head a softmax over the
// symbols' templates and the weighted sum of the library.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr int64_t kGroup = 4;  // weight rows per step: independent accumulators for the same loads of x
constexpr int64_t kAhead = 4;  // steps whose weight rows are prefetched ahead

inline float horizontal_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& x, const Vec& y) { return x + y; }, v);
}

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

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t e = 0;
  for (; e + kLanes <= n; e += kLanes) acc = at::vec::fmadd(Vec::loadu(a + e), Vec::loadu(b + e), acc);
  float s = horizontal_sum(acc);
  for (; e < n; ++e) s += a[e] * b[e];
  return s;
}

// y += alpha x (n elements)
inline void axpy(float* y, float alpha, const float* x, int64_t n) {
  const Vec a(alpha);
  int64_t e = 0;
  for (; e + kLanes <= n; e += kLanes) at::vec::fmadd(a, Vec::loadu(x + e), Vec::loadu(y + e)).store(y + e);
  for (; e < n; ++e) y[e] += alpha * x[e];
}

void check_matrix(const at::Tensor& t, int64_t cols, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(1) == cols &&
              t.is_contiguous(), "symbolic_attention: ", name, " must be a contiguous float32 CPU tensor [*, ", cols,
              "], got ", t.scalar_type(), " ", t.sizes());
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
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                bias->size(0) == d && bias->is_contiguous(), "symbolic_attention: the query bias must be a "
                "contiguous float32 CPU tensor [", d, "], got ", bias->scalar_type(), " ", bias->sizes());
  }
  const int64_t dk = d / heads;
  auto query = at::empty({rows, d}, x.options());
  auto out = at::zeros({rows, d}, x.options());
  const float *X = x.data_ptr<float>(), *W = weight.data_ptr<float>(), *T = templates.data_ptr<float>(),
              *L = library.data_ptr<float>();
  const float* B = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float *Q = query.data_ptr<float>(), *O = out.data_ptr<float>();
  at::parallel_for(0, (d + kGroup - 1) / kGroup, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t o = g * kGroup, count = std::min(kGroup, d - o);
      switch (count) {
        case 4: group_dots<4>(W + o * d, d, X, rows, Q + o, d); break;
        case 3: group_dots<3>(W + o * d, d, X, rows, Q + o, d); break;
        case 2: group_dots<2>(W + o * d, d, X, rows, Q + o, d); break;
        default: group_dots<1>(W + o * d, d, X, rows, Q + o, d); break;
      }
      if (B != nullptr)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < count; ++k) Q[r * d + o + k] += B[o + k];
    }
  });
  const float s = static_cast<float>(scale);
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(S);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / heads, h = i % heads;
      const float* q = Q + r * d + h * dk;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < S; ++j) {
        p[j] = s * dot(q, T + j * d + h * dk, dk);
        top = std::max(top, p[j]);
      }
      float total = 0.f;
      for (int64_t j = 0; j < S; ++j) total += (p[j] = std::exp(p[j] - top));
      float* o = O + r * d + h * dk;
      for (int64_t j = 0; j < S; ++j) axpy(o, p[j] / total, L + j * d + h * dk, dk);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dat_hf, m) {
  m.def("multi_linear(Tensor x, Tensor[] weights) -> Tensor");
  m.def("symbolic_attention(Tensor x, Tensor weight, Tensor? bias, Tensor templates, Tensor library, int heads, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dat_hf, CPU, m) {
  m.impl("multi_linear", &multi_linear);
  m.impl("symbolic_attention", &symbolic_attention);
}

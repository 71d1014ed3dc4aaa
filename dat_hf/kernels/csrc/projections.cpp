// A layer's input projections for a few rows (decoding): out = [x W_1^T | x W_2^T | ...] in one op (fp32). At one
// row per sequence each projection is a matrix-vector product bound by reading its weight: one call reads every
// weight once, a few rows of weights at a time for all rows of x, asking for the rows it reads next ahead of time.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(dat_hf, m) {
  m.def("multi_linear(Tensor x, Tensor[] weights) -> Tensor");
}

TORCH_LIBRARY_IMPL(dat_hf, CPU, m) {
  m.impl("multi_linear", &multi_linear);
}

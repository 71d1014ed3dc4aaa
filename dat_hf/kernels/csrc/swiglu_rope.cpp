// The MLP's SwiGLU and RoPE for CPU (fp32), one pass each (forward and gradient).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

// ---- SwiGLU of the MLP: hidden = silu(gate) up, and both gradients, one pass each -----------------------------------
void check_swiglu(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.device().is_cpu() && a.scalar_type() == at::kFloat && a.is_contiguous() && b.sizes() == a.sizes() &&
              b.scalar_type() == at::kFloat && b.is_contiguous(), "swiglu: ", what, " must be contiguous float32 CPU "
              "tensors of one shape, got ", a.sizes(), " ", a.scalar_type(), " and ", b.sizes(), " ", b.scalar_type());
}

inline Vec sigmoid(const Vec& x) { return Vec(1.f) / (Vec(1.f) + x.neg().exp()); }

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  check_swiglu(gate, up, "gate and up");
  auto out = at::empty(gate.sizes(), gate.options());
  const float *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, gate.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) {
      const Vec x = Vec::loadu(g + i);
      (x * sigmoid(x) * Vec::loadu(u + i)).store(o + i);
    }
    for (; i < end; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  });
  return out;
}

// d gate = grad up s (1 + gate (1 - s)), d up = grad gate s, with s = sigmoid(gate)
std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad, const at::Tensor& gate,
                                                   const at::Tensor& up) {
  check_swiglu(gate, up, "gate and up");
  check_swiglu(gate, grad, "gate and the gradient");
  auto grad_gate = at::empty(gate.sizes(), gate.options()), grad_up = at::empty(up.sizes(), up.options());
  const float *dy = grad.data_ptr<float>(), *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  float *dg = grad_gate.data_ptr<float>(), *du = grad_up.data_ptr<float>();
  at::parallel_for(0, gate.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    const Vec one(1.f);
    for (; i + kLanes <= end; i += kLanes) {
      const Vec x = Vec::loadu(g + i), s = sigmoid(x), d = Vec::loadu(dy + i);
      (d * Vec::loadu(u + i) * s * (one + x * (one - s))).store(dg + i);
      (d * x * s).store(du + i);
    }
    for (; i < end; ++i) {
      const float s = 1.f / (1.f + std::exp(-g[i]));
      dg[i] = dy[i] * u[i] * s * (1.f + g[i] * (1.f - s));
      du[i] = dy[i] * g[i] * s;
    }
  });
  return std::make_tuple(grad_gate, grad_up);
}

// ---- RoPE (rotate-half convention) on the fused keys and queries, one pass ---------------------------------------
// x [b, n, heads, d] (any strides but a contiguous last dim), cos, sin [b or 1, n, d] contiguous -> contiguous out:
//   forward:            out_1 = x_1 c_1 - x_2 s_1,  out_2 = x_2 c_2 + x_1 s_2   (x cos + rotate_half(x) sin)
//   transpose (its gradient): out_1 = x_1 c_1 + x_2 s_2,  out_2 = x_2 c_2 - x_1 s_1
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool transpose) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 4 && x.size(3) % 2 == 0 &&
              x.stride(3) == 1, "rope: x must be float32 [b, n, heads, d] (even d) with a contiguous last dim, got ",
              x.scalar_type(), " ", x.sizes(), " strides ", x.strides());
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->is_contiguous() &&
                (t->size(0) == 1 || t->size(0) == x.size(0)) && t->size(1) == x.size(1) && t->size(2) == x.size(3),
                "rope: cos and sin must be contiguous float32 [b or 1, n, d] = [", x.size(0), " or 1, ", x.size(1),
                ", ", x.size(3), "], got ", t->sizes());
  const int64_t B = x.size(0), n = x.size(1), H = x.size(2), d = x.size(3), half = d / 2;
  auto out = at::empty({B, n, H, d}, x.options());
  const float *X = x.data_ptr<float>(), *C = cos.data_ptr<float>(), *S = sin.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const int64_t xb = x.stride(0), xn = x.stride(1), xh = x.stride(2), cb = cos.size(0) > 1 ? n * d : 0;
  const float sign = transpose ? -1.f : 1.f;
  const Vec vsign(sign);
  at::parallel_for(0, B * n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / n, i = t % n;
      const float *c = C + b * cb + i * d, *s = S + b * cb + i * d;
      // forward: rotate_half's sin goes with its own half; transposed: with the other half
      const float *s1 = transpose ? s + half : s, *s2 = transpose ? s : s + half;
      for (int64_t h = 0; h < H; ++h) {
        const float* xr = X + b * xb + i * xn + h * xh;
        float* o = O + (t * H + h) * d;
        int64_t j = 0;
        for (; j + kLanes <= half; j += kLanes) {
          const Vec x1 = Vec::loadu(xr + j), x2 = Vec::loadu(xr + half + j);
          (x1 * Vec::loadu(c + j) - vsign * x2 * Vec::loadu(s1 + j)).store(o + j);
          (x2 * Vec::loadu(c + half + j) + vsign * x1 * Vec::loadu(s2 + j)).store(o + half + j);
        }
        for (; j < half; ++j) {
          const float x1 = xr[j], x2 = xr[half + j];
          o[j] = x1 * c[j] - sign * x2 * s1[j];
          o[half + j] = x2 * c[half + j] + sign * x1 * s2[j];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dat_hf, m) {
  m.def("swiglu_forward(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool transpose) -> Tensor");
}

TORCH_LIBRARY_IMPL(dat_hf, CPU, m) {
  m.impl("swiglu_forward", &swiglu_forward);
  m.impl("swiglu_backward", &swiglu_backward);
  m.impl("rope", &rope);
}

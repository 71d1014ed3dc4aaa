// Fused relational attention for CPU (fp32), forward and backward, flash-style: one block of receivers at a time,
// online softmax over blocks of senders, relations computed once per (receiver, sender) pair for all heads.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec_rows.h"

extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                       const int*, const float*, const int*, const float*, float*, const int*);

namespace {

// row-major C[M, N] = alpha op(A)[M, K] op(B)[K, N] + beta C (column-major BLAS sees the transposes)
inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                 const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const char ca = ta ? 'T' : 'N', cb = tb ? 'T' : 'N';
  const int m = (int)N, n = (int)M, k = (int)K, la = (int)ldb, lb = (int)lda, lc = (int)ldc;
  sgemm_(&cb, &ca, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
}

using namespace dat_hf_vec;

// ---- row helpers on at::vec (AVX512 / AVX2 / scalar per build flags); tails are scalar ----
inline float row_max(const float* x, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  if (n >= kLanes) {
    Vec v = Vec::loadu(x);
    for (j = kLanes; j + kLanes <= n; j += kLanes) v = at::vec::maximum(v, Vec::loadu(x + j));
    float lanes[kLanes];
    v.store(lanes);
    for (int64_t t = 0; t < kLanes; ++t) mx = std::max(mx, lanes[t]);
  }
  for (; j < n; ++j) mx = std::max(mx, x[j]);
  return mx;
}

// x[j] = exp(x[j] - shift) (exp(-inf) = 0); returns the sum of the new values
inline float exp_shifted(float* x, int64_t n, float shift) {
  Vec acc(0.f);
  const Vec vs(shift);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Vec e = (Vec::loadu(x + j) - vs).exp_u20();
    e.store(x + j);
    acc = acc + e;
  }
  float s = horizontal_sum(acc);
  for (; j < n; ++j) s += (x[j] = std::exp(x[j] - shift));
  return s;
}

// y += c x
inline void axpy(float c, const float* x, float* y, int64_t n) {
  const Vec vc(c);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) at::vec::fmadd(vc, Vec::loadu(x + j), Vec::loadu(y + j)).store(y + j);
  for (; j < n; ++j) y[j] += c * x[j];
}

// Decoding reads a long cache once, row by row, with a little arithmetic per row: the hardware prefetchers do not keep
// up, so each loop asks for the row it reads kAhead rows later (prefetches never fault; the index is clamped anyway).
constexpr int64_t kAhead = 32;

// prefetch every cache line (16 floats) of x[0:n]
inline void prefetch_row(const float* x, int64_t n) {
  for (int64_t e = 0; e < n; e += 16) __builtin_prefetch(x + e);
}

// out[0:n] = sum_j p[j] x[j * ld + 0:n], accumulated in registers (up to 4 vectors wide at a time)
template <int NV>
inline void weighted_rows_vec(const float* p, const float* x, int64_t ld, int64_t rows, float* out) {
  Vec acc[NV];
  for (int k = 0; k < NV; ++k) acc[k] = Vec(0.f);
  for (int64_t j = 0; j < rows; ++j) {
    prefetch_row(x + std::min(j + kAhead, rows - 1) * ld, NV * kLanes);
    const Vec pj(p[j]);
    for (int k = 0; k < NV; ++k) acc[k] = at::vec::fmadd(pj, Vec::loadu(x + j * ld + k * kLanes), acc[k]);
  }
  for (int k = 0; k < NV; ++k) acc[k].store(out + k * kLanes);
}

inline void weighted_rows(const float* p, const float* x, int64_t ld, int64_t rows, int64_t n, float* out) {
  int64_t e = 0;
  for (; e + 4 * kLanes <= n; e += 4 * kLanes) weighted_rows_vec<4>(p, x + e, ld, rows, out + e);
  switch ((n - e) / kLanes) {
    case 3: weighted_rows_vec<3>(p, x + e, ld, rows, out + e); break;
    case 2: weighted_rows_vec<2>(p, x + e, ld, rows, out + e); break;
    case 1: weighted_rows_vec<1>(p, x + e, ld, rows, out + e); break;
    default: break;
  }
  for (e += (n - e) / kLanes * kLanes; e < n; ++e) {
    float acc = 0.f;
    for (int64_t j = 0; j < rows; ++j) acc += p[j] * x[j * ld + e];
    out[e] = acc;
  }
}

// dp = p (dp - D): the softmax backward of one row
inline void softmax_grad(const float* p, float* dp, float D, int64_t n) {
  const Vec vD(D);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) (Vec::loadu(p + j) * (Vec::loadu(dp + j) - vD)).store(dp + j);
  for (; j < n; ++j) dp[j] = p[j] * (dp[j] - D);
}

struct Shapes {
  int64_t B, H, Hkv, n, N, d, R, dr, offset;
  bool causal;
  float scaling, rel_scaling;
  const bool* mask = nullptr;  // optional bool [b or 1, q or 1, kv], True = may attend (on top of `causal`)
  int64_t mask_b = 0, mask_q = 0;
};

// strides (in elements) of a [b, h, t, d] tensor whose last dim is contiguous
struct HeadStrides {
  int64_t b, h, t;
  explicit HeadStrides(const at::Tensor& x) : b(x.stride(0)), h(x.stride(1)), t(x.stride(2)) {}
};
// strides of a [b, t, R, dr] tensor
struct RelStrides {
  int64_t b, t, r;
  explicit RelStrides(const at::Tensor& x) : b(x.stride(0)), t(x.stride(1)), r(x.stride(2)) {}
};

constexpr int64_t kBlockQ = 64;   // receivers per block
constexpr int64_t kBlockK = 256;  // senders per block (scores of one block stay in L2)

inline int64_t visible_end(const Shapes& s, int64_t q0, int64_t m) {
  return s.causal ? std::min(s.N, s.offset + q0 + m) : s.N;
}

// the senders [start, end) that any receiver of the block (batch row b, receivers q0..q0+m) may see: up to the causal
// end, narrowed by the mask to its first and last allowed sender (a band mask then costs its band, not every sender)
inline std::pair<int64_t, int64_t> visible_range(const Shapes& s, int64_t b, int64_t q0, int64_t m) {
  const int64_t end = visible_end(s, q0, m);
  if (!s.mask) return {0, end};
  int64_t first = end, last = -1;
  for (int64_t i = 0; i < (s.mask_q ? m : 1); ++i) {
    const bool* allowed = s.mask + b * s.mask_b + (q0 + i) * s.mask_q;
    for (int64_t j = 0; j < first; ++j)
      if (allowed[j]) { first = j; break; }
    for (int64_t j = end - 1; j > last; --j)
      if (allowed[j]) { last = j; break; }
  }
  if (last < first) return {0, end};  // (nothing visible: every score masked, as without narrowing)
  return {first, last + 1};
}

// -inf above the causal diagonal and where the mask says no, inside a [m, kn] score block of batch row b starting at
// (q0, k0), row stride ld
inline void mask_block(const Shapes& s, int64_t b, float* S, int64_t ld, int64_t q0, int64_t m, int64_t k0,
                       int64_t kn) {
  constexpr float kHidden = -std::numeric_limits<float>::infinity();
  if (s.causal)
    for (int64_t i = 0; i < m; ++i) {
      const int64_t first_hidden = s.offset + q0 + i + 1 - k0;  // columns >= this are future senders
      for (int64_t j = std::max<int64_t>(first_hidden, 0); j < kn; ++j) S[i * ld + j] = kHidden;
    }
  if (s.mask)
    for (int64_t i = 0; i < m; ++i) {
      const bool* allowed = s.mask + b * s.mask_b + (q0 + i) * s.mask_q + k0;
      for (int64_t j = 0; j < kn; ++j)
        if (!allowed[j]) S[i * ld + j] = kHidden;
    }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& qr,
                  const at::Tensor& kr) {
  const char* names[] = {"query", "key", "symbol values", "relation queries", "relation keys"};
  const at::Tensor* tensors[] = {&q, &k, &v, &qr, &kr};
  for (int t = 0; t < 5; ++t) {
    const at::Tensor& x = *tensors[t];
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "relational_attention: ", names[t],
                " must be a float32 CPU tensor, got ", x.scalar_type(), " on ", x.device());
    TORCH_CHECK(x.dim() == 4, "relational_attention: ", names[t], " must be 4-d, got shape ", x.sizes());
    TORCH_CHECK(x.stride(3) == 1 && x.stride(2) >= x.size(3) && x.size(0) == q.size(0), "relational_attention: ",
                names[t], " needs the batch size of the query, a contiguous last dim and rows at least that wide; "
                "got shape ", x.sizes(), " strides ", x.strides());
  }
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(3) == q.size(3) && q.size(1) % k.size(1) == 0,
              "relational_attention: key and symbol values must be [b, h_kv, kv, d] with h divisible by h_kv; got "
              "query ", q.sizes(), " key ", k.sizes(), " symbol values ", v.sizes());
  TORCH_CHECK(qr.size(1) == q.size(2) && kr.size(1) == k.size(2) && qr.size(2) == kr.size(2) &&
              qr.size(3) == kr.size(3), "relational_attention: relation queries [b, q, R, d_r] and keys [b, kv, R, "
              "d_r] do not match query ", q.sizes(), " / key ", k.sizes(), ": got ", qr.sizes(), " and ", kr.sizes());
}

// offset: the first receiver's index among the keys (receiver i at offset + i; `receiver_offset` in Python)
Shapes make_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qr, bool causal, int64_t offset,
                   double scaling, double rel_scaling) {
  Shapes s;
  s.B = q.size(0); s.H = q.size(1); s.n = q.size(2); s.d = q.size(3);
  s.Hkv = k.size(1); s.N = k.size(2); s.R = qr.size(2); s.dr = qr.size(3);
  s.offset = offset; s.causal = causal; s.scaling = (float)scaling; s.rel_scaling = (float)rel_scaling;
  TORCH_CHECK(!causal || s.offset >= 0, "relational_attention: causal attention needs kv_len >= q_len (a receiver "
              "offset >= 0), got offset ", s.offset);
  return s;
}

// the optional mask: bool [b or 1, q or 1, kv] (True = may attend), last dim contiguous
void attach_mask(Shapes& s, const std::optional<at::Tensor>& mask) {
  if (!mask.has_value()) return;
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 3 && (m.size(0) == 1 || m.size(0) == s.B) &&
              (m.size(1) == 1 || m.size(1) == s.n) && m.size(2) == s.N && m.stride(2) == 1, "relational_attention: "
              "the mask must be bool [b or 1, q or 1, kv] = [", s.B, " or 1, ", s.n, " or 1, ", s.N, "] (True = "
              "attend) with a contiguous last dim, got ", m.scalar_type(), " ", m.sizes(), " strides ", m.strides());
  s.mask = m.data_ptr<bool>();
  s.mask_b = m.size(0) > 1 ? m.stride(0) : 0;
  s.mask_q = m.size(1) > 1 ? m.stride(1) : 0;
}

// ---- forward -----------------------------------------------------------------------------------------------------
struct FwdScratch {
  std::vector<float> S, rel, acc_sym, acc_rel, row_max, row_sum;
  explicit FwdScratch(const Shapes& s)
      : S(s.H * kBlockQ * kBlockK), rel(s.R * kBlockQ * kBlockK), acc_sym(s.H * kBlockQ * s.d),
        acc_rel(s.H * kBlockQ * s.R), row_max(s.H * kBlockQ), row_sum(s.H * kBlockQ) {}
};

void forward_block(const Shapes& s, int64_t b, int64_t q0, const float* Q, HeadStrides qs, const float* K, HeadStrides ks,
                   const float* V, HeadStrides vs, const float* QR, RelStrides qrs, const float* KR, RelStrides krs,
                   float* Os, float* Or, float* L, FwdScratch& w) {
  const int64_t m = std::min(kBlockQ, s.n - q0), G = s.H / s.Hkv;
  const auto [start, end] = visible_range(s, b, q0, m);
  std::fill(w.acc_sym.begin(), w.acc_sym.end(), 0.f);
  std::fill(w.acc_rel.begin(), w.acc_rel.end(), 0.f);
  std::fill(w.row_max.begin(), w.row_max.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.row_sum.begin(), w.row_sum.end(), 0.f);
  for (int64_t k0 = start; k0 < end; k0 += kBlockK) {
    const int64_t kn = std::min(kBlockK, end - k0);
    for (int64_t h = 0; h < s.H; ++h) {  // S_h = scaling Q_h K_h^T
      float* S = w.S.data() + h * kBlockQ * kBlockK;
      gemm(false, true, m, kn, s.d, s.scaling, Q + b * qs.b + h * qs.h + q0 * qs.t, qs.t,
           K + b * ks.b + (h / G) * ks.h + k0 * ks.t, ks.t, 0.f, S, kBlockK);
      mask_block(s, b, S, kBlockK, q0, m, k0, kn);
    }
    for (int64_t l = 0; l < s.R; ++l)  // rel_l = rel_scaling QR_l KR_l^T
      gemm(false, true, m, kn, s.dr, s.rel_scaling, QR + b * qrs.b + q0 * qrs.t + l * qrs.r, qrs.t,
           KR + b * krs.b + k0 * krs.t + l * krs.r, krs.t, 0.f, w.rel.data() + l * kBlockQ * kBlockK, kBlockK);
    for (int64_t h = 0; h < s.H; ++h) {  // online softmax: P = exp(S - running max), rescale what was accumulated
      for (int64_t i = 0; i < m; ++i) {
        float* row = w.S.data() + (h * kBlockQ + i) * kBlockK;
        const float mx = row_max(row, kn);
        float& run_max = w.row_max[h * kBlockQ + i];
        const float new_max = std::max(run_max, mx);
        if (new_max == -std::numeric_limits<float>::infinity()) {  // nothing visible yet
          std::fill(row, row + kn, 0.f);
          continue;
        }
        const float corr = std::exp(run_max - new_max);
        run_max = new_max;
        float& run_sum = w.row_sum[h * kBlockQ + i];
        run_sum = run_sum * corr + exp_shifted(row, kn, new_max);
        float* as = w.acc_sym.data() + (h * kBlockQ + i) * s.d;
        float* ar = w.acc_rel.data() + (h * kBlockQ + i) * s.R;
        if (corr != 1.f) {
          for (int64_t c = 0; c < s.d; ++c) as[c] *= corr;
          for (int64_t l = 0; l < s.R; ++l) ar[l] *= corr;
        }
        // acc_rel[h, i, l] += sum_j P[h, i, j] rel_l[i, j]
        for (int64_t l = 0; l < s.R; ++l) ar[l] += dot(row, w.rel.data() + (l * kBlockQ + i) * kBlockK, kn);
      }
      // acc_sym_h += P_h V_h
      gemm(false, false, m, s.d, kn, 1.f, w.S.data() + h * kBlockQ * kBlockK, kBlockK,
           V + b * vs.b + (h / G) * vs.h + k0 * vs.t, vs.t, 1.f, w.acc_sym.data() + h * kBlockQ * s.d, s.d);
    }
  }
  for (int64_t h = 0; h < s.H; ++h)
    for (int64_t i = 0; i < m; ++i) {
      const float sum = w.row_sum[h * kBlockQ + i];
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      float* os = Os + ((b * s.n + q0 + i) * s.H + h) * s.d;
      const float* as = w.acc_sym.data() + (h * kBlockQ + i) * s.d;
      for (int64_t c = 0; c < s.d; ++c) os[c] = as[c] * inv;
      float* orr = Or + ((b * s.n + q0 + i) * s.H + h) * s.R;
      const float* ar = w.acc_rel.data() + (h * kBlockQ + i) * s.R;
      for (int64_t l = 0; l < s.R; ++l) orr[l] = ar[l] * inv;
      // log-sum-exp of the scaled scores (+inf for a receiver without senders: its weights recompute to 0)
      L[(b * s.H + h) * s.n + q0 + i] =
          sum > 0.f ? w.row_max[h * kBlockQ + i] + std::log(sum) : std::numeric_limits<float>::infinity();
    }
}

// receivers' blocks in an order that balances causal work across threads: 0, nb-1, 1, nb-2, ...
inline int64_t balanced_block(int64_t idx, int64_t nb) {
  return (idx % 2 == 0) ? idx / 2 : nb - 1 - idx / 2;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> relational_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& qr, const at::Tensor& kr,
                                                     const std::optional<at::Tensor>& mask, bool causal,
                                                     int64_t offset, double scaling, double rel_scaling) {
  check_inputs(q, k, v, qr, kr);
  Shapes s = make_shapes(q, k, qr, causal, offset, scaling, rel_scaling);
  attach_mask(s, mask);
  auto Os = at::empty({s.B, s.n, s.H, s.d}, q.options());
  auto Or = at::empty({s.B, s.n, s.H, s.R}, q.options());
  auto L = at::empty({s.B, s.H, s.n}, q.options());
  const int64_t nb = (s.n + kBlockQ - 1) / kBlockQ;
  const HeadStrides qs(q), ks(k), vs(v);
  const RelStrides qrs(qr), krs(kr);
  const float *Q = q.data_ptr<float>(), *K = k.data_ptr<float>(), *V = v.data_ptr<float>();
  const float *QR = qr.data_ptr<float>(), *KR = kr.data_ptr<float>();
  float *os = Os.data_ptr<float>(), *orr = Or.data_ptr<float>(), *l = L.data_ptr<float>();
  at::parallel_for(0, s.B * nb, 1, [&](int64_t begin, int64_t end) {
    FwdScratch w(s);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / nb, blk = balanced_block(t % nb, nb);
      forward_block(s, b, blk * kBlockQ, Q, qs, K, ks, V, vs, QR, qrs, KR, krs, os, orr, l, w);
    }
  });
  return std::make_tuple(Os, Or, L);
}

// ---- backward ----------------------------------------------------------------------------------------------------
struct BwdScratch {
  std::vector<float> P, dP, rel, drel, D;
  explicit BwdScratch(const Shapes& s)
      : P(s.H * kBlockQ * kBlockK), dP(s.H * kBlockQ * kBlockK), rel(s.R * kBlockQ * kBlockK),
        drel(s.R * kBlockQ * kBlockK), D(s.H * kBlockQ) {}
};

struct Grads {  // where one worker accumulates: dQ, dQR rows it owns; dK, dV, dKR (its own copy or the output)
  float *dQ, *dK, *dV, *dQR, *dKR;
  HeadStrides dqs, dks, dvs;
  RelStrides dqrs, dkrs;
};

void backward_block(const Shapes& s, int64_t b, int64_t q0, const float* Q, HeadStrides qs, const float* K,
                    HeadStrides ks, const float* V, HeadStrides vs, const float* QR, RelStrides qrs, const float* KR,
                    RelStrides krs, const float* Os, const float* Or, const float* L, const float* Gs, const float* Gr,
                    Grads& g, int64_t gb, BwdScratch& w) {
  // gb: batch index inside the key-side gradient buffers (0 for per-thread buffers of one row)
  const int64_t m = std::min(kBlockQ, s.n - q0), G = s.H / s.Hkv;
  const auto [start, end] = visible_range(s, b, q0, m);
  // D[h, i] = sum_j P dP = <dO_sym, O_sym> + <dO_rel, O_rel>
  for (int64_t h = 0; h < s.H; ++h)
    for (int64_t i = 0; i < m; ++i) {
      const int64_t row = (b * s.n + q0 + i) * s.H + h;
      float acc = 0.f;
      for (int64_t c = 0; c < s.d; ++c) acc += Gs[row * s.d + c] * Os[row * s.d + c];
      for (int64_t l = 0; l < s.R; ++l) acc += Gr[row * s.R + l] * Or[row * s.R + l];
      w.D[h * kBlockQ + i] = acc;
    }
  const int64_t gs_t = s.H * s.d, gr_t = s.H * s.R;  // row strides of dO_sym [b, n, h, d], dO_rel [b, n, h, R]
  const float* gs0 = Gs + (b * s.n + q0) * gs_t;
  const float* gr0 = Gr + (b * s.n + q0) * gr_t;
  for (int64_t k0 = start; k0 < end; k0 += kBlockK) {
    const int64_t kn = std::min(kBlockK, end - k0);
    for (int64_t h = 0; h < s.H; ++h) {
      float* P = w.P.data() + h * kBlockQ * kBlockK;
      gemm(false, true, m, kn, s.d, s.scaling, Q + b * qs.b + h * qs.h + q0 * qs.t, qs.t,
           K + b * ks.b + (h / G) * ks.h + k0 * ks.t, ks.t, 0.f, P, kBlockK);
      mask_block(s, b, P, kBlockK, q0, m, k0, kn);
      for (int64_t i = 0; i < m; ++i) {  // P = exp(S - lse)
        float* row = P + i * kBlockK;
        const float lse = L[(b * s.H + h) * s.n + q0 + i];
        exp_shifted(row, kn, lse);
      }
      // dP_h = dO_sym_h V_h^T
      gemm(false, true, m, kn, s.d, 1.f, gs0 + h * s.d, gs_t, V + b * vs.b + (h / G) * vs.h + k0 * vs.t, vs.t, 0.f,
           w.dP.data() + h * kBlockQ * kBlockK, kBlockK);
    }
    for (int64_t l = 0; l < s.R; ++l)
      gemm(false, true, m, kn, s.dr, s.rel_scaling, QR + b * qrs.b + q0 * qrs.t + l * qrs.r, qrs.t,
           KR + b * krs.b + k0 * krs.t + l * krs.r, krs.t, 0.f, w.rel.data() + l * kBlockQ * kBlockK, kBlockK);
    for (int64_t i = 0; i < m; ++i) {
      const float* gr = gr0 + i * gr_t;  // dO_rel[i] as [h, R]
      // drel_l[i, j] = sum_h P[h, i, j] dO_rel[i, h, l]
      for (int64_t l = 0; l < s.R; ++l) {
        float* dr = w.drel.data() + (l * kBlockQ + i) * kBlockK;
        std::fill(dr, dr + kn, 0.f);
        for (int64_t h = 0; h < s.H; ++h) axpy(gr[h * s.R + l], w.P.data() + (h * kBlockQ + i) * kBlockK, dr, kn);
      }
      // dP[h, i, j] += sum_l dO_rel[i, h, l] rel_l[i, j];  dS = P (dP - D)  (stored in dP)
      for (int64_t h = 0; h < s.H; ++h) {
        float* dp = w.dP.data() + (h * kBlockQ + i) * kBlockK;
        for (int64_t l = 0; l < s.R; ++l) axpy(gr[h * s.R + l], w.rel.data() + (l * kBlockQ + i) * kBlockK, dp, kn);
        softmax_grad(w.P.data() + (h * kBlockQ + i) * kBlockK, dp, w.D[h * kBlockQ + i], kn);
      }
    }
    for (int64_t h = 0; h < s.H; ++h) {
      const float* P = w.P.data() + h * kBlockQ * kBlockK;
      const float* dS = w.dP.data() + h * kBlockQ * kBlockK;
      const int64_t hk = h / G;
      // dQ_h += scaling dS K_h ; dK_h += scaling dS^T Q_h ; dV_h += P^T dO_sym_h
      gemm(false, false, m, s.d, kn, s.scaling, dS, kBlockK, K + b * ks.b + hk * ks.h + k0 * ks.t, ks.t, 1.f,
           g.dQ + b * g.dqs.b + h * g.dqs.h + q0 * g.dqs.t, g.dqs.t);
      gemm(true, false, kn, s.d, m, s.scaling, dS, kBlockK, Q + b * qs.b + h * qs.h + q0 * qs.t, qs.t, 1.f,
           g.dK + gb * g.dks.b + hk * g.dks.h + k0 * g.dks.t, g.dks.t);
      gemm(true, false, kn, s.d, m, 1.f, P, kBlockK, gs0 + h * s.d, gs_t, 1.f,
           g.dV + gb * g.dvs.b + hk * g.dvs.h + k0 * g.dvs.t, g.dvs.t);
    }
    for (int64_t l = 0; l < s.R; ++l) {
      const float* dr = w.drel.data() + l * kBlockQ * kBlockK;
      gemm(false, false, m, s.dr, kn, s.rel_scaling, dr, kBlockK, KR + b * krs.b + k0 * krs.t + l * krs.r, krs.t, 1.f,
           g.dQR + b * g.dqrs.b + q0 * g.dqrs.t + l * g.dqrs.r, g.dqrs.t);
      gemm(true, false, kn, s.dr, m, s.rel_scaling, dr, kBlockK, QR + b * qrs.b + q0 * qrs.t + l * qrs.r, qrs.t, 1.f,
           g.dKR + gb * g.dkrs.b + k0 * g.dkrs.t + l * g.dkrs.r, g.dkrs.t);
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> relational_attention_backward(const at::Tensor& grad_sym_in, const at::Tensor& grad_rel_in,
                                                      const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const at::Tensor& qr, const at::Tensor& kr,
                                                      const at::Tensor& out_sym, const at::Tensor& out_rel,
                                                      const at::Tensor& lse, const std::optional<at::Tensor>& mask,
                                                      bool causal, int64_t offset, double scaling,
                                                      double rel_scaling) {
  check_inputs(q, k, v, qr, kr);
  Shapes s = make_shapes(q, k, qr, causal, offset, scaling, rel_scaling);
  attach_mask(s, mask);
  const at::Tensor Gs = grad_sym_in.contiguous(), Gr = grad_rel_in.contiguous();
  TORCH_CHECK(Gs.sizes() == out_sym.sizes() && Gr.sizes() == out_rel.sizes() && out_sym.is_contiguous() &&
              out_rel.is_contiguous() && lse.is_contiguous() && Gs.scalar_type() == at::kFloat &&
              Gr.scalar_type() == at::kFloat, "relational_attention_backward: gradients ", Gs.sizes(), " / ",
              Gr.sizes(), " do not match the forward outputs ", out_sym.sizes(), " / ", out_rel.sizes());
  auto dQ = at::zeros({s.B, s.H, s.n, s.d}, q.options());
  auto dK = at::zeros({s.B, s.Hkv, s.N, s.d}, q.options());
  auto dV = at::zeros({s.B, s.Hkv, s.N, s.d}, q.options());
  auto dQR = at::zeros({s.B, s.n, s.R, s.dr}, q.options());
  auto dKR = at::zeros({s.B, s.N, s.R, s.dr}, q.options());
  const int64_t nb = (s.n + kBlockQ - 1) / kBlockQ;
  const HeadStrides qs(q), ks(k), vs(v);
  const RelStrides qrs(qr), krs(kr);
  const float *Q = q.data_ptr<float>(), *K = k.data_ptr<float>(), *V = v.data_ptr<float>();
  const float *QR = qr.data_ptr<float>(), *KR = kr.data_ptr<float>();
  const float *os = out_sym.data_ptr<float>(), *orr = out_rel.data_ptr<float>(), *L = lse.data_ptr<float>();
  const float *gs = Gs.data_ptr<float>(), *gr = Gr.data_ptr<float>();
  const int threads = at::get_num_threads();
  if (s.B >= threads || threads == 1) {
    // whole batch rows per worker: every gradient is written in place
    at::parallel_for(0, s.B, 1, [&](int64_t begin, int64_t end) {
      BwdScratch w(s);
      Grads g{dQ.data_ptr<float>(), dK.data_ptr<float>(), dV.data_ptr<float>(), dQR.data_ptr<float>(),
              dKR.data_ptr<float>(), HeadStrides(dQ), HeadStrides(dK), HeadStrides(dV), RelStrides(dQR),
              RelStrides(dKR)};
      for (int64_t b = begin; b < end; ++b)
        for (int64_t blk = 0; blk < nb; ++blk)
          backward_block(s, b, blk * kBlockQ, Q, qs, K, ks, V, vs, QR, qrs, KR, krs, os, orr, L, gs, gr, g, b, w);
    });
  } else {
    // fewer rows than threads: split each row's receiver blocks; key-side gradients go to per-worker buffers
    auto kbuf = at::zeros({threads, s.Hkv, s.N, s.d}, q.options());
    auto vbuf = at::zeros({threads, s.Hkv, s.N, s.d}, q.options());
    auto krbuf = at::zeros({threads, s.N, s.R, s.dr}, q.options());
    for (int64_t b = 0; b < s.B; ++b) {
      if (b > 0) { kbuf.zero_(); vbuf.zero_(); krbuf.zero_(); }
      std::vector<char> used(threads, 0);
      at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
        const int tid = at::get_thread_num();
        used[tid] = 1;
        BwdScratch w(s);
        Grads g{dQ.data_ptr<float>(), kbuf.data_ptr<float>() + tid * kbuf.stride(0),
                vbuf.data_ptr<float>() + tid * vbuf.stride(0), dQR.data_ptr<float>(),
                krbuf.data_ptr<float>() + tid * krbuf.stride(0), HeadStrides(dQ), HeadStrides(kbuf),
                HeadStrides(vbuf), RelStrides(dQR), RelStrides(krbuf)};
        // per-thread buffers: batch stride unused (gb = 0), the pointer already selects the worker's slice
        for (int64_t t = begin; t < end; ++t)
          backward_block(s, b, balanced_block(t, nb) * kBlockQ, Q, qs, K, ks, V, vs, QR, qrs, KR, krs, os, orr, L,
                         gs, gr, g, 0, w);
      });
      for (int t = 0; t < threads; ++t)
        if (used[t]) {
          dK[b].add_(kbuf[t]);
          dV[b].add_(vbuf[t]);
          dKR[b].add_(krbuf[t]);
        }
    }
  }
  return std::make_tuple(dQ, dK, dV, dQR, dKR);
}

// ---- decoding: one receiver per row, the relational heads' whole step --------------------------------------------
// out[b, h] = sum_j p_hj v_j + sum_l (sum_j p_hj rel_jl) W_r[h, :, l],  rel_jl = rel_scaling <q_rel_l, k_rel_jl>.
// The relations do not depend on the head: computed once per (batch row, sender), then shared by every head.
// mask (optional, bool [b or 1, 1, kv], True = may attend): e.g. left padding; a row without senders gets 0. Each row
// reads only the senders from the first to the last its mask allows (a static cache's empty slots, a sliding window).
at::Tensor relational_attention_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& qr, const at::Tensor& kr, const at::Tensor& wr,
                                       const std::optional<at::Tensor>& mask, double scaling, double rel_scaling) {
  check_inputs(q, k, v, qr, kr);
  TORCH_CHECK(q.size(2) == 1, "relational_attention_decode: one receiver per row, got query ", q.sizes());
  TORCH_CHECK(wr.dim() == 3 && wr.is_contiguous() && wr.scalar_type() == at::kFloat && wr.size(0) == q.size(1) &&
              wr.size(1) == q.size(3) && wr.size(2) == qr.size(2), "relational_attention_decode: relation_proj must "
              "be a contiguous float32 [h, d_h, R] tensor, got ", wr.sizes());
  Shapes s = make_shapes(q, k, qr, false, 0, scaling, rel_scaling);  // (no causal order: no offset needed)
  attach_mask(s, mask);
  const int64_t G = s.H / s.Hkv;
  auto out = at::empty({s.B, 1, s.H, s.d}, q.options());
  auto rel = at::empty({s.B, s.N, s.R}, q.options());
  const HeadStrides qs(q), ks(k), vs(v);
  const RelStrides qrs(qr), krs(kr);
  const float *Q = q.data_ptr<float>(), *K = k.data_ptr<float>(), *V = v.data_ptr<float>();
  const float *QR = qr.data_ptr<float>(), *KR = kr.data_ptr<float>(), *W = wr.data_ptr<float>();
  float *O = out.data_ptr<float>(), *REL = rel.data_ptr<float>();
  // senders [lo[b], hi[b]) of each row: from the first to the last its mask allows (all without a mask)
  std::vector<int64_t> lo(s.B, 0), hi(s.B, s.N);
  if (s.mask)
    for (int64_t b = 0; b < s.B; ++b) {
      const bool* allowed = s.mask + b * s.mask_b;
      while (hi[b] > 0 && !allowed[hi[b] - 1]) --hi[b];
      while (lo[b] < hi[b] && !allowed[lo[b]]) ++lo[b];
    }
  // rel[b, l, j] = rel_scaling <q_rel[b, l], k_rel[b, j, l]>  (sender-contiguous, for the dots below)
  at::parallel_for(0, s.B * s.N, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / s.N, j = t % s.N;
      if (j < lo[b] || j >= hi[b]) continue;
      const float *qr_b = QR + b * qrs.b, *kr_j = KR + b * krs.b + j * krs.t;
      prefetch_row(KR + b * krs.b + std::min(j + kAhead, hi[b] - 1) * krs.t, (s.R - 1) * krs.r + s.dr);
      for (int64_t l = 0; l < s.R; ++l)
        REL[(b * s.R + l) * s.N + j] = s.rel_scaling * dot(qr_b + l * qrs.r, kr_j + l * krs.r, s.dr);
    }
  });
  // per (row, query head): scores, softmax, the weighted sum of symbol values and of each relation
  at::parallel_for(0, s.B * s.H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(s.N), agg_rel(s.R);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / s.H, h = t % s.H, g = h / G, j0 = lo[b], n = hi[b] - lo[b];
      const float *qh = Q + b * qs.b + h * qs.h, *kg = K + b * ks.b + g * ks.h + j0 * ks.t;
      const float* vg = V + b * vs.b + g * vs.h + j0 * vs.t;
      float* o = O + t * s.d;
      for (int64_t j = 0; j < n; ++j) {
        prefetch_row(kg + std::min(j + kAhead, n - 1) * ks.t, s.d);
        p[j] = s.scaling * dot(qh, kg + j * ks.t, s.d);
      }
      if (s.mask) {
        const bool* allowed = s.mask + b * s.mask_b + j0;
        for (int64_t j = 0; j < n; ++j)
          if (!allowed[j]) p[j] = -std::numeric_limits<float>::infinity();
      }
      if (n == 0) {  // no sender: a zero message
        std::fill(o, o + s.d, 0.f);
        continue;
      }
      const float mx = row_max(p.data(), n);  // (finite: the first and last sender in range are allowed)
      const float inv = 1.f / exp_shifted(p.data(), n, mx);
      weighted_rows(p.data(), vg, vs.t, n, s.d, o);
      for (int64_t l = 0; l < s.R; ++l) agg_rel[l] = dot(p.data(), REL + (b * s.R + l) * s.N + j0, n);
      const float* w = W + h * s.d * s.R;  // W_r[h] is [d_h, R]
      for (int64_t e = 0; e < s.d; ++e) o[e] = (o[e] + dot(w + e * s.R, agg_rel.data(), s.R)) * inv;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dat_hf, m) {
  m.def("relational_attention_forward(Tensor q, Tensor k, Tensor v, Tensor q_rel, Tensor k_rel, Tensor? mask, "
        "bool causal, int offset, float scaling, float relation_scaling) -> (Tensor, Tensor, Tensor)");
  m.def("relational_attention_backward(Tensor grad_symbols, Tensor grad_relations, Tensor q, Tensor k, Tensor v, "
        "Tensor q_rel, Tensor k_rel, Tensor symbols, Tensor relations, Tensor lse, Tensor? mask, bool causal, "
        "int offset, float scaling, float relation_scaling) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("relational_attention_decode(Tensor q, Tensor k, Tensor v, Tensor q_rel, Tensor k_rel, Tensor relation_proj, "
        "Tensor? mask, float scaling, float relation_scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(dat_hf, CPU, m) {
  m.impl("relational_attention_forward", &relational_attention_forward);
  m.impl("relational_attention_backward", &relational_attention_backward);
  m.impl("relational_attention_decode", &relational_attention_decode);
}

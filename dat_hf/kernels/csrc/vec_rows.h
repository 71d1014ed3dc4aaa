// Row helpers on at::vec (AVX512 / AVX2 / scalar per build flags) shared by the kernels' sources; tails are scalar.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>

namespace dat_hf_vec {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

inline float horizontal_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& x, const Vec& y) { return x + y; }, v);  // shuffles, not a store
}

// <a, b> over n elements
inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) acc = at::vec::fmadd(Vec::loadu(a + j), Vec::loadu(b + j), acc);
  float s = horizontal_sum(acc);
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

}  // namespace dat_hf_vec

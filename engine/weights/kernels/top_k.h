// Part of ggml_dot.cpp, included inside its namespace after attend_one.h (bf16x8).
#pragma once

// -- each row's k largest values (the fast head's top logits, the view's candidates) ----------

// Entries a block: the k largest of a row lie in blocks whose maximum is at least the k-th
// largest block maximum (k such blocks each hold an entry that large), so one vectorised pass
// finds the block maxima and a second reads the few blocks that can hold the k largest.
constexpr int64_t TOP_BLOCK = 128;

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float block_max(const float* p) {
  __m256 m = _mm256_loadu_ps(p);
  for (int64_t i = 8; i < TOP_BLOCK; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(p + i));
  return hmax(m);
}

inline float block_max(const at::BFloat16* p) {
  __m256 m = bf16x8(p);
  for (int64_t i = 8; i < TOP_BLOCK; i += 8) m = _mm256_max_ps(m, bf16x8(p + i));
  return hmax(m);
}

// Indices of the k largest of x[0, size), largest first; among equal values the lower index
// first. Every value must compare (no NaN).
template <typename T>
void top_k_row(const T* x, int64_t size, int64_t k, int64_t* out) {
  const int64_t blocks = size / TOP_BLOCK;
  std::vector<float> maxima(blocks);
  for (int64_t b = 0; b < blocks; ++b) maxima[b] = block_max(x + b * TOP_BLOCK);
  float threshold = -INFINITY;  // with fewer blocks than k, every entry is a candidate
  if (blocks >= k) {
    std::vector<float> order(maxima);
    std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), std::greater<float>());
    threshold = order[k - 1];
  }
  std::vector<std::pair<float, int64_t>> kept;
  auto collect = [&](int64_t from, int64_t to) {
    for (int64_t i = from; i < to; ++i) {
      const float v = static_cast<float>(x[i]);
      if (v >= threshold) kept.emplace_back(v, i);
    }
  };
  for (int64_t b = 0; b < blocks; ++b)
    if (maxima[b] >= threshold) collect(b * TOP_BLOCK, (b + 1) * TOP_BLOCK);
  collect(blocks * TOP_BLOCK, size);  // a tail shorter than a block
  TORCH_CHECK(static_cast<int64_t>(kept.size()) >= k, "top_k_rows: a row has NaN among its values");
  std::partial_sort(kept.begin(), kept.begin() + k, kept.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  for (int64_t j = 0; j < k; ++j) out[j] = kept[j].second;
}

// values [n, size] float32 or bf16 -> [n, k] int64: each row's k largest, largest first.
at::Tensor top_k_rows(const at::Tensor& values, int64_t k) {
  TORCH_CHECK(values.dim() == 2, "values must be 2-D");
  TORCH_CHECK(values.scalar_type() == at::kFloat || values.scalar_type() == at::kBFloat16,
              "values must be float32 or bf16");
  const int64_t n = values.size(0), size = values.size(1);
  TORCH_CHECK(k >= 1 && k <= size, "k must be within 1 and the row's length");
  const at::Tensor v = values.contiguous();
  at::Tensor out = at::empty({n, k}, v.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    if (v.scalar_type() == at::kFloat)
      top_k_row(v.data_ptr<float>() + r * size, size, k, o + r * k);
    else
      top_k_row(v.data_ptr<at::BFloat16>() + r * size, size, k, o + r * k);
  }
  return out;
}

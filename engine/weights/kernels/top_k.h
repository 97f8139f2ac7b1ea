// Part of ggml_dot.cpp, included inside its namespace after attend_one.h (bf16x8,
// exp_nonpositive) and its helpers (hsum).
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

// 8 values as 8 floats, float32 or bf16.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) { return bf16x8(p); }

template <typename T>
float block_max(const T* p) {
  __m256 m = load8(p);
  for (int64_t i = 8; i < TOP_BLOCK; i += 8) m = _mm256_max_ps(m, load8(p + i));
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
  TORCH_CHECK(static_cast<int64_t>(kept.size()) >= k,
              "top_k_rows: NaN among a row's values (logits that are not numbers)");
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

// Row r's k largest (into indices[r]) and their softmax probabilities over the whole row (into
// probs[r]). row: float32 [size].
void softmax_top_k(const at::Tensor& row, int64_t k, at::Tensor& indices, at::Tensor& probs,
                   int64_t r) {
  const int64_t size = row.size(0);
  const float* x = row.data_ptr<float>();
  int64_t* top = indices.data_ptr<int64_t>() + r * k;
  top_k_row(x, size, k, top);
  const float largest = x[top[0]];
  TORCH_CHECK(std::isfinite(largest), "top_k_softmax: a row's largest value is not finite");
  // Σ e^(x - largest): eight lanes over each block, the blocks' sums added in double (a
  // float sum of a whole vocabulary drifts by ~1e-6 of it); the tail one by one
  const __m256 shift = _mm256_set1_ps(largest);
  double total = 0.0;
  int64_t i = 0;
  for (; i + TOP_BLOCK <= size; i += TOP_BLOCK) {
    __m256 sums = _mm256_setzero_ps();
    for (int64_t j = i; j < i + TOP_BLOCK; j += 8)
      sums = _mm256_add_ps(sums, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + j), shift)));
    total += hsum(sums);
  }
  for (; i < size; ++i) total += std::exp(static_cast<double>(x[i]) - largest);
  const double log_total = largest + std::log(total);
  float* p = probs.data_ptr<float>() + r * k;
  for (int64_t j = 0; j < k; ++j) p[j] = static_cast<float>(std::exp(x[top[j]] - log_total));
}

// Each row's k largest (indices [n, k] int64, largest first) and their softmax probabilities
// over the whole row (float32 [n, k]): the view's candidates, without a copy of the rows into
// one tensor or a softmax written over every entry. rows: float32 [size] each, shared among
// torch's threads (idle between two decode steps, when a batch's candidates are worked out).
std::tuple<at::Tensor, at::Tensor> top_k_softmax(at::TensorList rows, int64_t k) {
  const int64_t n = static_cast<int64_t>(rows.size());
  TORCH_CHECK(n >= 1, "top_k_softmax: no rows");
  at::Tensor indices = at::empty({n, k}, rows[0].options().dtype(at::kLong));
  at::Tensor probs = at::empty({n, k}, rows[0].options().dtype(at::kFloat));
  std::vector<at::Tensor> kept;
  for (const at::Tensor& row : rows) {
    TORCH_CHECK(row.dim() == 1 && row.scalar_type() == at::kFloat, "rows must be float32 1-D");
    TORCH_CHECK(k >= 1 && k <= row.size(0), "k must be within 1 and the row's length");
    kept.push_back(row.contiguous());
  }
  // a check that fails in a thread is rethrown here by parallel_for
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) softmax_top_k(kept[r], k, indices, probs, r);
  });
  return {indices, probs};
}

// A sampled step's filters (engine/generate/sampling.py, `_within`) in one call:
// scores = logits / temperature; top-k's k largest when no other score equals the k-th;
// top-p over them (their softmax ascending, cumulative sums, those at most 1 - p dropped, the
// largest always kept); the softmax of what is kept. Returns the probabilities over the whole
// vocabulary and top-k's tokens, ascending (the support the draw is made among), or two empty
// tensors where a score ties with the k-th (the caller's general path keeps every tie).
std::tuple<at::Tensor, at::Tensor> sample_filter(const at::Tensor& logits, double temperature,
                                                 int64_t k, double p) {
  TORCH_CHECK(logits.dim() == 1 && logits.scalar_type() == at::kFloat,
              "sample_filter: logits must be float32 1-D");
  const int64_t size = logits.size(0);
  TORCH_CHECK(k >= 1 && k < size, "sample_filter: k must be within 1 and the length - 1");
  const at::Tensor x = logits.contiguous();
  const float* raw = x.data_ptr<float>();
  const float t = static_cast<float>(temperature);
  static thread_local std::vector<float> scores;  // kept: no fresh pages every step
  scores.resize(size);
  for (int64_t i = 0; i < size; ++i) scores[i] = raw[i] / t;  // torch's `scores / t`
  std::vector<int64_t> top(k + 1);
  top_k_row(scores.data(), size, k + 1, top.data());
  if (!(scores[top[k]] < scores[top[k - 1]]))  // a tie at the edge
    return {at::empty({0}, x.options()), at::empty({0}, x.options().dtype(at::kLong))};
  // e^(score - largest) of the k, largest first
  const float largest = scores[top[0]];
  std::vector<float> shares(k);
  for (int64_t j = 0; j < k; ++j) shares[j] = std::exp(scores[top[j]] - largest);
  // top-p: those shares ascending, over their sum, added up (as keep_top_p)
  int64_t count = k;
  if (p < 1.0) {
    double total = 0.0;
    for (int64_t j = k - 1; j >= 0; --j) total += shares[j];
    const float limit = static_cast<float>(1.0 - p);
    double running = 0.0;
    int64_t dropped = 0;
    for (int64_t j = k - 1; j > 0; --j) {  // the largest is never dropped
      running += shares[j] / total;
      if (static_cast<float>(running) > limit) break;
      ++dropped;
    }
    count = k - dropped;
  }
  double total = 0.0;
  for (int64_t j = 0; j < count; ++j) total += shares[j];
  at::Tensor probs = at::zeros({size}, x.options());
  float* out = probs.data_ptr<float>();
  for (int64_t j = 0; j < count; ++j) out[top[j]] = static_cast<float>(shares[j] / total);
  std::vector<int64_t> support(top.begin(), top.begin() + k);
  std::sort(support.begin(), support.end());
  at::Tensor kept = at::empty({k}, x.options().dtype(at::kLong));
  std::copy(support.begin(), support.end(), kept.data_ptr<int64_t>());
  return {probs, kept};
}

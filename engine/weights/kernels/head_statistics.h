// Part of ggml_dot.cpp, included inside its namespace after attend_one.h and top_k.h (hmax,
// load8).
#pragma once

// -- per-head statistics of attention rows (the view's overview) -----------------------------

// ln x for x > 0, eight at a time (Cephes' polynomial, as avx_mathfun); x below the smallest
// normal float is taken as it, so 0 · ln 0 comes out 0.
inline __m256 log_positive(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.f);
  x = _mm256_max_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x00800000)));
  __m256i exponent_bits = _mm256_srli_epi32(_mm256_castps_si256(x), 23);
  x = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(~0x7f800000)));
  x = _mm256_or_ps(x, _mm256_set1_ps(0.5f));  // the mantissa, in [0.5, 1)
  __m256 e = _mm256_add_ps(
      _mm256_cvtepi32_ps(_mm256_sub_epi32(exponent_bits, _mm256_set1_epi32(0x7f))), one);
  const __m256 small = _mm256_cmp_ps(x, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OS);
  const __m256 doubled = _mm256_and_ps(x, small);
  x = _mm256_sub_ps(x, one);
  e = _mm256_sub_ps(e, _mm256_and_ps(one, small));
  x = _mm256_add_ps(x, doubled);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(7.0376836292E-2f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-1.1514610310E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.1676998740E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-1.2420140846E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.4249322787E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-1.6668057665E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(2.0000714765E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-2.4999993993E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(3.3333331174E-1f));
  y = _mm256_mul_ps(_mm256_mul_ps(y, x), z);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), y);
  return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(x, y));
}

// rows: float32 [heads, keys] each (a step's attention rows of one layer; keys may differ
// between steps) -> [n, 2, heads]: each head's largest weight, and its entropy -Σ w·ln w over
// ln(max(keys, 2)), the entropy of an even spread over as many keys.
at::Tensor head_statistics(at::TensorList rows) {
  const int64_t n = static_cast<int64_t>(rows.size());
  TORCH_CHECK(n >= 1, "head_statistics: no rows");
  const int64_t heads = rows[0].size(0);
  at::Tensor out = at::empty({n, 2, heads}, rows[0].options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    at::Tensor row = rows[r];
    TORCH_CHECK(row.dim() == 2 && row.size(0) == heads && row.scalar_type() == at::kFloat,
                "head_statistics: rows must be float32 [heads, keys], as many heads each");
    if (row.stride(1) != 1) row = row.contiguous();
    const int64_t keys = row.size(1);
    const float scale = 1.f / std::log(static_cast<float>(std::max<int64_t>(keys, 2)));
    for (int64_t h = 0; h < heads; ++h) {
      const float* w = row.data_ptr<float>() + h * row.stride(0);
      __m256 top = _mm256_setzero_ps(), plogp = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= keys; i += 8) {
        const __m256 v = _mm256_loadu_ps(w + i);
        top = _mm256_max_ps(top, v);
        plogp = _mm256_fmadd_ps(v, log_positive(v), plogp);
      }
      float largest = hmax(top), entropy = -hsum(plogp);
      for (; i < keys; ++i) {
        largest = std::max(largest, w[i]);
        if (w[i] > 0.f) entropy -= w[i] * std::log(w[i]);
      }
      o[(r * 2) * heads + h] = largest;
      o[(r * 2 + 1) * heads + h] = entropy * scale;
    }
  }
  return out;
}

// -- a batch's watched attention rows (the view's weigh) ---------------------------------------

// Scores of one query row q [d] (float) over keys [visible, d] (row stride `stride`), times
// `scale`, softmaxed into w[0, visible).
template <typename K>
void softmax_row(const float* q, const K* keys, int64_t stride, int64_t d, int64_t visible,
                 float scale, float* w) {
  float largest = -INFINITY;
  for (int64_t t = 0; t < visible; ++t) {
    const K* k = keys + t * stride;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), acc);
    w[t] = hsum(acc) * scale;
    largest = std::max(largest, w[t]);
  }
  double total = 0.0;
  for (int64_t t = 0; t < visible; ++t) total += (w[t] = std::exp(w[t] - largest));
  const float inverse = static_cast<float>(1.0 / total);
  for (int64_t t = 0; t < visible; ++t) w[t] *= inverse;
}

// softmax(q·kᵀ·scale) of the last `rows` queries of query [1, heads, q_len, d] over key
// [1, kv_heads, keys, d], causally (query j of them sits at position keys - rows + j):
// [heads, rows, keys] float32, zero past each query. d a multiple of 8.
at::Tensor causal_rows(const at::Tensor& query, const at::Tensor& key, double scaling, int64_t rows) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4, "causal_rows: query and key must be 4-D");
  const int64_t heads = query.size(1), q_len = query.size(2), d = query.size(3);
  const int64_t kv_heads = key.size(1), keys = key.size(2);
  TORCH_CHECK(key.size(3) == d && d % 8 == 0 && heads % kv_heads == 0, "causal_rows: shapes");
  TORCH_CHECK(rows >= 1 && rows <= q_len && rows <= keys, "causal_rows: rows");
  TORCH_CHECK(key.scalar_type() == at::kBFloat16 || key.scalar_type() == at::kFloat,
              "causal_rows: keys must be bf16 or float32");
  const at::Tensor q = query[0].narrow(1, q_len - rows, rows).to(at::kFloat).contiguous();
  const at::Tensor k = key[0].stride(2) == 1 ? key[0] : key[0].contiguous();
  at::Tensor out = at::zeros({heads, rows, keys}, query.options().dtype(at::kFloat));
  const int64_t group = heads / kv_heads;
  const float scale = static_cast<float>(scaling);
  at::parallel_for(0, heads * rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / rows, j = task % rows, visible = keys - rows + j + 1;
      const float* qrow = q.data_ptr<float>() + (h * rows + j) * d;
      float* w = out.data_ptr<float>() + (h * rows + j) * keys;
      const int64_t kv = h / group;
      if (k.scalar_type() == at::kBFloat16)
        softmax_row(qrow, k.data_ptr<at::BFloat16>() + kv * k.stride(0), k.stride(1), d, visible, scale, w);
      else
        softmax_row(qrow, k.data_ptr<float>() + kv * k.stride(0), k.stride(1), d, visible, scale, w);
    }
  });
  return out;
}

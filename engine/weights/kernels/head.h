// Part of ggml_dot.cpp, included inside its namespace after top_k.h (top_k_row, hmax) and
// dequantize_row.
#pragma once

// -- the fast head's logits, and greedy's argmax ---------------------------------------------

// The index of the first largest of x[0, size), as torch's argmax takes it: a NaN is larger
// than any number (the first NaN's index then). One pass for the maximum, one to its first place.
int64_t first_largest(const float* x, int64_t size) {
  __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= size; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top = _mm256_max_ps(top, v);
  }
  bool nan = _mm256_movemask_ps(unordered) != 0;
  float largest = hmax(top);
  for (; i < size; ++i) {
    if (std::isnan(x[i])) nan = true;
    else largest = std::max(largest, x[i]);
  }
  const __m256 wanted = _mm256_set1_ps(largest);
  for (i = 0; i + 8 <= size; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 hit = nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, wanted, _CMP_EQ_OQ);
    const int mask = _mm256_movemask_ps(hit);
    if (mask) return i + __builtin_ctz(mask);
  }
  for (; i < size; ++i)
    if (nan ? std::isnan(x[i]) : x[i] == largest) return i;
  return 0;  // not reached: the maximum is one of the values
}

// values [V] float32 -> a 0-d int64 tensor, as Tensor.argmax.
at::Tensor first_largest_of(const at::Tensor& values) {
  TORCH_CHECK(values.dim() == 1 && values.size(0) >= 1, "values must be 1-D and not empty");
  TORCH_CHECK(values.scalar_type() == at::kFloat, "values must be float32");
  const at::Tensor v = values.contiguous();
  return at::scalar_tensor(first_largest(v.data_ptr<float>(), v.size(0)),
                           v.options().dtype(at::kLong));
}

// Σ w[i]·x[i] over `size` floats, in double.
double dot_double(const float* w, const float* x, int64_t size) {
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= size; i += 8) {
    const __m256 product_w = _mm256_loadu_ps(w + i), product_x = _mm256_loadu_ps(x + i);
    low = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(product_w)),
                          _mm256_cvtps_pd(_mm256_castps256_ps128(product_x)), low);
    high = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(product_w, 1)),
                           _mm256_cvtps_pd(_mm256_extractf128_ps(product_x, 1)), high);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(low, high));
  double total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < size; ++i) total += static_cast<double>(w[i]) * x[i];
  return total;
}

// The fast head's logits [n, V] float32: each row of `bulk` [n, V] (the 4-bit product's,
// float32 or bf16) with its k largest replaced by their exact products, the rows of `raw`
// ([V, row bytes], any type the kernels read, dequantised as gguf does) each times x [n, dim]
// in double.
// One call where the torch way is the top k, a gather, a dequantisation, a batched product, a
// copy to float32 and a scatter; each row is worked out alone (a batch's rows equal one's).
at::Tensor exact_head(const at::Tensor& bulk, const at::Tensor& raw, int64_t qtype,
                      const at::Tensor& x, int64_t k) {
  TORCH_CHECK(bulk.dim() == 2 && x.dim() == 2 && bulk.size(0) == x.size(0),
              "bulk [n, V] and x [n, dim] must have the same rows");
  const int64_t n = bulk.size(0), vocab = bulk.size(1), dim = x.size(1);
  TORCH_CHECK(raw.size(0) == vocab, "raw must hold one row a logit");
  TORCH_CHECK(k >= 1 && k <= vocab, "k must be within 1 and the vocabulary");
  check(raw, qtype, dim);
  at::Tensor out = at::empty({n, vocab}, bulk.options().dtype(at::kFloat));
  out.copy_(bulk);  // a copy even of float32: the caller's product is not written into
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor rows = raw.contiguous();
  float* o = out.data_ptr<float>();
  const uint8_t* r = rows.data_ptr<uint8_t>();
  const int64_t row_bytes = rows.size(1);
  std::vector<int64_t> top(k);
  std::vector<float> exact(k), weights(dim);
  for (int64_t i = 0; i < n; ++i) {
    float* logits = o + i * vocab;
    const float* activations = xf.data_ptr<float>() + i * dim;
    top_k_row(logits, vocab, k, top.data());
    for (int64_t j = 0; j < k; ++j) {  // all k found before any is replaced
      dequantize_row(qtype, r + top[j] * row_bytes, dim, weights.data());
      exact[j] = static_cast<float>(dot_double(weights.data(), activations, dim));
    }
    for (int64_t j = 0; j < k; ++j) logits[top[j]] = exact[j];
  }
  return out;
}

// Rows `index` [n] (int64) of `raw` ([rows, row bytes], any type the kernels read) as float32
// [n, columns], the values gguf's dequantize computes: the embedding's lookups, in one call.
at::Tensor ggml_rows(const at::Tensor& raw, const at::Tensor& index, int64_t qtype,
                     int64_t columns) {
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "index must be 1-D int64");
  check(raw, qtype, columns);
  const at::Tensor rows = raw.contiguous(), ids = index.contiguous();
  const int64_t n = ids.size(0), count = rows.size(0), row_bytes = rows.size(1);
  at::Tensor out = at::empty({n, columns}, rows.options().dtype(at::kFloat));
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < count, "ggml_rows: index ", id[i], " out of range");
    dequantize_row(qtype, rows.data_ptr<uint8_t>() + id[i] * row_bytes, columns,
                   out.data_ptr<float>() + i * columns);
  }
  return out;
}

// Each row of x [n, dim] float32 RMS-normalised and scaled by weight [dim], in bf16: the final
// norm before the head, one call where torch runs five ops. As layer.norm_row: the mean square
// (here in double) plus eps, its inverse root, weight times it, x times that.
at::Tensor norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [n, dim]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == x.size(1),
              "weight must be float32 [dim]");
  const at::Tensor xs = x.contiguous(), w = weight.contiguous();
  const int64_t n = xs.size(0), dim = xs.size(1);
  at::Tensor out = at::empty({n, dim}, xs.options().dtype(at::kBFloat16));
  const float* scale = w.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const float* row = xs.data_ptr<float>() + r * dim;
    const double square = dot_double(row, row, dim);
    const float inverse = 1.f / std::sqrt(static_cast<float>(square / dim + eps));
    at::BFloat16* o = out.data_ptr<at::BFloat16>() + r * dim;
    for (int64_t i = 0; i < dim; ++i) o[i] = at::BFloat16(row[i] * (scale[i] * inverse));
  }
  return out;
}

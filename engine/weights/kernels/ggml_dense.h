// Part of ggml_dot.cpp, included inside its namespace after the helpers it uses (the block layouts, f16, check, share, dequantize_row).
#pragma once

// 8 floats rounded to bf16 (to nearest, ties to even, as c10::BFloat16 rounds finite
// values) and stored.
inline void store_bf16(at::BFloat16* out, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                                          _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
}

// 8 floats stored as they are.
inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void store8(at::BFloat16* out, __m256 v) { store_bf16(out, v); }

// 32 weights scale·q - offset (q the 32 unsigned bytes of `q`) as floats or bf16: the product
// and the difference rounded as gguf's dequantize rounds them (no fused multiply-add).
template <typename Out>
inline void scaled_values(__m256i q, float scale, float offset, Out* out) {
  alignas(32) uint8_t bytes[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), q);
  const __m256 by = _mm256_set1_ps(scale), minus = _mm256_set1_ps(offset);
  for (int i = 0; i < 4; ++i)
    store8(out + 8 * i, _mm256_sub_ps(_mm256_mul_ps(bytes_to_floats(bytes + 8 * i), by), minus));
}

// 16 weights scale·q (q 16 signed bytes) as floats or bf16.
template <typename Out>
inline void signed_values(__m128i q, float scale, Out* out) {
  const __m256 by = _mm256_set1_ps(scale);
  store8(out, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), by));
  store8(out + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), by));
}

// One Q4_K row as floats or bf16, gguf's values, eight at a time.
template <typename Out>
void q4_k_values(const uint8_t* row, int64_t supers, Out* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  uint32_t packed[4];
  for (int64_t i = 0; i < supers; ++i, out += 256) {
    const uint8_t* block = row + i * 144;
    scales_mins(block + 4, packed);
    const auto* sc = reinterpret_cast<const uint8_t*>(packed);
    const float d = f16(block), dmin = f16(block + 2);
    for (int j = 0; j < 4; ++j) {
      const __m256i w = load32(block + 16 + 32 * j);
      scaled_values(_mm256_and_si256(w, low), d * sc[2 * j], dmin * sc[8 + 2 * j], out + 64 * j);
      scaled_values(_mm256_and_si256(_mm256_srli_epi16(w, 4), low), d * sc[2 * j + 1],
                    dmin * sc[8 + 2 * j + 1], out + 64 * j + 32);
    }
  }
}

// One Q6_K row as floats or bf16 (layout at dot_q6_k): 32 values of q - 32 at a time.
template <typename Out>
void q6_k_values(const uint8_t* row, int64_t supers, Out* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03);
  for (int64_t i = 0; i < supers; ++i, out += 256) {
    const uint8_t* block = row + i * 210;
    const float d = f16(block + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(block + 192);
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 4; ++t) {
        const __m256i nibbles = _mm256_and_si256(
            _mm256_srli_epi16(load32(block + 64 * h + 32 * (t & 1)), 4 * (t >> 1)), low4);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(load32(block + 128 + 32 * h), 2 * t), low2);
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(nibbles, _mm256_slli_epi16(high, 4)),
                                          _mm256_set1_epi8(32));
        Out* v = out + 128 * h + 32 * t;
        signed_values(_mm256_castsi256_si128(q), d * sc[8 * h + 2 * t], v);
        signed_values(_mm256_extracti128_si256(q, 1), d * sc[8 * h + 2 * t + 1], v + 16);
      }
  }
}

// One row of any type as bf16: the K-quants directly, the others through floats.
void row_bf16(int64_t qtype, const uint8_t* row, int64_t columns, float* scratch, at::BFloat16* out) {
  if (qtype == Q4_K) return q4_k_values(row, columns / 256, out);
  if (qtype == Q6_K) return q6_k_values(row, columns / 256, out);
  dequantize_row(qtype, row, columns, scratch);
  for (int64_t c = 0; c < columns; c += 8) store_bf16(out + c, _mm256_loadu_ps(scratch + c));
}

// One row of any type as floats: the K-quants eight at a time, the others value by value.
void row_floats(int64_t qtype, const uint8_t* row, int64_t columns, float* out) {
  if (qtype == Q4_K) return q4_k_values(row, columns / 256, out);
  if (qtype == Q6_K) return q6_k_values(row, columns / 256, out);
  dequantize_row(qtype, row, columns, out);
}

// The rows of `raw` as bf16 weights [n, columns], for a prefill's dense matmul.
at::Tensor ggml_dequantize(const at::Tensor& raw, int64_t qtype, int64_t columns) {
  check(raw, qtype, columns);
  const at::Tensor w = raw.contiguous();
  const int64_t n = w.size(0), row_bytes = w.size(1);
  at::Tensor out = at::empty({n, columns}, at::kBFloat16);
  const uint8_t* rows = w.data_ptr<uint8_t>();
  auto* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> values(columns);
    for (int64_t j = begin; j < end; ++j)
      row_bf16(qtype, rows + j * row_bytes, columns, values.data(), o + j * columns);
  });
  return out;
}

// Bytes of weights a thread dequantises before multiplying them: a panel small enough
// to be read back from the cache, large enough that at::mm's cost per call stays small (the
// sweep behind it: docs/benchmarks.md, "Measurements behind the code").
constexpr int64_t PANEL_BYTES = 2 << 20;

// A thread's panel of weights, kept for its next product: a fresh buffer each time would
// fault its pages in again.
at::Tensor panel_buffer(int64_t values, at::ScalarType dtype) {
  thread_local at::Tensor buffer;  // bytes, viewed as either dtype
  const int64_t bytes = values * static_cast<int64_t>(c10::elementSize(dtype));
  if (!buffer.defined() || buffer.numel() < bytes) buffer = at::empty({bytes}, at::kByte);
  return buffer.narrow(0, 0, bytes).view(dtype);
}

// Rows first..first+count of `raw` dequantised into `panel` [count, k], in its dtype.
void dequantize_panel(int64_t qtype, const uint8_t* rows, int64_t row_bytes, int64_t k,
                      at::Tensor& panel) {
  const int64_t count = panel.size(0);
  if (panel.scalar_type() == at::kFloat) {  // gguf's own values, unrounded
    auto* o = panel.data_ptr<float>();
    for (int64_t j = 0; j < count; ++j) row_floats(qtype, rows + j * row_bytes, k, o + j * k);
    return;
  }
  auto* o = panel.data_ptr<at::BFloat16>();
  std::vector<float> values(k);
  for (int64_t j = 0; j < count; ++j)
    row_bf16(qtype, rows + j * row_bytes, k, values.data(), o + j * k);
}

// x [m, k] · Wᵀ for a prefill: each thread dequantises panels of W's rows into its own buffer
// and multiplies each with at::mm (on that thread alone: it runs inside the parallel region).
// The panels are bf16 for bf16 x, float32 for float32 x: a CPU without bf16 dot products
// multiplies bf16 at a fraction of float32's rate. [m, n] in x's dtype.
at::Tensor ggml_dense_mm(const at::Tensor& x, const at::Tensor& raw, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  const int64_t m = x.size(0), k = x.size(1), n = raw.size(0);
  check(raw, qtype, k);
  const at::ScalarType dtype = x.scalar_type() == at::kFloat ? at::kFloat : at::kBFloat16;
  const at::Tensor xs = x.to(dtype).contiguous();
  const at::Tensor w = raw.contiguous();
  // at least one panel a thread, so a small tensor is shared too
  const int64_t shared = (n + at::get_num_threads() - 1) / at::get_num_threads();
  const int64_t panel = std::max<int64_t>(16, std::min(PANEL_BYTES / (xs.element_size() * k), shared));
  const int64_t row_bytes = w.size(1);
  at::Tensor out = at::empty({m, n}, dtype);  // a panel's product: columns of it
  const uint8_t* rows = w.data_ptr<uint8_t>();
  // The caller's inference mode for the threads that write `out` in place: it is per thread,
  // and at::mm_out on another thread refused an `out` made under it (the logit lens's pass).
  const bool inference = c10::InferenceMode::is_enabled();
  share(n, panel, [&](int64_t first, int64_t end) {
    const c10::InferenceMode mode(inference);
    const int64_t count = end - first;
    at::Tensor weights = panel_buffer(count * k, dtype).view({count, k});
    dequantize_panel(qtype, rows + first * row_bytes, row_bytes, k, weights);
    at::Tensor part = out.narrow(1, first, count);  // strided: at::mm writes it in place
    at::mm_out(part, xs, weights.t());
  });
  return out.to(x.scalar_type());
}

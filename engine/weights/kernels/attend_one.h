// Part of ggml_dot.cpp, included inside its namespace after the helpers it uses (hsum, the AVX2 headers).
#pragma once

// -- one query per head over the KV cache (the decode step's attention) -------------------

// e^x for x ≤ 0 (Cephes' polynomial, as avx_mathfun): scores minus their maximum.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                             _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(power));
}

// 8 bf16 as 8 floats.
inline __m256 bf16x8(const at::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

constexpr int64_t KEYS = 256;  // keys a task attends over: one partial softmax each

// Eight dot products' vectors summed across: lane j of the result is Σ lanes of dots[j].
inline __m256 sum_each(const __m256* dots) {
  __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(dots[0], dots[1]), _mm256_hadd_ps(dots[2], dots[3]));
  __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(dots[4], dots[5]), _mm256_hadd_ps(dots[6], dots[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Scores q·k·scale of one query against `keys` keys, eight at a time (the keys' rows, 32 KB
// a task, stay in L1 for the next query).
void score(const float* q, int64_t d, const at::BFloat16* k, int64_t step, int64_t keys,
           float scale, float* out) {
  for (int64_t t0 = 0; t0 < keys; t0 += 8) {
    __m256 dots[8];
    for (int64_t j = 0; j < 8; ++j) {
      dots[j] = _mm256_setzero_ps();
      if (t0 + j >= keys) continue;
      for (int64_t c = 0; c < d / 8; ++c)
        dots[j] = _mm256_fmadd_ps(bf16x8(k + (t0 + j) * step + 8 * c), _mm256_loadu_ps(q + 8 * c), dots[j]);
    }
    alignas(32) float sums[8];
    _mm256_store_ps(sums, _mm256_mul_ps(sum_each(dots), _mm256_set1_ps(scale)));
    std::copy(sums, sums + std::min<int64_t>(8, keys - t0), out + t0);
  }
}

// Scores -> e^(s - max) in place; returns the max, adds Σ e^(s - max) to `total`.
float exponentiate(float* s, int64_t keys, float* total) {
  const float best = *std::max_element(s, s + keys);
  __m256 sum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= keys; t += 8) {
    __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(best)));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  float rest = 0.f;
  for (; t < keys; ++t) rest += s[t] = std::exp(s[t] - best);
  *total = hsum(sum) + rest;
  return best;
}

// One task: queries [g, d] of one key head against `keys` keys; writes its maximum score,
// Σ e^(s - max) and Σ e^(s - max)·v per query (the parts the tasks' results combine from).
void attend_keys(const float* q, int64_t g, int64_t d, const at::BFloat16* k,
                 const at::BFloat16* v, int64_t step, int64_t keys, float scale, float* top,
                 float* total, float* acc) {
  std::vector<float> p(g * keys);
  for (int64_t i = 0; i < g; ++i) {
    score(q + i * d, d, k, step, keys, scale, p.data() + i * keys);
    top[i] = exponentiate(p.data() + i * keys, keys, total + i);
  }
  for (int64_t c = 0; c < d / 8; ++c)  // 8 of d at a time, four queries' sums in registers
    for (int64_t i0 = 0; i0 < g; i0 += 4) {
      __m256 sums[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                        _mm256_setzero_ps()};
      for (int64_t t = 0; t < keys; ++t) {
        const __m256 row = bf16x8(v + t * step + 8 * c);
        for (int64_t j = 0; j < 4; ++j)
          if (i0 + j < g)
            sums[j] = _mm256_fmadd_ps(_mm256_set1_ps(p[(i0 + j) * keys + t]), row, sums[j]);
      }
      for (int64_t j = 0; j < 4 && i0 + j < g; ++j) _mm256_storeu_ps(acc + (i0 + j) * d + 8 * c, sums[j]);
    }
}

// softmax(q·kᵀ/√d)·v for q [h, g, d] (g query heads per key head), k and v [h, T, d] bf16
// (views of the cache: d contiguous): [h, g, d] float32. Keys in tasks of KEYS, each a
// partial softmax, combined after (flash-decoding), so both threads work at any T.
at::Tensor attend_one(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q [h, g, d], k and v [h, T, d]");
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16, "a bf16 cache");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.strides() == v.strides(), "rows of d contiguous");
  const int64_t h = k.size(0), T = k.size(1), d = k.size(2), g = q.size(1);
  TORCH_CHECK(q.size(0) == h && q.size(2) == d && d % 8 == 0 && T > 0, "shapes do not match");
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const int64_t chunks = (T + KEYS - 1) / KEYS, tasks = h * chunks;
  std::vector<float> top(tasks * g), total(tasks * g), acc(tasks * g * d);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const auto* keys = k.data_ptr<at::BFloat16>();
  const auto* values = v.data_ptr<at::BFloat16>();
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task / chunks, first = task % chunks * KEYS;
      const int64_t offset = head * k.stride(0) + first * k.stride(1);
      attend_keys(qf.data_ptr<float>() + head * g * d, g, d, keys + offset, values + offset,
                  k.stride(1), std::min(KEYS, T - first), scale, top.data() + task * g,
                  total.data() + task * g, acc.data() + task * g * d);
    }
  });
  at::Tensor out = at::zeros({h, g, d}, at::kFloat);
  float* o = out.data_ptr<float>();
  for (int64_t head = 0; head < h; ++head)
    for (int64_t i = 0; i < g; ++i) {
      float best = -INFINITY, sum = 0.f;
      for (int64_t c = 0; c < chunks; ++c) best = std::max(best, top[(head * chunks + c) * g + i]);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t part = (head * chunks + c) * g + i;
        const float weight = std::exp(top[part] - best);
        sum += total[part] * weight;
        for (int64_t e = 0; e < d; ++e) o[(head * g + i) * d + e] += acc[part * d + e] * weight;
      }
      for (int64_t e = 0; e < d; ++e) o[(head * g + i) * d + e] /= sum;
    }
  return out;
}

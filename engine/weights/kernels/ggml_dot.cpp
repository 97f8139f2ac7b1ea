// Products of activations with GGML weights read in the file's own block layouts, with
// llama.cpp's integer arithmetic: the activations are rounded to int8 per block of the
// weight's type (32 values, or 256 for the K-quants), here in two terms (see Q8), and each
// block's product is summed in integers with AVX2's u8 x s8 multiply-adds, then scaled once.
// Built with AVX-512 VNNI (VNNI below), the multiply-adds and the sums they feed are one
// instruction where AVX2 takes two or three: the same integer sums, so the same results.
// Built and loaded by engine/weights/ggml_kernel.py; the layouts are in engine/gguf/blocks.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1
#else
#define VNNI 0
#endif

constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q6_K = 14;

bool k_quant(int64_t qtype) { return qtype == Q4_K || qtype == Q6_K; }

int64_t block_values(int64_t qtype) { return k_quant(qtype) ? 256 : 32; }

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q6_K: return 210;
    default: TORCH_CHECK(false, "ggml type ", qtype, " has no kernel here");
  }
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// body(begin, end) over [0, n) in chunks of `chunk` that the threads take in turn from one
// counter, as llama.cpp shares a product: on a busy machine a thread the OS has paused leaves
// its chunks to the others, where fixed halves would hold the product up until it returns.
template <typename Body>
void share(int64_t n, int64_t chunk, const Body& body) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t begin = next.fetch_add(chunk); begin < n; begin = next.fetch_add(chunk))
      body(begin, std::min(n, begin + chunk));
  });
}

// Ask for the weights AHEAD bytes on while these are multiplied: Qwen2.5-1.5B's layers from
// memory, two threads, medians of 16 interleaved passes: 25.6 GB/s, against 22.6 with the
// hardware's prefetchers alone (AHEAD 512: 23.6, 1024: 25.0, 3072: 26.2 in another run).
constexpr int64_t AHEAD = 2048;

inline void prefetch(const uint8_t* block, int lines) {
  for (int line = 0; line < lines; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(block + AHEAD + 64 * line), _MM_HINT_T0);
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 unsigned bytes times 32 signed ones, summed in fours: 8 int32.
inline __m256i dot_us8(__m256i u, __m256i s) {
#if VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// One row of activations in two int8 terms per block of the weight's type (32 or 256
// values): x ≈ d·(q + r/254), r the rounding left by q, so the products keep ~15 bits of each
// activation (one int8 term, llama.cpp's, kept 7: 93% top-1 against the exact model on the
// bundled model's decode steps, where two terms keep 99.7%). The offsets of the weights
// multiply the float sums of each 16 activations, not rounded at all.
struct Q8 {
  const int8_t* q;
  const int8_t* r;
  const float* d;
  const float* sum16;
  const float* sum32;
};

constexpr float RESIDUAL = 1.f / 254.f;

// 32 values of the 32-value types: byte j holds value j (low nibble) and j + 16 (high).
inline __m256i nibbles32(const uint8_t* p) {
  __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set1_epi8(0x0F),
                          _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed));
}

// The two terms' int sums as floats, q + r/254.
inline __m256 terms(__m256i sum_q, __m256i sum_r) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_r), _mm256_set1_ps(RESIDUAL),
                         _mm256_cvtepi32_ps(sum_q));
}

// Σ w·x over 32 unsigned weights w and the activations from `at`, both terms.
inline __m256 dot32(__m256i w, const Q8& x, int64_t at) {
  return terms(dot_us8(w, load32(x.q + at)), dot_us8(w, load32(x.r + at)));
}

// The fifth bits of 32 values (4 bytes, value j's in bit j) as 0x10 in their bytes (llama.cpp's
// shuffle: each byte of the word to 8 lanes, then one bit per lane tested).
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t word;
  std::memcpy(&word, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(word)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i set = _mm256_cmpeq_epi8(
      _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi8(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// The kernels below multiply one row of weights by R rows of activations (R = 1 for a decode
// step, more for a prompt): each block of weights is unpacked once for all R. Each row's sums
// are made in the same order whatever R, so a prompt's product equals its rows' decode products.

// The 32-value 4- and 5-bit types: [d][m (Q4_1, Q5_1)][fifth bits (Q5_0, Q5_1)][16 B nibbles].
// Q4_0: w = d·(q - 8); Q5_0: w = d·(q - 16); Q4_1, Q5_1: w = d·q + m.
template <int R>
void dot_small(int64_t qtype, const uint8_t* row, const Q8* x, int64_t blocks, float* out) {
  const int64_t size = block_bytes(qtype);
  const bool with_min = qtype == Q4_1 || qtype == Q5_1, five = qtype == Q5_0 || qtype == Q5_1;
  const float bias = qtype == Q4_0 ? -8.f : -16.f;
  __m256 acc[R];
  float offsets[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), offsets[r] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * size;
    prefetch(block, 1);
    const float d = f16(block), offset = with_min ? f16(block + 2) : bias * d;
    __m256i q = nibbles32(block + size - 16);
    if (five) q = _mm256_or_si256(q, fifth_bits(block + size - 20));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[b]), dot32(q, x[r], b * 32), acc[r]);
      offsets[r] += offset * x[r].sum32[b];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + offsets[r];
}

// Q8_0: w = d·q, q signed: |q| times the activations with q's sign, as u8 x s8.
template <int R>
void dot_q8_0(const uint8_t* row, const Q8* x, int64_t blocks, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * 34;
    prefetch(block, 1);
    const __m256i w = load32(block + 2), magnitude = _mm256_sign_epi8(w, w);
    const float d = f16(block);
    for (int r = 0; r < R; ++r) {
      __m256 p = terms(dot_us8(magnitude, _mm256_sign_epi8(load32(x[r].q + b * 32), w)),
                       dot_us8(magnitude, _mm256_sign_epi8(load32(x[r].r + b * 32), w)));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[b]), p, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

// Q4_K's eight 6-bit scales and mins of a super-block from its 12 bytes, as bytes 0-7 and
// 8-15 of `out` (llama.cpp's bit work on 32-bit words: no loop over the sub-blocks).
inline void scales_mins(const uint8_t* s, uint32_t* out) {
  constexpr uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  uint32_t w[3];
  std::memcpy(w, s, 12);
  out[0] = w[0] & six;
  out[1] = (w[2] & four) | (((w[0] >> 6) & two) << 4);
  out[2] = w[1] & six;
  out[3] = ((w[2] >> 4) & four) | (((w[1] >> 6) & two) << 4);
}

// Int16 element `low` in every word of the low 128 bits of `scales`, `high` in the high 128
// bits (both lanes of `scales` hold the same 8 int16): the sub-blocks' scales as multipliers.
inline __m256i pick(__m256i scales, int low, int high) {
  const __m256i mask = _mm256_setr_epi8(
      2 * low, 2 * low + 1, 2 * low, 2 * low + 1, 2 * low, 2 * low + 1, 2 * low, 2 * low + 1,
      2 * low, 2 * low + 1, 2 * low, 2 * low + 1, 2 * low, 2 * low + 1, 2 * low, 2 * low + 1,
      2 * high, 2 * high + 1, 2 * high, 2 * high + 1, 2 * high, 2 * high + 1, 2 * high,
      2 * high + 1, 2 * high, 2 * high + 1, 2 * high, 2 * high + 1, 2 * high, 2 * high + 1,
      2 * high, 2 * high + 1);
  return _mm256_shuffle_epi8(scales, mask);
}

// 8 bytes as 8 floats.
inline __m256 bytes_to_floats(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Σ over 32 values of scale·w·x in int32, for each term: pairs of u8 x s8, times the scale.
inline void scaled(__m256i w, const int8_t* q, const int8_t* r, __m256i scale, __m256i& sum_q,
                   __m256i& sum_r) {
#if VNNI  // the pairs' products times the scale, added to the sums, in one instruction
  sum_q = _mm256_dpwssd_epi32(sum_q, _mm256_maddubs_epi16(w, load32(q)), scale);
  sum_r = _mm256_dpwssd_epi32(sum_r, _mm256_maddubs_epi16(w, load32(r)), scale);
#else
  sum_q = _mm256_add_epi32(sum_q, _mm256_madd_epi16(_mm256_maddubs_epi16(w, load32(q)), scale));
  sum_r = _mm256_add_epi32(sum_r, _mm256_madd_epi16(_mm256_maddubs_epi16(w, load32(r)), scale));
#endif
}

// Q4_K: w = d·sc·q - dmin·m per 32 values. One activation scale per super-block, so the
// eight sub-blocks' products add in int32, times their integer scales, before one multiply.
template <int R>
void dot_q4_k(const uint8_t* row, const Q8* x, int64_t supers, float* out) {
  __m256 acc[R], offsets[R];
  for (int r = 0; r < R; ++r) acc[r] = offsets[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  uint32_t packed[4];
  for (int64_t i = 0; i < supers; ++i) {
    const uint8_t* block = row + i * 144;
    prefetch(block, 3);
    scales_mins(block + 4, packed);
    const auto* sc = reinterpret_cast<const uint8_t*>(packed);
    const __m256i scales = _mm256_broadcastsi128_si256(
        _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
    const uint8_t* qs = block + 16;
    const int64_t at = i * 256;
    __m256i sum_q[R], sum_r[R];
    for (int r = 0; r < R; ++r) sum_q[r] = sum_r[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {  // 64 values: 32 low nibbles, then the same bytes' high
      const __m256i w = load32(qs + 32 * j);
      const __m256i first = _mm256_and_si256(w, low);
      const __m256i second = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
      const __m256i first_scale = pick(scales, 2 * j, 2 * j);
      const __m256i second_scale = pick(scales, 2 * j + 1, 2 * j + 1);
      const int64_t lo = at + 64 * j, hi = lo + 32;
      for (int r = 0; r < R; ++r) {
        scaled(first, x[r].q + lo, x[r].r + lo, first_scale, sum_q[r], sum_r[r]);
        scaled(second, x[r].q + hi, x[r].r + hi, second_scale, sum_q[r], sum_r[r]);
      }
    }
    const float d = f16(block), dmin = f16(block + 2);
    const __m256 mins = bytes_to_floats(sc + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 sum = terms(sum_q[r], sum_r[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[i]), sum, acc[r]);
      offsets[r] = _mm256_fmadd_ps(_mm256_set1_ps(dmin),
                                   _mm256_mul_ps(mins, _mm256_loadu_ps(x[r].sum32 + 8 * i)), offsets[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_sub_ps(acc[r], offsets[r]));
}

// Q6_K: w = d·sc·(q - 32) per 16 values, q = 4 low bits | 2 high bits << 4. Each 128
// values: ql[64] low nibbles (values l and l + 64 in byte l, l + 32 and l + 96 in byte
// l + 32), qh[32] the high bits of l, l + 32, l + 64, l + 96 in bits 0, 2, 4, 6 of byte l.
template <int R>
void dot_q6_k(const uint8_t* row, const Q8* x, int64_t supers, float* out) {
  __m256 acc[R], offsets[R];
  for (int r = 0; r < R; ++r) acc[r] = offsets[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03);
  for (int64_t i = 0; i < supers; ++i) {
    const uint8_t* block = row + i * 210;
    prefetch(block, 4);
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    const int64_t at = i * 256;
    __m256i sum_q[R], sum_r[R];
    for (int r = 0; r < R; ++r) sum_q[r] = sum_r[r] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i half = _mm256_broadcastsi128_si256(
          _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 8 * h))));
      __m256i a = load32(block + 64 * h), c = load32(block + 64 * h + 32);
      __m256i bits = load32(block + 128 + 32 * h);
      __m256i q[4] = {a, c, _mm256_srli_epi16(a, 4), _mm256_srli_epi16(c, 4)};
      for (int k = 0; k < 4; ++k) {
        __m256i high = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * k), low2);
        __m256i w = _mm256_or_si256(_mm256_and_si256(q[k], low4), _mm256_slli_epi16(high, 4));
        const __m256i s = pick(half, 2 * k, 2 * k + 1);  // values 0-15, then 16-31
        const int64_t from = at + 128 * h + 32 * k;
        for (int r = 0; r < R; ++r) scaled(w, x[r].q + from, x[r].r + from, s, sum_q[r], sum_r[r]);
      }
    }
    const float d = f16(block + 208);
    // Σ sc·Σx per 16: what the 32 in q - 32 takes off
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales));
    const __m256 first = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    const __m256 second = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
    for (int r = 0; r < R; ++r) {
      const __m256 sum = terms(sum_q[r], sum_r[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[i]), sum, acc[r]);
      const float* s16 = x[r].sum16 + i * 16;
      const __m256 shift = _mm256_fmadd_ps(second, _mm256_loadu_ps(s16 + 8),
                                           _mm256_mul_ps(first, _mm256_loadu_ps(s16)));
      offsets[r] = _mm256_fmadd_ps(_mm256_set1_ps(32.f * d), shift, offsets[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_sub_ps(acc[r], offsets[r]));
}

// Products of weight rows [begin, end) (row j at rows + j·row_bytes) with R rows of
// activations x, into out[r·n + j]; the type's kernel chosen once, not once a weight row.
template <int R>
void products(int64_t qtype, const uint8_t* rows, int64_t row_bytes, int64_t begin, int64_t end,
              const Q8* x, int64_t blocks, int64_t n, float* out) {
  const auto each = [&](const auto& kernel) {
    float sums[R];
    for (int64_t j = begin; j < end; ++j) {
      kernel(rows + j * row_bytes, sums);
      for (int r = 0; r < R; ++r) out[r * n + j] = sums[r];
    }
  };
  switch (qtype) {
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1:
      return each([&](const uint8_t* row, float* o) { dot_small<R>(qtype, row, x, blocks, o); });
    case Q8_0: return each([&](const uint8_t* row, float* o) { dot_q8_0<R>(row, x, blocks, o); });
    case Q4_K: return each([&](const uint8_t* row, float* o) { dot_q4_k<R>(row, x, blocks, o); });
    default: return each([&](const uint8_t* row, float* o) { dot_q6_k<R>(row, x, blocks, o); });
  }
}

// Activations in blocks of `size` values: q = rint(x/d), d = max|x|/127, then the rounding
// left, r = rint((x - d·q)·254/d) (|x - d·q| ≤ d/2, so |r| ≤ 127).
struct Quantized {
  std::vector<int8_t> q, r;
  std::vector<float> d, sum16, sum32;
  int64_t k, blocks;

  Quantized(const float* x, int64_t rows, int64_t k, int64_t size)
      : q(rows * k), r(rows * k), d(rows * k / size), sum16(rows * k / 16), sum32(rows * k / 32), k(k),
        blocks(k / size) {
    at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) quantize(x + b * size, size, b);
    });
  }

  void quantize(const float* v, int64_t size, int64_t b) {
    const float amax = max_magnitude(v, size);
    const float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
    d[b] = scale;
    const __m256 by = _mm256_set1_ps(inverse), step = _mm256_set1_ps(scale);
    constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t i = 0; i < size; i += 32) {
      __m256i first[4], rest[4];
      for (int j = 0; j < 4; ++j) {
        const __m256 x = _mm256_loadu_ps(v + i + 8 * j);
        const __m256 f = _mm256_round_ps(_mm256_mul_ps(x, by), nearest);
        const __m256 left = _mm256_mul_ps(_mm256_sub_ps(x, _mm256_mul_ps(step, f)), by);
        __m256 e = _mm256_round_ps(_mm256_mul_ps(left, _mm256_set1_ps(254.f)), nearest);
        e = _mm256_min_ps(_mm256_max_ps(e, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
        first[j] = _mm256_cvtps_epi32(f);
        rest[j] = _mm256_cvtps_epi32(e);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + b * size + i), bytes(first));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.data() + b * size + i), bytes(rest));
      float* sums = sum16.data() + (b * size + i) / 16;
      sums[0] = hsum(_mm256_add_ps(_mm256_loadu_ps(v + i), _mm256_loadu_ps(v + i + 8)));
      sums[1] = hsum(_mm256_add_ps(_mm256_loadu_ps(v + i + 16), _mm256_loadu_ps(v + i + 24)));
      sum32[(b * size + i) / 32] = sums[0] + sums[1];
    }
  }

  static float max_magnitude(const float* v, int64_t size) {
    __m256 top = _mm256_setzero_ps();
    for (int64_t i = 0; i < size; i += 8)
      top = _mm256_max_ps(top, _mm256_andnot_ps(_mm256_set1_ps(-0.f), _mm256_loadu_ps(v + i)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }

  // 4 x 8 int32 (each within int8) as 32 int8 in their order.
  static __m256i bytes(const __m256i* v) {
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                              _mm256_packs_epi32(v[2], v[3]));
    return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }

  Q8 row(int64_t at) const {
    return {q.data() + at * k, r.data() + at * k, d.data() + at * blocks,
            sum16.data() + at * k / 16, sum32.data() + at * k / 32};
  }
};

void check(const at::Tensor& raw, int64_t qtype, int64_t columns) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte, "raw rows must be uint8 2-D");
  TORCH_CHECK(columns % block_values(qtype) == 0, "columns are not whole blocks");
  TORCH_CHECK(raw.size(1) == columns / block_values(qtype) * block_bytes(qtype),
              "row bytes do not match the type and columns");
}

// Rows of activations a block of weights is unpacked for (their sums are independent, so their
// multiply-adds also overlap); eight spilled registers and ran slower.
constexpr int64_t ROWS = 4;
// Weight rows a prompt's rows go through ROWS at a time: those ROWS stay in the nearest cache
// across the block, the block in the next.
constexpr int64_t WEIGHT_ROWS = 32;

// products<count> for a count of activation rows up to ROWS known only at run time.
void products(int64_t count, int64_t qtype, const uint8_t* rows, int64_t row_bytes, int64_t begin,
              int64_t end, const Q8* x, int64_t blocks, int64_t n, float* out) {
  switch (count) {
    case 1: return products<1>(qtype, rows, row_bytes, begin, end, x, blocks, n, out);
    case 2: return products<2>(qtype, rows, row_bytes, begin, end, x, blocks, n, out);
    case 3: return products<3>(qtype, rows, row_bytes, begin, end, x, blocks, n, out);
    default: return products<ROWS>(qtype, rows, row_bytes, begin, end, x, blocks, n, out);
  }
}

// x [m, k] · Wᵀ for W the rows of `raw` (uint8 [n, row bytes] of type qtype): [m, n] in
// x's dtype.
at::Tensor ggml_mm(const at::Tensor& x, const at::Tensor& raw, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  const int64_t m = x.size(0), k = x.size(1), n = raw.size(0);
  check(raw, qtype, k);
  const at::Tensor w = raw.contiguous();
  // A decode step's product is small enough that tensor conversions through the dispatcher,
  // bf16 to float and back, are a good part of its time: the values are converted here.
  const at::Tensor xs_in = x.contiguous();
  std::vector<float> values;
  const float* xf = xs_in.scalar_type() == at::kFloat ? xs_in.data_ptr<float>() : nullptr;
  if (xf == nullptr) {
    TORCH_CHECK(xs_in.scalar_type() == at::kBFloat16, "x must be float32 or bf16");
    const auto* bf = xs_in.data_ptr<at::BFloat16>();
    values.assign(bf, bf + m * k);
    xf = values.data();
  }
  const Quantized a(xf, m, k, block_values(qtype));
  at::Tensor out = at::empty({m, n}, x.options());
  std::vector<float> sums;  // bf16 activations: the float sums, rounded into `out` at the end
  if (out.scalar_type() != at::kFloat) sums.resize(m * n);
  float* o = sums.empty() ? out.data_ptr<float>() : sums.data();
  const uint8_t* rows = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  std::vector<Q8> xs(m);
  for (int64_t r = 0; r < m; ++r) xs[r] = a.row(r);
  // Each thread a contiguous half of the rows (as at::parallel_for splits them): a decode
  // step's product streams its rows in order (rows taken from a shared counter, as the
  // prefill's panels are by `share`, made a decode step slower).
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; block += WEIGHT_ROWS) {
      const int64_t block_end = std::min(end, block + WEIGHT_ROWS);
      for (int64_t r = 0; r < m; r += ROWS)
        products(std::min<int64_t>(ROWS, m - r), qtype, rows, row_bytes, block, block_end,
                 xs.data() + r, a.blocks, n, o + r * n);
    }
  });
  if (!sums.empty())  // rounded to nearest, ties to even, as Tensor::to rounds
    std::copy(sums.begin(), sums.end(), out.data_ptr<at::BFloat16>());
  return out;
}

// One Q4_K super-block (layout at dot_q4_k) as floats: q·(d·sc) - dmin·m per 32 values, in
// gguf's order (both products exact in float32, one rounding in the sum).
void q4_k_floats(const uint8_t* block, float* v) {
  const float d = f16(block), dmin = f16(block + 2);
  uint32_t packed[4];
  scales_mins(block + 4, packed);
  const auto* sc = reinterpret_cast<const uint8_t*>(packed);  // scales 0-7, then mins
  for (int j = 0; j < 8; ++j) {
    const float scale = d * static_cast<float>(sc[j]);
    const float offset = -(dmin * static_cast<float>(sc[8 + j]));
    const uint8_t* qs = block + 16 + 32 * (j / 2);
    for (int l = 0; l < 32; ++l) {
      const int q = j % 2 ? qs[l] >> 4 : qs[l] & 15;
      v[32 * j + l] = static_cast<float>(q) * scale + offset;
    }
  }
}

// One Q6_K super-block (layout at dot_q6_k) as floats: (q - 32)·(d·sc) per 16 values.
void q6_k_floats(const uint8_t* block, float* v) {
  const float d = f16(block + 208);
  const auto* sc = reinterpret_cast<const int8_t*>(block + 192);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* low = block + 64 * h;
    const uint8_t* high = block + 128 + 32 * h;
    for (int l = 0; l < 32; ++l)
      for (int t = 0; t < 4; ++t) {  // value 32·t + l of this half
        const int nibble = (low[l + 32 * (t & 1)] >> (4 * (t >> 1))) & 15;
        const int q = (nibble | (((high[l] >> (2 * t)) & 3) << 4)) - 32;
        const int at = 128 * h + 32 * t + l;
        v[at] = static_cast<float>(q) * (d * static_cast<float>(sc[at / 16]));
      }
  }
}

// One row of any type the kernels read as floats, exactly as gguf's dequantize computes them.
void dequantize_row(int64_t qtype, const uint8_t* row, int64_t k, float* w) {
  const int64_t size = block_bytes(qtype);
  for (int64_t i = 0; i < k / block_values(qtype); ++i) {
    const uint8_t* block = row + i * size;
    float* v = w + i * block_values(qtype);
    if (qtype == Q4_K) {
      q4_k_floats(block, v);
    } else if (qtype == Q6_K) {
      q6_k_floats(block, v);
    } else if (qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1) {
      const float d = f16(block);
      const float m = qtype == Q4_1 || qtype == Q5_1 ? f16(block + 2) : (qtype == Q4_0 ? -8.f : -16.f) * d;
      uint32_t high = 0;
      if (qtype == Q5_0 || qtype == Q5_1) std::memcpy(&high, block + size - 20, 4);
      const uint8_t* qs = block + size - 16;
      for (int j = 0; j < 16; ++j) {
        v[j] = static_cast<float>((qs[j] & 0xF) | (((high >> j) & 1) << 4)) * d + m;
        v[j + 16] = static_cast<float>((qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4)) * d + m;
      }
    } else {  // Q8_0
      const float d = f16(block);
      for (int j = 0; j < 32; ++j) v[j] = d * static_cast<int8_t>(block[2 + j]);
    }
  }
}

#include "ggml_dense.h"  // a prefill's product: dequantised panels, bf16 matmuls
#include "attend_one.h"  // the decode step's attention
#include "top_k.h"       // each row's k largest values, and their softmax
#include "head_statistics.h"  // attention rows: a batch's, and their per-head statistics
#include "head.h"  // the fast head: its final norm, its exact top logits, greedy's argmax

}  // namespace

TORCH_LIBRARY(glassbox, lib) {
  lib.def("ggml_mm(Tensor x, Tensor raw, int qtype) -> Tensor");
  lib.def("ggml_dequantize(Tensor raw, int qtype, int columns) -> Tensor");
  lib.def("ggml_dense_mm(Tensor x, Tensor raw, int qtype) -> Tensor");
  lib.def("attend_one(Tensor q, Tensor k, Tensor v) -> Tensor");
  lib.def("top_k_rows(Tensor values, int k) -> Tensor");
  lib.def("top_k_softmax(Tensor[] rows, int k) -> (Tensor, Tensor)");
  lib.def("sample_filter(Tensor logits, float temperature, int k, float p) -> (Tensor, Tensor)");
  lib.def("head_statistics(Tensor[] rows) -> Tensor");
  lib.def("causal_rows(Tensor query, Tensor key, float scaling, int rows) -> Tensor");
  lib.def("first_largest(Tensor values) -> Tensor");
  lib.def("exact_head(Tensor bulk, Tensor raw, int qtype, Tensor x, int k) -> Tensor");
  lib.def("ggml_rows(Tensor raw, Tensor index, int qtype, int columns) -> Tensor");
  lib.def("norm_rows(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(glassbox, CPU, lib) {
  lib.impl("ggml_mm", ggml_mm);
  lib.impl("ggml_dequantize", ggml_dequantize);
  lib.impl("ggml_dense_mm", ggml_dense_mm);
  lib.impl("attend_one", attend_one);
  lib.impl("top_k_rows", top_k_rows);
  lib.impl("top_k_softmax", top_k_softmax);
  lib.impl("sample_filter", sample_filter);
  lib.impl("head_statistics", head_statistics);
  lib.impl("causal_rows", causal_rows);
  lib.impl("first_largest", first_largest_of);
  lib.impl("exact_head", exact_head);
  lib.impl("ggml_rows", ggml_rows);
  lib.impl("norm_rows", norm_rows);
}

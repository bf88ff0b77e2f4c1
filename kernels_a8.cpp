// int8 and int4 weights times 8-bit-quantized activations in integer dot products, llama.cpp's Q8_0 / Q4_1 x Q8_1
// pairing on x86 CPUs (and int8 weights times float32 activations). Layouts, rounding and the math:
// docs/quantization.md, "8-bit activations". kernels.py builds this file at first use; quantize.py repacks the
// weights for it (Int8A8Linear, Int4A8Linear).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#define AVX2 __attribute__((target("avx2,fma")))

namespace {

constexpr int64_t BLOCK = 32;    // activations sharing a scale (llama.cpp's Q8 block); weight groups hold whole blocks
constexpr int64_t CHUNK = 64;    // inputs per 512-bit step: packed rows are padded to a multiple of it
constexpr int64_t MAX_ROWS = 4;  // activation rows multiplied with a weight tile while it is in registers

// ----------------------------------------------------------------------------- which instructions

enum Isa { PORTABLE = 0, AVX2_MADDUBS = 1, AVX512_VNNI = 2 };
const char* ISA_NAMES[] = {"portable", "avx2", "avx512_vnni"};

Isa best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
    return AVX512_VNNI;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2_MADDUBS;
  return PORTABLE;
}

// FASTGEN_A8_ISA=portable|avx2 forces a slower path (tests); read on every call so a test can switch it
Isa isa() {
  static const Isa best = best_isa();
  const char* forced = std::getenv("FASTGEN_A8_ISA");
  if (forced && !std::strcmp(forced, "portable")) return PORTABLE;
  if (forced && !std::strcmp(forced, "avx2")) return std::min(best, AVX2_MADDUBS);
  return best;
}

// ----------------------------------------------------------------------------- activations, 8 bits per block

// Row m of x [M, K] quantized per block of 32: d = max|x| / 127, q = round-half-even(x / d) (0 where d is 0); rows
// padded with zero blocks to Kp. dexp repeats each d over the 8 lanes of a 16-lane int32 dot that cover its block.
// A block holding NaN or infinity gets d = NaN, so that the outputs say so (generation checks its logits).
struct Activations {
  int64_t Kp;
  std::vector<int8_t> q;     // [M, Kp]
  std::vector<float> d;      // [M, Kp / 32]
  std::vector<int32_t> sum;  // [M, Kp / 32] the sum of each block's q
  std::vector<float> dexp;   // [M, Kp / 64, 16]
  std::vector<float> dsum;   // [M] sum_b d[b] * sum(q in b)
  std::vector<float> t;      // [M, K / G rounded up to 16] per weight group: sum_{b in g} d[b] * sum(q in b) (int4)
  const int8_t* qrow(int64_t m) const { return q.data() + m * Kp; }
  const float* drow(int64_t m) const { return d.data() + m * (Kp / BLOCK); }
  const int32_t* sumrow(int64_t m) const { return sum.data() + m * (Kp / BLOCK); }
  const float* dexprow(int64_t m) const { return dexp.data() + m * (Kp / CHUNK) * 16; }
  int64_t tstride = 0;
  const float* trow(int64_t m) const { return t.data() + m * tstride; }

  void group_sums(int64_t groups, int64_t G) {  // t for int4 groups of G
    const int64_t M = dsum.size();
    tstride = (groups + 15) / 16 * 16;
    t.assign(M * tstride, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < groups * G / BLOCK; ++b)
        t[m * tstride + b * BLOCK / G] += drow(m)[b] * float(sumrow(m)[b]);
  }
};

Activations quantize_activations(const at::Tensor& x, int64_t Kp) {
  const int64_t M = x.size(0), K = x.size(1), blocks = Kp / BLOCK;
  Activations a{Kp, std::vector<int8_t>(M * Kp), std::vector<float>(M * blocks), std::vector<int32_t>(M * blocks),
                std::vector<float>(M * blocks * 8), std::vector<float>(M), {}};
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t k0 = b * BLOCK, n = std::max<int64_t>(0, std::min(BLOCK, K - k0));
      const float* xb = xp + m * K + k0;
      float amax = 0.f;
      bool finite = true;
      for (int64_t i = 0; i < n; ++i) {
        amax = std::max(amax, std::fabs(xb[i]));
        finite &= std::isfinite(xb[i]);
      }
      const float d = finite ? amax / 127.f : NAN;
      int32_t sum = 0;
      int8_t* q = a.q.data() + m * Kp + k0;
      for (int64_t i = 0; i < n; ++i) {
        // the default rounding mode: half to even
        q[i] = d == 0.f || !finite ? 0 : static_cast<int8_t>(std::nearbyint(xb[i] / d));
        sum += q[i];
      }
      a.d[m * blocks + b] = d;
      a.sum[m * blocks + b] = sum;
      std::fill_n(a.dexp.data() + m * blocks * 8 + b * 8, 8, d);
      a.dsum[m] += d * float(sum);
    }
  }
  return a;
}

inline float bf16(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ----------------------------------------------------------------------------- int8 weights, one scale per row
// y[m, n] = s[n] * sum_b d[m, b] * sum_{k in b} w[n, k] q[m, k]. Each kernel multiplies a tile of NR weight rows with
// R = 1..MAX_ROWS activation rows (NR independent sums hide the latency of each; a weight is loaded once per tile),
// doing the same operations for each (m, n) whatever the tile holds, so a row's result does not depend on the rows
// beside it. out[j][i] is row m0 + j of x times weight row i.

constexpr int NR = 4;
constexpr int64_t AHEAD = 4 * NR;  // weight rows ahead of the tile that a step asks the memory for (short rows: the
                                   // hardware prefetchers alone leave much of the bandwidth unused)

// into L2, not L1: a core has few L1 miss buffers, and prefetches holding them capped a thread's stream (with
// prefetches into L1 the products moved 13 GB/s on two threads, into L2 18-22: scripts/bench_a8.py)
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

template <int R>
void int8_tile_portable(const int8_t* const* w, const Activations& a, int64_t m0, float (*out)[NR]) {
  for (int j = 0; j < R; ++j) {
    const int8_t* q = a.qrow(m0 + j);
    const float* d = a.drow(m0 + j);
    for (int i = 0; i < NR; ++i) {
      float acc = 0.f;
      for (int64_t b = 0; b < a.Kp / BLOCK; ++b) {
        int32_t dot = 0;
        for (int64_t k = b * BLOCK; k < (b + 1) * BLOCK; ++k) dot += int32_t(w[i][k]) * int32_t(q[k]);
        acc += d[b] * float(dot);
      }
      out[j][i] = acc;
    }
  }
}

AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// maddubs multiplies unsigned by signed bytes: |w| times q with w's sign moved onto q (|w| <= 127: no saturation)
template <int R>
AVX2 void int8_tile_avx2(const int8_t* const* w, const Activations& a, int64_t m0, float (*out)[NR]) {
  __m256 acc[R][NR];
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i) acc[j][i] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < a.Kp / BLOCK; ++b) {
    __m256i wv[NR], aw[NR];
    for (int i = 0; i < NR; ++i) {
      if (b % 2 == 0) prefetch(w[i] + b * BLOCK + AHEAD * a.Kp);
      wv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i] + b * BLOCK));
      aw[i] = _mm256_sign_epi8(wv[i], wv[i]);
    }
    for (int j = 0; j < R; ++j) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qrow(m0 + j) + b * BLOCK));
      const __m256 d = _mm256_set1_ps(a.drow(m0 + j)[b]);
      for (int i = 0; i < NR; ++i) {
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[i], _mm256_sign_epi8(q, wv[i])), ones);
        acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, acc[j][i]);
      }
    }
  }
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i) out[j][i] = hsum256(acc[j][i]);
}

// dpbusd multiplies unsigned by signed bytes: w + 128 (an xor) times q, less 128 * sum_b d[b] * sum(q in b) at the end
template <int R>
AVX512 void int8_tile_avx512(const int8_t* const* w, const Activations& a, int64_t m0, float (*out)[NR]) {
  __m512 acc[R][NR];
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i) acc[j][i] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t c = 0; c < a.Kp / CHUNK; ++c) {
    __m512i wv[NR];
    for (int i = 0; i < NR; ++i) {
      prefetch(w[i] + c * CHUNK + AHEAD * a.Kp);
      wv[i] = _mm512_xor_si512(_mm512_loadu_si512(w[i] + c * CHUNK), flip);
    }
    for (int j = 0; j < R; ++j) {
      const __m512i q = _mm512_loadu_si512(a.qrow(m0 + j) + c * CHUNK);
      const __m512 d = _mm512_loadu_ps(a.dexprow(m0 + j) + c * 16);
      for (int i = 0; i < NR; ++i)
        acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[i], q)), d,
                                    acc[j][i]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i) out[j][i] = _mm512_reduce_add_ps(acc[j][i]) - 128.f * a.dsum[m0 + j];
}

// ----------------------------------------------------------------------------- int4 weights, asymmetric groups
// w = (u - 8) * s + z per group of G (u in 0..15), so with T[g] = sum_{b in g} d[b] * sum(q in b):
// y[m, n] = sum_g s[g] * sum_{b in g} d[b] * sum_{k in b} u[n, k] q[m, k]  +  sum_g (z[g] - 8 s[g]) * T[g]
// Packed row: steps of 128 inputs in 64 bytes, byte i holding input i in its low 4 bits and input 64 + i in its high
// 4 bits (two 64-input vectors from one load, an and and a shift); a last step of 64 inputs in 32 bytes likewise.
// The row's scales [K / G] then zeros [K / G] (bf16) sit in `sz` [N, 2, K / G].

struct Int4Row {
  const uint8_t* u;
  const uint16_t* s;
  const uint16_t* z;
};

struct Int4Tile {
  Int4Row rows[NR];
  int64_t groups, G, Kp;
  int64_t blocks() const { return groups * G / BLOCK; }
  int64_t full_blocks() const { return Kp / 128 * 4; }  // the blocks in steps of 128 (padding included)
};

// where block b (32 inputs) of a packed row lies: its 32 bytes, and the shift to its half of each byte
inline const uint8_t* block_bytes(const uint8_t* row, int64_t b, int64_t full_blocks, int& shift) {
  if (b < full_blocks) {
    shift = (b % 4) / 2 * 4;
    return row + (b / 4) * 64 + (b % 2) * 32;
  }
  shift = (b - full_blocks) * 4;
  return row + full_blocks * 16;
}

// the second term: sum_g (z[g] - 8 s[g]) * T[g]
float int4_offset(const Int4Row& w, int64_t groups, const Activations& a, int64_t m, int64_t g = 0) {
  float acc = 0.f;
  for (; g < groups; ++g) acc += (bf16(w.z[g]) - 8.f * bf16(w.s[g])) * a.trow(m)[g];
  return acc;
}

AVX2 inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

AVX2 float int4_offset_avx2(const Int4Row& w, int64_t groups, const Activations& a, int64_t m) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8)
    acc = _mm256_fmadd_ps(_mm256_fnmadd_ps(_mm256_set1_ps(8.f), bf16x8(w.s + g), bf16x8(w.z + g)),
                          _mm256_loadu_ps(a.trow(m) + g), acc);
  return hsum256(acc) + int4_offset(w, groups, a, m, g);
}

template <int R>
void int4_tile_portable(const Int4Tile& w, const Activations& a, int64_t m0, float (*out)[NR]) {
  for (int j = 0; j < R; ++j) {
    const int8_t* q = a.qrow(m0 + j);
    const float* d = a.drow(m0 + j);
    for (int i = 0; i < NR; ++i) {
      float acc = 0.f;
      for (int64_t b = 0; b < w.blocks(); ++b) {
        int shift;
        const uint8_t* bytes = block_bytes(w.rows[i].u, b, w.full_blocks(), shift);
        int32_t dot = 0;
        for (int64_t k = 0; k < BLOCK; ++k) dot += int32_t((bytes[k] >> shift) & 15) * int32_t(q[b * BLOCK + k]);
        acc += bf16(w.rows[i].s[b * BLOCK / w.G]) * d[b] * float(dot);
      }
      out[j][i] = acc + int4_offset(w.rows[i], w.groups, a, m0 + j);
    }
  }
}

template <int R>
AVX2 void int4_tile_avx2(const Int4Tile& w, const Activations& a, int64_t m0, float (*out)[NR]) {
  __m256 acc[R][NR];
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i) acc[j][i] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
  for (int64_t b = 0; b < w.blocks(); ++b) {
    __m256i u[NR];
    float s[NR];
    for (int i = 0; i < NR; ++i) {
      int shift;
      const uint8_t* bytes = block_bytes(w.rows[i].u, b, w.full_blocks(), shift);
      if (b % 4 < 2) prefetch(bytes + AHEAD * w.Kp / 2);
      u[i] = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)), shift),
                              low);
      s[i] = bf16(w.rows[i].s[b * BLOCK / w.G]);
    }
    for (int j = 0; j < R; ++j) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qrow(m0 + j) + b * BLOCK));
      const float d = a.drow(m0 + j)[b];
      for (int i = 0; i < NR; ++i) {
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(u[i], q), ones);  // 15 * 127 * 2: no saturation
        acc[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s[i] * d), acc[j][i]);
      }
    }
  }
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i) out[j][i] = hsum256(acc[j][i]) + int4_offset_avx2(w.rows[i], w.groups, a, m0 + j);
}

// The bf16 scales of the 16 lanes of vector h of the 128-input step whose first group is g0: lanes 0-7 dot its first
// block, lanes 8-15 its second. G = 32: two groups from one 32-bit broadcast, a byte shuffle moving each to the top
// half of its lanes (a bf16 value is the top half of a float32); larger G: one group.
AVX512 inline __m512 half_scales(const uint16_t* v, int64_t g0, int h, int64_t G, int64_t groups) {
  const int64_t g = G == BLOCK ? g0 + 2 * h : G == 2 * BLOCK ? g0 + h : g0;
  if (G != BLOCK || g + 1 >= groups)  // (past the last group: a padding block, whose dot products are zero)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_set1_epi32(v[std::min(g, groups - 1)]), 16));
  int32_t pair;
  std::memcpy(&pair, v + g, 4);
  const __m512i to_top = _mm512_set_epi32(0x03028080, 0x03028080, 0x03028080, 0x03028080, 0x03028080, 0x03028080,
                                          0x03028080, 0x03028080, 0x01008080, 0x01008080, 0x01008080, 0x01008080,
                                          0x01008080, 0x01008080, 0x01008080, 0x01008080);
  return _mm512_castsi512_ps(_mm512_shuffle_epi8(_mm512_set1_epi32(pair), to_top));
}

AVX512 inline __m512 bf16x16(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

// the second term, sum_g (z[g] - 8 s[g]) * T[g], once per row: in the loop over the inputs it cost as much as the dots
AVX512 float int4_offset_avx512(const Int4Row& w, int64_t groups, const Activations& a, int64_t m) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 k = groups - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g)) - 1);
    const __m512 s = bf16x16(_mm256_maskz_loadu_epi16(k, w.s + g)), z = bf16x16(_mm256_maskz_loadu_epi16(k, w.z + g));
    acc = _mm512_fmadd_ps(_mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z), _mm512_maskz_loadu_ps(k, a.trow(m) + g), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

template <int R>
AVX512 void int4_tile_avx512(const Int4Tile& w, const Activations& a, int64_t m0, float (*out)[NR]) {
  __m512 acc[R][NR];
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i) acc[j][i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(15);
  const int64_t steps = w.full_blocks() / 4;
  for (int64_t c = 0; c < steps; ++c) {  // 128 inputs, in two vectors of 64 (one at a time: registers for 4 x 4 sums)
    const int64_t g0 = c * 128 / w.G;
    for (int h = 0; h < 2; ++h) {
      __m512i u[NR];
      __m512 s[NR];
      for (int i = 0; i < NR; ++i) {
        if (h == 0) prefetch(w.rows[i].u + c * 64 + AHEAD * w.Kp / 2);
        const __m512i bytes = _mm512_loadu_si512(w.rows[i].u + c * 64);
        u[i] = _mm512_and_si512(h ? _mm512_srli_epi16(bytes, 4) : bytes, low);
        s[i] = half_scales(w.rows[i].s, g0, h, w.G, w.groups);
      }
      for (int j = 0; j < R; ++j) {
        const __m512i q = _mm512_loadu_si512(a.qrow(m0 + j) + c * 128 + h * 64);
        const __m512 d = _mm512_loadu_ps(a.dexprow(m0 + j) + (2 * c + h) * 16);
        for (int i = 0; i < NR; ++i)
          acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[i], q)),
                                      _mm512_mul_ps(s[i], d), acc[j][i]);
      }
    }
  }
  if (w.Kp % 128) {  // a last step of 64 inputs (its second block may be padding: zeros)
    const int64_t first = steps * 128, g0 = first / w.G;
    const __m256i low256 = _mm256_set1_epi8(15);
    __m512i u[NR];
    __m512 s[NR];
    for (int i = 0; i < NR; ++i) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.rows[i].u + steps * 64));
      u[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, low256)),
                                _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low256), 1);
      s[i] = half_scales(w.rows[i].s, g0, 0, w.G, w.groups);
    }
    for (int j = 0; j < R; ++j) {
      const __m512i q = _mm512_loadu_si512(a.qrow(m0 + j) + first);
      const __m512 d = _mm512_loadu_ps(a.dexprow(m0 + j) + 2 * steps * 16);
      for (int i = 0; i < NR; ++i)
        acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[i], q)),
                                    _mm512_mul_ps(s[i], d), acc[j][i]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i)
      out[j][i] = _mm512_reduce_add_ps(acc[j][i]) + int4_offset_avx512(w.rows[i], w.groups, a, m0 + j);
}

// ----------------------------------------------------------------------------- int8 weights, float32 activations
// y[m, n] = s[n] * sum_k w[n, k] x[m, k] in float32 (x rows padded with zeros to Kp): the weight-only int8 scheme's CPU
// kernel (Int8Linear), which does not round the activations.

template <int R>
void f32_tile_portable(const int8_t* const* w, const float* x, int64_t Kp, float (*out)[NR]) {
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i) {
      float acc = 0.f;
      for (int64_t k = 0; k < Kp; ++k) acc += float(w[i][k]) * x[j * Kp + k];
      out[j][i] = acc;
    }
}

template <int R>
AVX2 void f32_tile_avx2(const int8_t* const* w, const float* x, int64_t Kp, float (*out)[NR]) {
  __m256 acc[R][NR];
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i) acc[j][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < Kp; k += 8) {
    __m256 wv[NR];
    for (int i = 0; i < NR; ++i) {
      if (k % 64 == 0) prefetch(w[i] + k + AHEAD * Kp);
      wv[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w[i] + k))));
    }
    for (int j = 0; j < R; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + j * Kp + k);
      for (int i = 0; i < NR; ++i) acc[j][i] = _mm256_fmadd_ps(wv[i], xv, acc[j][i]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i) out[j][i] = hsum256(acc[j][i]);
}

template <int R>
AVX512 void f32_tile_avx512(const int8_t* const* w, const float* x, int64_t Kp, float (*out)[NR]) {
  __m512 acc[R][NR];
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < Kp; k += 16) {
    __m512 wv[NR];
    for (int i = 0; i < NR; ++i) {
      if (k % 64 == 0) prefetch(w[i] + k + AHEAD * Kp);
      wv[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[i] + k))));
    }
    for (int j = 0; j < R; ++j) {
      const __m512 xv = _mm512_loadu_ps(x + j * Kp + k);
      for (int i = 0; i < NR; ++i) acc[j][i] = _mm512_fmadd_ps(wv[i], xv, acc[j][i]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i) out[j][i] = _mm512_reduce_add_ps(acc[j][i]);
}

// ----------------------------------------------------------------------------- operators

// fn(n0, n1) over the weight rows [0, N): one contiguous share of whole tiles per thread, so that each thread reads
// one long stream that its prefetches run ahead of (small tasks taken in turn moved 13-18 GB/s where this moves 22);
// products under 64 KiB stay on the calling thread
template <typename F>
void over_rows(int64_t N, int64_t row_bytes, const F& fn) {
  const int64_t tiles = (N + NR - 1) / NR;
  const int64_t threads = N * row_bytes < (64 << 10) ? 1 : std::min<int64_t>(at::get_num_threads(), tiles);
  if (threads <= 1) return fn(0, N);
  const int64_t share = (tiles + threads - 1) / threads * NR;
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      if (t * share < N) fn(t * share, std::min(N, (t + 1) * share));
  });
}

#define RUN_TILE(FN, W, OUT)                                  \
  switch (R) {                                                \
    case 1: FN<1>(W, a, m0, OUT); break;                      \
    case 2: FN<2>(W, a, m0, OUT); break;                      \
    case 3: FN<3>(W, a, m0, OUT); break;                      \
    default: FN<MAX_ROWS>(W, a, m0, OUT); break;              \
  }

#define RUN_TILE_F32(FN)                                      \
  switch (R) {                                                \
    case 1: FN<1>(rows, xm, Kp, out); break;                  \
    case 2: FN<2>(rows, xm, Kp, out); break;                  \
    case 3: FN<3>(rows, xm, Kp, out); break;                  \
    default: FN<MAX_ROWS>(rows, xm, Kp, out); break;          \
  }

at::Tensor a8_int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
                  weight.size(1) % CHUNK == 0 && weight.size(1) >= x.size(1),
              "weight: contiguous int8 [N, K padded to a multiple of 64]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == weight.size(0), "scales: float32 [N]");
  const int64_t M = x.size(0), N = weight.size(0), Kp = weight.size(1);
  const Activations a = quantize_activations(x, Kp);
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Isa path = isa();
  over_rows(N, Kp, [&](int64_t n0, int64_t n1) {
    float out[MAX_ROWS][NR];
    for (int64_t n = n0; n < n1; n += NR) {
      const int8_t* rows[NR];
      for (int i = 0; i < NR; ++i) rows[i] = w + std::min(n + i, N - 1) * Kp;
      for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t R = std::min(MAX_ROWS, M - m0);
        if (path == AVX512_VNNI) {
          RUN_TILE(int8_tile_avx512, rows, out)
        } else if (path == AVX2_MADDUBS) {
          RUN_TILE(int8_tile_avx2, rows, out)
        } else {
          RUN_TILE(int8_tile_portable, rows, out)
        }
        for (int64_t j = 0; j < R; ++j)
          for (int64_t i = 0; i < std::min<int64_t>(NR, N - n); ++i) yp[(m0 + j) * N + n + i] = s[n + i] * out[j][i];
      }
    }
  });
  return y;
}

at::Tensor a8_int4_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales_and_zeros,
                          int64_t groupsize) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(groupsize % BLOCK == 0 && x.size(1) % groupsize == 0, "groupsize: a multiple of 32 dividing K");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), Kp = (K + CHUNK - 1) / CHUNK * CHUNK;
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.size(1) == Kp / 2,
              "weight: contiguous uint8 [N, K padded to a multiple of 64, halved]");
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 && scales_and_zeros.is_contiguous() &&
                  scales_and_zeros.dim() == 3 && scales_and_zeros.size(0) == N && scales_and_zeros.size(1) == 2 &&
                  scales_and_zeros.size(2) == K / groupsize,
              "scales_and_zeros: contiguous bfloat16 [N, 2, K / groupsize]");
  const int64_t groups = K / groupsize;
  Activations a = quantize_activations(x, Kp);
  a.group_sums(groups, groupsize);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* u = weight.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scales_and_zeros.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const Isa path = isa();
  over_rows(N, Kp / 2 + 4 * groups, [&](int64_t n0, int64_t n1) {
    float out[MAX_ROWS][NR];
    for (int64_t n = n0; n < n1; n += NR) {
      Int4Tile tile{{}, groups, groupsize, Kp};
      for (int i = 0; i < NR; ++i) {
        const int64_t row = std::min(n + i, N - 1);
        tile.rows[i] = {u + row * (Kp / 2), sz + row * 2 * groups, sz + row * 2 * groups + groups};
      }
      for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t R = std::min(MAX_ROWS, M - m0);
        if (path == AVX512_VNNI) {
          RUN_TILE(int4_tile_avx512, tile, out)
        } else if (path == AVX2_MADDUBS) {
          RUN_TILE(int4_tile_avx2, tile, out)
        } else {
          RUN_TILE(int4_tile_portable, tile, out)
        }
        for (int64_t j = 0; j < R; ++j)
          for (int64_t i = 0; i < std::min<int64_t>(NR, N - n); ++i) yp[(m0 + j) * N + n + i] = out[j][i];
      }
    }
  });
  return y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
                  weight.size(1) % CHUNK == 0 && weight.size(1) >= x.size(1),
              "weight: contiguous int8 [N, K padded to a multiple of 64]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == weight.size(0), "scales: float32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), Kp = weight.size(1);
  std::vector<float> xp(M * Kp, 0.f);
  for (int64_t m = 0; m < M; ++m) std::memcpy(xp.data() + m * Kp, x.data_ptr<float>() + m * K, K * sizeof(float));
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Isa path = isa();
  over_rows(N, Kp, [&](int64_t n0, int64_t n1) {
    float out[MAX_ROWS][NR];
    for (int64_t n = n0; n < n1; n += NR) {
      const int8_t* rows[NR];
      for (int i = 0; i < NR; ++i) rows[i] = w + std::min(n + i, N - 1) * Kp;
      for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t R = std::min(MAX_ROWS, M - m0);
        const float* xm = xp.data() + m0 * Kp;
        if (path == AVX512_VNNI) {
          RUN_TILE_F32(f32_tile_avx512)
        } else if (path == AVX2_MADDUBS) {
          RUN_TILE_F32(f32_tile_avx2)
        } else {
          RUN_TILE_F32(f32_tile_portable)
        }
        for (int64_t j = 0; j < R; ++j)
          for (int64_t i = 0; i < std::min<int64_t>(NR, N - n); ++i) yp[(m0 + j) * N + n + i] = s[n + i] * out[j][i];
      }
    }
  });
  return y;
}

// the activations as the kernels quantize them: (q [M, Kp] int8, d [M, Kp / 32] float32), for tests
std::tuple<at::Tensor, at::Tensor> a8_quantize(const at::Tensor& x, int64_t Kp) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && Kp % CHUNK == 0 && Kp >= x.size(1),
              "x: contiguous float32 [M, K]; Kp: a multiple of 64, at least K");
  const Activations a = quantize_activations(x, Kp);
  at::Tensor q = at::empty({x.size(0), Kp}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({x.size(0), Kp / BLOCK}, x.options());
  std::memcpy(q.data_ptr<int8_t>(), a.q.data(), a.q.size());
  std::memcpy(d.data_ptr<float>(), a.d.data(), a.d.size() * sizeof(float));
  return {q, d};
}

std::string a8_isa() { return ISA_NAMES[isa()]; }

}  // namespace

// the schemas and fake implementations are in kernels.py; these are the CPU implementations
TORCH_LIBRARY_IMPL(fastgen, CPU, m) {
  m.impl("a8_int8_linear", &a8_int8_linear);
  m.impl("a8_int4_linear", &a8_int4_linear);
  m.impl("a8_quantize", &a8_quantize);
  m.impl("int8_linear", &int8_linear);
}

TORCH_LIBRARY_FRAGMENT(fastgen, m) { m.def("a8_isa() -> str", &a8_isa); }

// int8 and int4 weights times 8-bit-quantized activations in integer dot products, llama.cpp's Q8_0 / Q4_1 x Q8_1
// pairing on x86 CPUs (and int8 weights times float32 activations). Layouts, rounding and the math:
// docs/quantization.md, "8-bit activations". kernels.py builds this file at first use; quantize.py repacks the
// weights for it (Int8A8Linear, Int4A8Linear).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
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

constexpr int NR = 4;  // (sum4 reduces a tile of four rows at once)
constexpr int64_t AHEAD = 4 * NR;  // weight rows ahead of the tile that a step asks the memory for (short rows: the
                                   // hardware prefetchers alone leave much of the bandwidth unused)

// into L2, not L1: a core has few L1 miss buffers, and prefetches holding them capped a thread's stream
// (BENCHMARKS.md, "Integer kernels")
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// the first AHEAD rows of rows [n0, n1) at once, so that a product does not start on the latency of single misses
inline void prefetch_first_rows(const void* base, int64_t n0, int64_t n1, int64_t row_bytes) {
  const char* p = static_cast<const char*>(base) + n0 * row_bytes;
  const int64_t bytes = std::min(n1 - n0, AHEAD) * row_bytes;
  for (int64_t i = 0; i < bytes; i += 64) prefetch(p + i);
}

// the sums of the 16 lanes of four vectors, in one vector: a transposing reduction (a quarter of four reductions' work)
AVX512 inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

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
    _mm_storeu_ps(out[j], _mm_sub_ps(sum4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]),
                                     _mm_set1_ps(128.f * a.dsum[m0 + j])));
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

// the scales of blocks b..b+3 of a row as float32 (a padding block's: the row's last scale, times a zero dot product)
AVX2 inline __m128 block_scales4(const uint16_t* s, int64_t b, int64_t G, int64_t groups) {
  if (G == BLOCK && b + 4 <= groups) {
    int64_t four;
    std::memcpy(&four, s + b, 8);
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_cvtsi64_si128(four)), 16));
  }
  return _mm_setr_ps(bf16(s[std::min(b * BLOCK / G, groups - 1)]), bf16(s[std::min((b + 1) * BLOCK / G, groups - 1)]),
                     bf16(s[std::min((b + 2) * BLOCK / G, groups - 1)]),
                     bf16(s[std::min((b + 3) * BLOCK / G, groups - 1)]));
}

// one block's dot products u . q (32 unsigned nibbles by 32 signed bytes: 15 * 127 * 2 per pair, no saturation)
// times its scale, added to acc
AVX2 inline __m256 int4_block_avx2(__m256i u, const int8_t* q, const float* scale, __m256 acc) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(scale), acc);
}

// a step of 128 inputs at a time, as the packing lays them out: one pair of loads a row gives its four blocks with
// constant shifts, and the four blocks' scales times the activations' come from one vector product. The loops over
// rows and blocks are unrolled so that the sums stay in registers (kept on the stack, each add waited on a store).
template <int R>
AVX2 void int4_tile_avx2(const Int4Tile& w, const Activations& a, int64_t m0, float (*out)[NR]) {
  __m256 acc[R][NR];
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i) acc[j][i] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(15);
  const int64_t steps = w.full_blocks() / 4;
  alignas(16) float sd[4];
  for (int64_t c = 0; c < steps; ++c) {
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
      const uint8_t* p = w.rows[i].u + c * 64;
      prefetch(p + AHEAD * w.Kp / 2);
      prefetch(p + 32 + AHEAD * w.Kp / 2);
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
      const __m256i u[4] = {_mm256_and_si256(v0, low), _mm256_and_si256(v1, low),
                            _mm256_and_si256(_mm256_srli_epi16(v0, 4), low),
                            _mm256_and_si256(_mm256_srli_epi16(v1, 4), low)};
      const __m128 s = block_scales4(w.rows[i].s, 4 * c, w.G, w.groups);
#pragma GCC unroll 4
      for (int j = 0; j < R; ++j) {
        _mm_store_ps(sd, _mm_mul_ps(s, _mm_loadu_ps(a.drow(m0 + j) + 4 * c)));
        const int8_t* q = a.qrow(m0 + j) + c * 128;
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) acc[j][i] = int4_block_avx2(u[k], q + k * BLOCK, sd + k, acc[j][i]);
      }
    }
  }
  if (w.Kp % 128) {  // a last step of 64 inputs in 32 bytes (its second block may be padding: zeros)
    const int64_t b = w.full_blocks();
    for (int i = 0; i < NR; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.rows[i].u + b * 16));
      const __m256i u[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
      const float s[2] = {bf16(w.rows[i].s[std::min(b * BLOCK / w.G, w.groups - 1)]),
                          bf16(w.rows[i].s[std::min((b + 1) * BLOCK / w.G, w.groups - 1)])};
      for (int j = 0; j < R; ++j) {
        for (int k = 0; k < 2; ++k) sd[k] = s[k] * a.drow(m0 + j)[b + k];
        for (int k = 0; k < 2; ++k)
          acc[j][i] = int4_block_avx2(u[k], a.qrow(m0 + j) + (b + k) * BLOCK, sd + k, acc[j][i]);
      }
    }
  }
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i) out[j][i] = hsum256(acc[j][i]) + int4_offset_avx2(w.rows[i], w.groups, a, m0 + j);
}

// The bf16 scales of the 16 lanes of a vector of 64 inputs whose first group is g: lanes 0-7 dot its first block,
// lanes 8-15 its second. G = 32: two groups from one 32-bit broadcast, a byte shuffle moving each to the top half of
// its lanes (a bf16 value is the top half of a float32); larger G: one group.
AVX512 inline __m512 half_scales(const uint16_t* v, int64_t g, int64_t G, int64_t groups) {
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
AVX512 __m512 int4_offset_avx512(const Int4Row& w, int64_t groups, const Activations& a, int64_t m, __m512 acc) {
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 k = groups - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g)) - 1);
    const __m512 s = bf16x16(_mm256_maskz_loadu_epi16(k, w.s + g)), z = bf16x16(_mm256_maskz_loadu_epi16(k, w.z + g));
    acc = _mm512_fmadd_ps(_mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z), _mm512_maskz_loadu_ps(k, a.trow(m) + g), acc);
  }
  return acc;
}

// GS: groups of 32 (the 4 scales of a step from one 64-bit broadcast), of 64 (its 2 from one 32-bit broadcast), or 0
// (any: one group at a time, half_scales)
template <int R, int GS>
AVX512 void int4_tile_avx512(const Int4Tile& w, const Activations& a, int64_t m0, float (*out)[NR]) {
  __m512 acc[R][NR];
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < NR; ++i) acc[j][i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(15);
  // bf16 scale j of 4 into the top half of lanes 0-7 (j = 0, 2) or 8-15 (j = 1, 3)
  const __m512i to_top_01 = _mm512_set_epi32(0x03028080, 0x03028080, 0x03028080, 0x03028080, 0x03028080, 0x03028080,
                                             0x03028080, 0x03028080, 0x01008080, 0x01008080, 0x01008080, 0x01008080,
                                             0x01008080, 0x01008080, 0x01008080, 0x01008080);
  const __m512i to_top_23 = _mm512_add_epi8(to_top_01, _mm512_set1_epi32(0x04040000));
  // bf16 scale h of 2 into the top half of every lane
  const __m512i to_top_0 = _mm512_set1_epi32(0x01008080), to_top_1 = _mm512_set1_epi32(0x03028080);
  const int64_t steps = w.full_blocks() / 4;
  for (int64_t c = 0; c < steps; ++c) {  // 128 inputs, in two vectors of 64 (one at a time: registers for 4 x 4 sums)
    const int64_t g0 = c * 128 / w.G;
    for (int h = 0; h < 2; ++h) {
      __m512i u[NR];
      __m512 s[NR];
      for (int i = 0; i < NR; ++i) {
        if (h == 0) prefetch(w.rows[i].u + c * 64 + AHEAD * w.Kp / 2);
        if (c == 0 && h == 0) {  // the scales and zeros AHEAD rows on: a second stream the loads would wait on
          prefetch(w.rows[i].s + AHEAD * 2 * w.groups);
          prefetch(w.rows[i].s + AHEAD * 2 * w.groups + 2 * w.groups - 1);
        }
        const __m512i bytes = _mm512_loadu_si512(w.rows[i].u + c * 64);
        u[i] = _mm512_and_si512(h ? _mm512_srli_epi16(bytes, 4) : bytes, low);
        if (GS == 32) {  // (a padding block's scale: the row's first zero point, finite, times a zero dot product)
          int64_t four;
          std::memcpy(&four, w.rows[i].s + g0, 8);
          s[i] = _mm512_castsi512_ps(_mm512_shuffle_epi8(_mm512_set1_epi64(four), h ? to_top_23 : to_top_01));
        } else if (GS == 64) {  // (the same past the last group)
          int32_t two;
          std::memcpy(&two, w.rows[i].s + g0, 4);
          s[i] = _mm512_castsi512_ps(_mm512_shuffle_epi8(_mm512_set1_epi32(two), h ? to_top_1 : to_top_0));
        } else {
          s[i] = half_scales(w.rows[i].s, (c * 128 + h * 64) / w.G, w.G, w.groups);
        }
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
      prefetch(w.rows[i].u + steps * 64 + AHEAD * w.Kp / 2);  // (the last step's bytes too)
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.rows[i].u + steps * 64));
      u[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, low256)),
                                _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low256), 1);
      s[i] = half_scales(w.rows[i].s, g0, w.G, w.groups);
    }
    for (int j = 0; j < R; ++j) {
      const __m512i q = _mm512_loadu_si512(a.qrow(m0 + j) + first);
      const __m512 d = _mm512_loadu_ps(a.dexprow(m0 + j) + 2 * steps * 16);
      for (int i = 0; i < NR; ++i)
        acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[i], q)),
                                    _mm512_mul_ps(s[i], d), acc[j][i]);
    }
  }
  for (int j = 0; j < R; ++j) {
    for (int i = 0; i < NR; ++i) acc[j][i] = int4_offset_avx512(w.rows[i], w.groups, a, m0 + j, acc[j][i]);
    _mm_storeu_ps(out[j], sum4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
  }
}

template <int R>
AVX512 void int4_tile_avx512_any(const Int4Tile& w, const Activations& a, int64_t m0, float (*out)[NR]) {
  // groups of 32 or 64 with the step's scales inside the row's scales and zeros (always, but for a last partial step)
  if (w.G == BLOCK) return int4_tile_avx512<R, 32>(w, a, m0, out);
  if (w.G == 2 * BLOCK) return int4_tile_avx512<R, 64>(w, a, m0, out);
  int4_tile_avx512<R, 0>(w, a, m0, out);
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
    _mm_storeu_ps(out[j], sum4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
}

// ----------------------------------------------------------------------------- float32 weights, a few rows

// y = x W^T for float32 x [M, K] and W [N, K] stored in blocks of 64 outputs, Wb [ceil(N / 64), K, 64] (block b,
// input k: the weights of outputs 64b .. 64b + 63; rows past N zero). Each block is one contiguous stream of K * 256
// bytes, and each input k a broadcast of x[m, k] times 64 outputs in four vectors, summed down the block, with no
// reduction across lanes: a verification's rows (up to ROWS_F32 of them per pass) all ride on one read of the
// weights, where inductor's GEMM templates slow down at a verification's widths (BENCHMARKS.md, "Float32 products").
constexpr int64_t BLOCK_F32 = 64;
constexpr int ROWS_F32 = 6;  // 6 rows x 4 vectors of accumulators, 4 of weights, 1 broadcast: 29 of 32 registers

template <int R>
void f32b_block_portable(const float* wb, const float* x, int64_t K, float (*acc)[BLOCK_F32]) {
  for (int j = 0; j < R; ++j)
    for (int64_t o = 0; o < BLOCK_F32; ++o) acc[j][o] = 0.f;
  for (int64_t k = 0; k < K; ++k)
    for (int j = 0; j < R; ++j)
      for (int64_t o = 0; o < BLOCK_F32; ++o) acc[j][o] += wb[k * BLOCK_F32 + o] * x[j * K + k];
}

template <int R>
AVX512 void f32b_block_avx512(const float* wb, const float* x, int64_t K, float (*acc_out)[BLOCK_F32]) {
  __m512 acc[R][4];
  for (int j = 0; j < R; ++j)
    for (int q = 0; q < 4; ++q) acc[j][q] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* p = wb + k * BLOCK_F32;
    if (k % 4 == 0)  // 16 inputs ahead: the block is one stream, the hardware's prefetcher follows it past that
      for (int q = 0; q < 4; ++q) prefetch(p + 16 * BLOCK_F32 + 16 * q);
    const __m512 w0 = _mm512_loadu_ps(p), w1 = _mm512_loadu_ps(p + 16), w2 = _mm512_loadu_ps(p + 32),
                 w3 = _mm512_loadu_ps(p + 48);
    for (int j = 0; j < R; ++j) {
      const __m512 xv = _mm512_set1_ps(x[j * K + k]);
      acc[j][0] = _mm512_fmadd_ps(w0, xv, acc[j][0]);
      acc[j][1] = _mm512_fmadd_ps(w1, xv, acc[j][1]);
      acc[j][2] = _mm512_fmadd_ps(w2, xv, acc[j][2]);
      acc[j][3] = _mm512_fmadd_ps(w3, xv, acc[j][3]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int q = 0; q < 4; ++q) _mm512_storeu_ps(acc_out[j] + 16 * q, acc[j][q]);
}

#define RUN_BLOCK_F32(FN)                                     \
  switch (R) {                                                \
    case 1: FN<1>(wb, xm, K, acc); break;                     \
    case 2: FN<2>(wb, xm, K, acc); break;                     \
    case 3: FN<3>(wb, xm, K, acc); break;                     \
    case 4: FN<4>(wb, xm, K, acc); break;                     \
    case 5: FN<5>(wb, xm, K, acc); break;                     \
    default: FN<ROWS_F32>(wb, xm, K, acc); break;             \
  }

// ----------------------------------------------------------------------------- attention over the KV cache
// Grouped-query attention of a few query tokens (decode, verification) with a bool mask, without ATen's flash kernel's
// fixed cost per call (its blocking and buffers cost several times the arithmetic of a one-token step) and
// reading only the keys from the first to the last that a token may see (a long cache mostly empty costs nothing).
// The G query heads of a kv head that share a token share its mask row, so they are one task; per row the scores of
// 16 keys come from 16 dot products reduced in one transpose, then softmax and the values weighted row by row.

AVX512 inline __m512 exp512(__m512 x) {  // e^x to float32 rounding (a degree-7 polynomial of the reduced argument)
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), 0);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts: r exact to float32
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  for (float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// the sums of the 16 vectors a[0..15], lane i holding a[i]'s
AVX512 inline __m512 sums16(const __m512* a) {
  __m512 v[4];
  for (int g = 0; g < 4; ++g) {
    const __m512* b = a + 4 * g;
    const __m512 t = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
    const __m512 u = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
    v[g] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t), _mm512_castps_pd(u))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t), _mm512_castps_pd(u))));
  }  // v[g]: per 128-bit lane, the partial sums of a[4g .. 4g + 3] over that lane
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x88), _mm512_shuffle_f32x4(v[2], v[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
}

struct AttentionTask {
  const float* q;   // row g of the task at q + g * qstride, D floats
  const float* k;   // [S, D]
  const float* v;   // [S, D]
  const bool* m;    // [S]
  float* out;       // row g at out + g * qstride
  int64_t rows, qstride, D, lo, hi;
};

// keys or values [s0, s1) of a task asked for (a task's rows are short streams: the hardware prefetchers would
// still be ramping up when one ends, and a decode step's cache is not in any cache after the weights went by)
inline void prefetch_rows(const float* base, int64_t s0, int64_t s1, int64_t D) {
  const char* p = reinterpret_cast<const char*>(base + s0 * D);
  for (int64_t i = 0; i < (s1 - s0) * D * int64_t(sizeof(float)); i += 64) prefetch(p + i);
}

template <int NV>  // out rows g0 .. g0 + R of the task, NV vectors of 16 starting at column c0
AVX512 void weigh_values(const AttentionTask& w, const float* p, int64_t n, const float* inv, int64_t g0, int R,
                         int64_t c0) {
  constexpr int RB = 24 / NV;
  for (int64_t r0 = 0; r0 < R; r0 += RB) {
    const int rb = int(std::min<int64_t>(RB, R - r0));
    __m512 acc[RB][NV];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < n; ++s) {
      if (r0 == 0 && c0 == 0 && s % 4 == 0 && s + 64 < n) prefetch_rows(w.v, w.lo + s + 64, w.lo + s + 68, w.D);
      if (!w.m[w.lo + s]) continue;
      const float* vr = w.v + (w.lo + s) * w.D + c0;
      __m512 vv[NV];
      for (int c = 0; c < NV; ++c) vv[c] = _mm512_loadu_ps(vr + 16 * c);
      for (int r = 0; r < rb; ++r) {
        const __m512 pr = _mm512_set1_ps(p[(g0 + r0 + r) * n + s]);
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(pr, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < rb; ++r)
      for (int c = 0; c < NV; ++c)
        _mm512_storeu_ps(w.out + (g0 + r0 + r) * w.qstride + c0 + 16 * c,
                         _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv[g0 + r0 + r])));
  }
}

AVX512 void attend_avx512(const AttentionTask& w, float scale) {
  const int64_t n = w.hi - w.lo, blocks = (n + 15) / 16, D = w.D;
  constexpr int64_t KEYS_AHEAD = 32;  // keys (and values) asked for ahead of the block being read
  std::vector<float> p(w.rows * blocks * 16), inv(w.rows);
  prefetch_rows(w.k, w.lo, std::min(w.hi, w.lo + 2 * KEYS_AHEAD), D);
  for (int64_t g = 0; g < w.rows; ++g) {
    const float* qr = w.q + g * w.qstride;
    float* pr = p.data() + g * n;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t s0 = w.lo + 16 * b, keys = std::min<int64_t>(16, w.hi - s0);
      if (g == 0 && s0 + 2 * KEYS_AHEAD < w.hi)
        prefetch_rows(w.k, s0 + 2 * KEYS_AHEAD, std::min(w.hi, s0 + 2 * KEYS_AHEAD + 16), D);
      const __mmask16 valid = keys == 16 ? __mmask16(0xFFFF) : __mmask16((1u << keys) - 1);
      const __m128i mb = _mm_maskz_loadu_epi8(valid, w.m + s0);
      const __mmask16 allowed = _mm_test_epi8_mask(mb, mb);
      __m512 sc = _mm512_set1_ps(-INFINITY);
      if (allowed) {
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        const float* kr[16];  // (past the last key: the last again, its score masked)
        for (int i = 0; i < 16; ++i) kr[i] = w.k + std::min(s0 + i, w.hi - 1) * D;
        for (int64_t c = 0; c < D; c += 16) {
          const __m512 qc = _mm512_loadu_ps(qr + c);
          for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kr[i] + c), acc[i]);
        }
        sc = _mm512_mask_mul_ps(sc, allowed, sums16(acc), _mm512_set1_ps(scale));
      }
      mx = _mm512_max_ps(mx, sc);
      _mm512_storeu_ps(pr + 16 * b, sc);  // (p has room for the last block's 16)
    }
    if (g == 0) prefetch_rows(w.v, w.lo, std::min(w.hi, w.lo + 2 * KEYS_AHEAD), D);
    const float top = _mm512_reduce_max_ps(mx);
    if (top == -INFINITY) {  // no key allowed: zeros, as ATen's kernels give
      std::fill_n(pr, n, 0.f);
      inv[g] = 0.f;
      continue;
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t keys = std::min<int64_t>(16, n - 16 * b);
      const __mmask16 valid = keys == 16 ? __mmask16(0xFFFF) : __mmask16((1u << keys) - 1);
      const __m512 sc = _mm512_loadu_ps(pr + 16 * b);
      const __mmask16 live = _mm512_mask_cmp_ps_mask(valid, sc, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
      const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(top))));
      _mm512_storeu_ps(pr + 16 * b, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[g] = 1.f / _mm512_reduce_add_ps(sum);
  }
  // rows are n apart in p (each row's last block spills into the next row's first: written before it is read again)
  for (int64_t c0 = 0; c0 < D; c0 += 64) {
    switch (std::min<int64_t>(4, (D - c0) / 16)) {
      case 4: weigh_values<4>(w, p.data(), n, inv.data(), 0, int(w.rows), c0); break;
      case 3: weigh_values<3>(w, p.data(), n, inv.data(), 0, int(w.rows), c0); break;
      case 2: weigh_values<2>(w, p.data(), n, inv.data(), 0, int(w.rows), c0); break;
      default: weigh_values<1>(w, p.data(), n, inv.data(), 0, int(w.rows), c0); break;
    }
  }
}

// The same on AVX2: blocks of 8 keys, the mask's bytes widened to lanes (AVX2 has no mask registers), and e^x's 2^n
// built in the exponent bits (n >= -126 after the clamp, so 2^n is a normal float and the product exact, as scalef's).

AVX2 inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  for (float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// the sums of the 8 vectors a[0..7], lane i holding a[i]'s
AVX2 inline __m256 sums8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

AVX2 inline float hmax256(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// lanes of the keys [s0, s0 + keys) that the mask allows (all ones), the others zero; never reads past the row
AVX2 inline __m256 allowed8(const bool* m, int64_t keys) {
  int64_t bytes = 0;
  std::memcpy(&bytes, m, std::min<int64_t>(8, keys));
  const __m256i wide = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(wide, _mm256_setzero_si256()));
}

template <int NV>  // out rows g0 .. g0 + R of the task, NV vectors of 8 starting at column c0
AVX2 void weigh_values_avx2(const AttentionTask& w, const float* p, int64_t n, const float* inv, int R, int64_t c0) {
  constexpr int RB = 11 / NV;  // sums, a row's values and a broadcast within AVX2's 16 registers
  for (int64_t r0 = 0; r0 < R; r0 += RB) {
    const int rb = int(std::min<int64_t>(RB, R - r0));
    __m256 acc[RB][NV];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t s = 0; s < n; ++s) {
      if (r0 == 0 && c0 == 0 && s % 4 == 0 && s + 64 < n) prefetch_rows(w.v, w.lo + s + 64, w.lo + s + 68, w.D);
      if (!w.m[w.lo + s]) continue;
      const float* vr = w.v + (w.lo + s) * w.D + c0;
      __m256 vv[NV];
      for (int c = 0; c < NV; ++c) vv[c] = _mm256_loadu_ps(vr + 8 * c);
      for (int r = 0; r < rb; ++r) {
        const __m256 pr = _mm256_broadcast_ss(p + (r0 + r) * n + s);
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm256_fmadd_ps(pr, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < rb; ++r)
      for (int c = 0; c < NV; ++c)
        _mm256_storeu_ps(w.out + (r0 + r) * w.qstride + c0 + 8 * c,
                         _mm256_mul_ps(acc[r][c], _mm256_set1_ps(inv[r0 + r])));
  }
}

AVX2 void attend_avx2(const AttentionTask& w, float scale) {
  const int64_t n = w.hi - w.lo, blocks = (n + 7) / 8, D = w.D;
  constexpr int64_t KEYS_AHEAD = 32;
  std::vector<float> p(w.rows * blocks * 8 + 8), inv(w.rows);
  prefetch_rows(w.k, w.lo, std::min(w.hi, w.lo + 2 * KEYS_AHEAD), D);
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  for (int64_t g = 0; g < w.rows; ++g) {
    const float* qr = w.q + g * w.qstride;
    float* pr = p.data() + g * n;
    __m256 mx = minus_inf;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t s0 = w.lo + 8 * b, keys = std::min<int64_t>(8, w.hi - s0);
      if (g == 0 && s0 + 2 * KEYS_AHEAD < w.hi)
        prefetch_rows(w.k, s0 + 2 * KEYS_AHEAD, std::min(w.hi, s0 + 2 * KEYS_AHEAD + 8), D);
      const __m256 allowed = allowed8(w.m + s0, keys);
      __m256 sc = minus_inf;
      if (_mm256_movemask_ps(allowed)) {
        __m256 acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
        const float* kr[8];  // (past the last key: the last again, its score masked)
        for (int i = 0; i < 8; ++i) kr[i] = w.k + std::min(s0 + i, w.hi - 1) * D;
        for (int64_t c = 0; c < D; c += 8) {
          const __m256 qc = _mm256_loadu_ps(qr + c);
          for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kr[i] + c), acc[i]);
        }
        sc = _mm256_blendv_ps(minus_inf, _mm256_mul_ps(sums8(acc), _mm256_set1_ps(scale)), allowed);
      }
      mx = _mm256_max_ps(mx, sc);
      _mm256_storeu_ps(pr + 8 * b, sc);  // (p has room for the last block's 8)
    }
    if (g == 0) prefetch_rows(w.v, w.lo, std::min(w.hi, w.lo + 2 * KEYS_AHEAD), D);
    const float top = hmax256(mx);
    if (top == -INFINITY) {  // no key allowed: zeros, as ATen's kernels give
      std::fill_n(pr, n, 0.f);
      inv[g] = 0.f;
      continue;
    }
    __m256 sum = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t keys = std::min<int64_t>(8, n - 8 * b);
      const __m256 valid = _mm256_castsi256_ps(
          _mm256_cmpgt_epi32(_mm256_set1_epi32(int(keys)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
      const __m256 sc = _mm256_loadu_ps(pr + 8 * b);
      const __m256 live = _mm256_and_ps(valid, _mm256_cmp_ps(sc, minus_inf, _CMP_NEQ_OQ));
      const __m256 e = _mm256_and_ps(live, exp256(_mm256_sub_ps(sc, _mm256_set1_ps(top))));
      _mm256_storeu_ps(pr + 8 * b, e);
      sum = _mm256_add_ps(sum, e);
    }
    inv[g] = 1.f / hsum256(sum);
  }
  // rows are n apart in p (each row's last block spills into the next row's first: written before it is read again)
  for (int64_t c0 = 0; c0 < D; c0 += 32) {
    switch (std::min<int64_t>(4, (D - c0) / 8)) {
      case 4: weigh_values_avx2<4>(w, p.data(), n, inv.data(), int(w.rows), c0); break;
      case 3: weigh_values_avx2<3>(w, p.data(), n, inv.data(), int(w.rows), c0); break;
      case 2: weigh_values_avx2<2>(w, p.data(), n, inv.data(), int(w.rows), c0); break;
      default: weigh_values_avx2<1>(w, p.data(), n, inv.data(), int(w.rows), c0); break;
    }
  }
}

// ----------------------------------------------------------------------------- operators

// fn(n0, n1) over the weight rows [0, N): one contiguous share of whole tiles per thread, so that each thread reads
// one long stream that its prefetches run ahead of (small tasks taken in turn were slower: their prefetches fed
// the other thread's next task);
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
    prefetch_first_rows(w, n0, n1, Kp);
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
    prefetch_first_rows(u, n0, n1, Kp / 2);
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
          RUN_TILE(int4_tile_avx512_any, tile, out)
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
  std::vector<float> padded(K == Kp ? 0 : M * Kp, 0.f);  // x's rows padded with zeros to Kp (if K is not)
  for (int64_t m = 0; m < M && K != Kp; ++m)
    std::memcpy(padded.data() + m * Kp, x.data_ptr<float>() + m * K, K * sizeof(float));
  const float* xp = K == Kp ? x.data_ptr<float>() : padded.data();
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Isa path = isa();
  over_rows(N, Kp, [&](int64_t n0, int64_t n1) {
    prefetch_first_rows(w, n0, n1, Kp);
    float out[MAX_ROWS][NR];
    for (int64_t n = n0; n < n1; n += NR) {
      const int8_t* rows[NR];
      for (int i = 0; i < NR; ++i) rows[i] = w + std::min(n + i, N - 1) * Kp;
      for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t R = std::min(MAX_ROWS, M - m0);
        const float* xm = xp + m0 * Kp;
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

// y = x W^T, x float32 [M, K], W packed (kernels.pack_f32) for N outputs: y [M, N]
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(1) == x.size(1) && packed.size(2) == BLOCK_F32 &&
                  packed.size(0) == (N + BLOCK_F32 - 1) / BLOCK_F32,
              "packed: contiguous float32 [ceil(N / 64), K, 64] (kernels.pack_f32)");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* w = packed.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool avx512 = isa() == AVX512_VNNI;
  // one contiguous share of blocks per thread: over_rows splits whole tiles of NR rows, so here a tile is a block
  // and a row a quarter of its K * 256 bytes
  over_rows(blocks * NR, K * BLOCK_F32, [&](int64_t r0, int64_t r1) {
    float acc[ROWS_F32][BLOCK_F32];
    for (int64_t b = r0 / NR; b < (r1 + NR - 1) / NR; ++b) {
      const float* wb = w + b * K * BLOCK_F32;
      const int64_t n = b * BLOCK_F32, width = std::min(BLOCK_F32, N - n);
      for (int64_t m0 = 0; m0 < M; m0 += ROWS_F32) {
        const int64_t R = std::min<int64_t>(ROWS_F32, M - m0);
        const float* xm = xp + m0 * K;
        if (avx512) {
          RUN_BLOCK_F32(f32b_block_avx512)
        } else {
          RUN_BLOCK_F32(f32b_block_portable)
        }
        for (int64_t j = 0; j < R; ++j) std::memcpy(yp + (m0 + j) * N + n, acc[j], width * sizeof(float));
      }
    }
  });
  return y;
}

// softmax(q k^T / sqrt(D), where mask) v. q [B, H, G * T, D] float32 (row g * T + t: query head g of kv head h's
// group, token t), k and v [B, H, S, D] (the cache), mask [B or 1, 1, T, S] bool. Own kernels for T <= 16 on
// AVX-512 and AVX2; otherwise (prefill, other CPUs) ATen's, on the keys up to the last any token may see.
at::Tensor attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask_in) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.scalar_type() == at::kFloat, "q: float32 [B, H, G * T, D]");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && k.size(0) == q_in.size(0) && k.size(1) == q_in.size(1) &&
                  k.size(3) == q_in.size(3),
              "k, v: float32 [B, H, S, D]");
  const int64_t B = q_in.size(0), H = q_in.size(1), R = q_in.size(2), D = q_in.size(3), S = k.size(2);
  TORCH_CHECK(mask_in.dim() == 4 && mask_in.scalar_type() == at::kBool && mask_in.size(3) == S && mask_in.size(2) > 0 &&
                  R % mask_in.size(2) == 0 && (mask_in.size(0) == B || mask_in.size(0) == 1),
              "mask: bool [B, 1, T, S], T dividing the query rows");
  const int64_t T = mask_in.size(2), G = R / T;
  const at::Tensor mask = mask_in.expand({B, 1, T, S}).contiguous();
  const bool* mp = mask.data_ptr<bool>();
  // per (b, t): the first and one past the last key the token may see
  std::vector<int64_t> lo(B * T), hi(B * T);
  int64_t last = 0, work = 0;  // the last key any token sees; keys read in all
  for (int64_t i = 0; i < B * T; ++i) {
    const bool* row = mp + i * S;
    const void* first = std::memchr(row, 1, S);
    lo[i] = first ? static_cast<const bool*>(first) - row : 0;
    const void* end = first ? memrchr(row, 1, S) : nullptr;
    hi[i] = end ? static_cast<const bool*>(end) - row + 1 : 0;
    last = std::max(last, hi[i]);
    work += hi[i] - lo[i];
  }
  if (last == 0) return at::zeros_like(q_in);  // no token sees any key (ATen's kernels give zeros too)
  const Isa path = isa();
  if (T > 16 || D % 16 || !k.is_contiguous() || !v.is_contiguous() || path == PORTABLE) {
    const at::Tensor m = mask.narrow(3, 0, last).unsqueeze(2).expand({B, 1, G, T, last}).reshape({B, 1, R, last});
    return at::scaled_dot_product_attention(q_in, k.narrow(2, 0, last), v.narrow(2, 0, last), m).contiguous();
  }
  const at::Tensor q = q_in.contiguous();
  at::Tensor out = at::empty_like(q);
  const float scale = 1.f / std::sqrt(float(D));
  const int64_t tasks = B * H * T;
  auto run = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (H * T), h = i / T % H, t = i % T;
      if (i + 1 < i1) {  // the next task's keys and values, read while this one computes
        const int64_t nb = (i + 1) / (H * T), nh = (i + 1) / T % H, nt = (i + 1) % T;
        const int64_t l = lo[nb * T + nt], u = std::min(hi[nb * T + nt], l + 128);
        if (nb != b || nh != h) {
          prefetch_rows(k.data_ptr<float>() + (nb * H + nh) * S * D, l, u, D);
          prefetch_rows(v.data_ptr<float>() + (nb * H + nh) * S * D, l, u, D);
        }
      }
      if (hi[b * T + t] == 0) {  // a token that sees no key: zeros
        for (int64_t g = 0; g < G; ++g) std::fill_n(out.data_ptr<float>() + ((b * H + h) * R + g * T + t) * D, D, 0.f);
        continue;
      }
      const AttentionTask w{q.data_ptr<float>() + ((b * H + h) * R + t) * D, k.data_ptr<float>() + (b * H + h) * S * D,
                            v.data_ptr<float>() + (b * H + h) * S * D, mp + (b * T + t) * S,
                            out.data_ptr<float>() + ((b * H + h) * R + t) * D, G, T * D, D, lo[b * T + t],
                            hi[b * T + t]};
      if (path == AVX512_VNNI) attend_avx512(w, scale);
      else attend_avx2(w, scale);
    }
  };
  if (work * H * G * D < (1 << 16)) run(0, tasks);
  else at::parallel_for(0, tasks, 1, run);
  return out;
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
  m.impl("f32_linear", &f32_linear);
  m.impl("attention", &attention);
}

TORCH_LIBRARY_FRAGMENT(fastgen, m) { m.def("a8_isa() -> str", &a8_isa); }

// C entry points for stored graphs (AOTInductor): a graph calls these directly instead of through its proxy executor,
// which boxes every call's arguments (kernels.C_SHIMS declares them; the names follow AOTInductor's shim convention).
#define FASTGEN_SHIM(NAME, CALL)                                       \
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({                        \
    using torch::aot_inductor::tensor_handle_to_tensor_pointer;       \
    *ret0 = torch::aot_inductor::new_tensor_handle(CALL);             \
  })
#define T(H) (*tensor_handle_to_tensor_pointer(H))

extern "C" {
AOTITorchError aoti_torch_cpu_int8_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle scales,
                                          AtenTensorHandle* ret0) {
  FASTGEN_SHIM(int8_linear, int8_linear(T(x), T(weight), T(scales)));
}
AOTITorchError aoti_torch_cpu_f32_linear(AtenTensorHandle x, AtenTensorHandle packed, int64_t N,
                                         AtenTensorHandle* ret0) {
  FASTGEN_SHIM(f32_linear, f32_linear(T(x), T(packed), N));
}
AOTITorchError aoti_torch_cpu_a8_int8_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle scales,
                                             AtenTensorHandle* ret0) {
  FASTGEN_SHIM(a8_int8_linear, a8_int8_linear(T(x), T(weight), T(scales)));
}
AOTITorchError aoti_torch_cpu_a8_int4_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                             AtenTensorHandle scales_and_zeros, int64_t groupsize,
                                             AtenTensorHandle* ret0) {
  FASTGEN_SHIM(a8_int4_linear, a8_int4_linear(T(x), T(weight), T(scales_and_zeros), groupsize));
}
AOTITorchError aoti_torch_cpu_attention(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                        AtenTensorHandle mask, AtenTensorHandle* ret0) {
  FASTGEN_SHIM(attention, attention(T(q), T(k), T(v), T(mask)));
}
// weight-only int4 (quantize.Int4Linear): ATen's own kernel, under the name the shim convention gives its operator
AOTITorchError aoti_torch_cpu_int4mm_packed_weight_cpu(AtenTensorHandle x, AtenTensorHandle weight,
                                                      AtenTensorHandle groupsize, AtenTensorHandle scales_and_zeros,
                                                      AtenTensorHandle* ret0) {
  FASTGEN_SHIM(int4mm_packed_weight_cpu,
               at::_weight_int4pack_mm_for_cpu(T(x), T(weight), T(groupsize).item<int64_t>(), T(scales_and_zeros)));
}
}
#undef T

// Paged MLA decode attention for the CPU, as an XLA FFI custom call.
//
// One query token per sequence attends over its own earlier latents, read in place from the paged pool
// through its block table, plus its own new latent. This is what `_attend_view` computes after
// `_view` has gathered a dense (B, S, A) copy of every sequence's pages; on XLA:CPU that gather and the
// operand packing of the two products took most of a long-context decode step. Here each page is read
// in place and used for both products: scores against the whole 576-wide latent ([c_kv | k_pe]) and values
// from its first C columns (FlashMLA's layout). Two paths, by what the CPU has and the widths allow:
// - AMX (a bfloat16 pool, pages of whole 32-row steps, widths in whole 32s): scores as tile products of the
//   page's rows as they lie, 16 heads to a tile; values as tile products of the same rows as they lie, each
//   head's weights given twice (for its even and its odd value columns), 8 heads to a tile. It
//   rounds the queries to bfloat16 and the softmax weights before the values product, as XLA's path over
//   gathered views does with a bfloat16 attention dtype (and FlashMLA): the runner names the float32 path
//   where its attention dtype is float32 (float32 serving).
// - float32 (anything else: a float32 pool, other widths, a CPU without AMX): each page widened to float32
//   in a small buffer, FMAs: 8 heads at a time in AVX-512 registers; on a CPU with AVX2 and FMA alone, 4
//   heads at a time in intrinsics sized for its 16 registers of 8 floats (GCC's portable vectors of 16
//   floats ran ~7x slower there, BENCHMARKS.md; -DDEEPINFER_DECODE_PORTABLE builds them, for comparison);
//   elsewhere those portable vectors.
// Sums are float32. What each path costs: BENCHMARKS.md, "Decode attention paths" (a path of AVX-512 BF16
// dot products was measured there too, no faster than float32's, and dropped).
//
// Inputs:  q_BNA   f32   the absorbed queries [q_nope @ W_UK | q_pe], at the attention dtype's precision
//          pool    u16 (bfloat16 bits) or u32 (float32 bits), (P, T, A): one layer of the latent pool
//          tables  s32   (B, Q) page ids of each sequence, in position order
//          lengths s32   (B,) rows of earlier positions each query attends over (its position)
//          fresh   f32   (B, A) each query's own latent, which is not in the pool yet
// Attrs:   scale   f32   the softmax scale
//          path    s32   0: the best this CPU and these widths allow; 1: float32; 2: AMX (an error where unavailable)
// Output:  out     f32   (B, N, C) the softmax-weighted values
//
// A sequence's result depends on its own inputs alone, summed in one fixed order (pieces of 2,048 rows,
// each an online softmax over its pages in table order; the pieces folded in order; its own latent last):
// whatever else shares the batch, and however wide the table is padded, its bits are the same. Pieces
// are spread over XLA's intra-op thread pool, so one long sequence uses every core too.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

#include "amx.h"
#if defined(DEEPINFER_AMX) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DEEPINFER_DECODE_AMX 1  // the AMX path (its softmax and layouts use AVX-512 BF16 and BW too)
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;
// An unaligned vector of 16 floats: GCC lowers it to one AVX-512 register, or two AVX2 ones.
typedef float F16 __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

inline F16 load(const float* p) { return *reinterpret_cast<const F16*>(p); }
inline void store(float* p, F16 v) { *reinterpret_cast<F16*>(p) = v; }
inline F16 splat(float x) { return F16{} + x; }
// e^x for x <= 0 (a score minus its running maximum), to ~2 ulp: 2^n by the exponent bits times a
// degree-6 polynomial of 2^f, f in [-0.5, 0.5]. Below -87 it is e^-87 (~1.6e-38), not 0.
inline F16 exp_nonpositive(F16 x) {
  typedef int32_t I16 __attribute__((vector_size(kLanes * sizeof(int32_t))));
  x = x < -87.f ? splat(-87.f) : x;
  const F16 t = x * 1.44269504088896341f;
  const F16 n = __builtin_convertvector(__builtin_convertvector(t + (t < 0 ? -0.5f : 0.5f), I16), F16);
  const F16 f = (t - n) * 0.693147180559945309f;  // e^x = 2^n * e^f, |f| <= ln2 / 2
  F16 p = splat(1.f / 720);
  p = p * f + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const I16 scale = (__builtin_convertvector(n, I16) + 127) << 23;
  return p * reinterpret_cast<const F16&>(scale);
}

inline float sum(F16 v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

struct Problem {
  const float* q;
  const void* pool;
  bool bf16;
  const int32_t* tables;
  const int32_t* lengths;
  const float* fresh;
  float* out;
  int64_t B, N, A, C, T, Q, P;
  float scale;
  int32_t path;  // 0: the best this CPU and these widths allow; 1: float32; 2: AMX
};

// Page rows [0, rows) as float32 (A floats each): widened into buf from bfloat16, or the pool itself.
const float* page_rows(const Problem& p, int64_t page, int64_t rows, float* buf) {
  if (!p.bf16) return static_cast<const float*>(p.pool) + page * p.T * p.A;
  const uint16_t* src = static_cast<const uint16_t*>(p.pool) + page * p.T * p.A;
  uint32_t* dst = reinterpret_cast<uint32_t*>(buf);
  const int64_t n = rows * p.A;
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<uint32_t>(src[i]) << 16;
  return buf;
}

// Scores of G heads (queries q, A floats apart) against rows [0, rows) of K: s[h * T + r].
template <int G>
void scores(const float* q, const float* K, int64_t rows, int64_t A, float scale, int64_t T, float* s) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {  // two rows at a time: each query vector loaded once for both
    F16 a0[G] = {}, a1[G] = {};
    const float* k0 = K + r * A;
    const float* k1 = k0 + A;
    for (int64_t i = 0; i < A; i += kLanes) {
      const F16 x0 = load(k0 + i), x1 = load(k1 + i);
      for (int h = 0; h < G; ++h) {
        const F16 qh = load(q + h * A + i);
        a0[h] += qh * x0;
        a1[h] += qh * x1;
      }
    }
    for (int h = 0; h < G; ++h) {
      s[h * T + r] = sum(a0[h]) * scale;
      s[h * T + r + 1] = sum(a1[h]) * scale;
    }
  }
  for (; r < rows; ++r) {
    F16 a0[G] = {};
    const float* k0 = K + r * A;
    for (int64_t i = 0; i < A; i += kLanes) {
      const F16 x0 = load(k0 + i);
      for (int h = 0; h < G; ++h) a0[h] += load(q + h * A + i) * x0;
    }
    for (int h = 0; h < G; ++h) s[h * T + r] = sum(a0[h]) * scale;
  }
}

// acc[h] (C floats) += sum over rows r of w[h * T + r] * K[r, 0:C], for G heads.
template <int G>
void values(const float* w, const float* K, int64_t rows, int64_t A, int64_t C, int64_t T, float* acc) {
  int64_t c = 0;
  for (; c + 2 * kLanes <= C; c += 2 * kLanes) {  // two column vectors at a time: each weight read once
    F16 a0[G], a1[G];
    for (int h = 0; h < G; ++h) a0[h] = load(acc + h * C + c), a1[h] = load(acc + h * C + c + kLanes);
    for (int64_t r = 0; r < rows; ++r) {
      const F16 x0 = load(K + r * A + c), x1 = load(K + r * A + c + kLanes);
      for (int h = 0; h < G; ++h) {
        const F16 wh = splat(w[h * T + r]);
        a0[h] += wh * x0;
        a1[h] += wh * x1;
      }
    }
    for (int h = 0; h < G; ++h) store(acc + h * C + c, a0[h]), store(acc + h * C + c + kLanes, a1[h]);
  }
  for (; c < C; c += kLanes) {
    F16 a0[G];
    for (int h = 0; h < G; ++h) a0[h] = load(acc + h * C + c);
    for (int64_t r = 0; r < rows; ++r) {
      const F16 x0 = load(K + r * A + c);
      for (int h = 0; h < G; ++h) a0[h] += splat(w[h * T + r]) * x0;
    }
    for (int h = 0; h < G; ++h) store(acc + h * C + c, a0[h]);
  }
}

// The online-softmax update of (top, total, acc) for G heads from their scores s[h * T + r], r < rows, which
// become the weights exp(score - top).
template <int G>
void soften(const Problem& p, int64_t rows, int64_t h0, float* s, float* top, float* total, float* acc) {
  for (int h = 0; h < G; ++h) {
    float* sh = s + h * p.T;
    float m = top[h0 + h];
    for (int64_t r = 0; r < rows; ++r) m = std::max(m, sh[r]);
    const float keep = std::exp(top[h0 + h] - m);  // 0 for the first page (top = -inf)
    F16 adds{};
    int64_t r = 0;
    for (; r + kLanes <= rows; r += kLanes) {
      const F16 e = exp_nonpositive(load(sh + r) - m);
      store(sh + r, e);
      adds += e;
    }
    float add = sum(adds);
    for (; r < rows; ++r) add += sh[r] = std::exp(sh[r] - m);
    total[h0 + h] = total[h0 + h] * keep + add;
    top[h0 + h] = m;
    if (keep != 1.f) {
      float* ah = acc + (h0 + h) * p.C;
      for (int64_t c = 0; c < p.C; ++c) ah[c] *= keep;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && !defined(DEEPINFER_DECODE_PORTABLE)
#define DEEPINFER_DECODE_AVX2 1  // 4 heads at a time in 8-float registers (a CPU with AVX2 and FMA, no AVX-512)
#include <immintrin.h>

// [sum of a[0], ..., sum of a[7]]: each register's 8 lanes summed, all eight at once.
inline __m256 lane_sums(const __m256* a) {
  const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// scores<4> for AVX2's 16 registers: 4 heads x 2 rows of 8-lane sums (8 registers) with 2 key and 1 query
// vectors live, so each step loads 6 vectors for 8 FMAs; the 8 sums are reduced together once per row pair.
void scores4_avx2(const float* q, const float* K, int64_t rows, int64_t A, float scale, int64_t T, float* s) {
  alignas(32) float out[8];
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    __m256 a[8];
    for (auto& x : a) x = _mm256_setzero_ps();
    const float* k0 = K + r * A;
    const float* k1 = k0 + A;
    for (int64_t i = 0; i < A; i += 8) {
      const __m256 x0 = _mm256_loadu_ps(k0 + i), x1 = _mm256_loadu_ps(k1 + i);
      for (int h = 0; h < 4; ++h) {
        const __m256 qh = _mm256_loadu_ps(q + h * A + i);
        a[2 * h] = _mm256_fmadd_ps(qh, x0, a[2 * h]);
        a[2 * h + 1] = _mm256_fmadd_ps(qh, x1, a[2 * h + 1]);
      }
    }
    _mm256_store_ps(out, _mm256_mul_ps(lane_sums(a), _mm256_set1_ps(scale)));
    for (int h = 0; h < 4; ++h) s[h * T + r] = out[2 * h], s[h * T + r + 1] = out[2 * h + 1];
  }
  if (r < rows) {  // an odd last row: its 4 sums beside 4 zeros
    __m256 a[8];
    for (auto& x : a) x = _mm256_setzero_ps();
    const float* k0 = K + r * A;
    for (int64_t i = 0; i < A; i += 8) {
      const __m256 x0 = _mm256_loadu_ps(k0 + i);
      for (int h = 0; h < 4; ++h) a[2 * h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * A + i), x0, a[2 * h]);
    }
    _mm256_store_ps(out, _mm256_mul_ps(lane_sums(a), _mm256_set1_ps(scale)));
    for (int h = 0; h < 4; ++h) s[h * T + r] = out[2 * h];
  }
}

// values<4> for AVX2: 4 heads x 16 value columns of accumulators (8 registers); each row loads 2 key vectors
// and 4 weights for 8 FMAs. Each column's sum runs over the rows in order, as values<G> sums it.
void values4_avx2(const float* w, const float* K, int64_t rows, int64_t A, int64_t C, int64_t T, float* acc) {
  for (int64_t c = 0; c < C; c += 16) {
    __m256 a0[4], a1[4];
    for (int h = 0; h < 4; ++h) a0[h] = _mm256_loadu_ps(acc + h * C + c), a1[h] = _mm256_loadu_ps(acc + h * C + c + 8);
    for (int64_t r = 0; r < rows; ++r) {
      const __m256 x0 = _mm256_loadu_ps(K + r * A + c), x1 = _mm256_loadu_ps(K + r * A + c + 8);
      for (int h = 0; h < 4; ++h) {
        const __m256 wh = _mm256_broadcast_ss(w + h * T + r);
        a0[h] = _mm256_fmadd_ps(wh, x0, a0[h]);
        a1[h] = _mm256_fmadd_ps(wh, x1, a1[h]);
      }
    }
    for (int h = 0; h < 4; ++h) _mm256_storeu_ps(acc + h * C + c, a0[h]), _mm256_storeu_ps(acc + h * C + c + 8, a1[h]);
  }
}
#endif

// One page's rows (float32) for heads [h0, h0 + G): scores, the online-softmax update, values.
template <int G>
void page_step(const Problem& p, const float* q, const float* K, int64_t rows, int64_t h0, float* s,
               float* top, float* total, float* acc) {
#ifdef DEEPINFER_DECODE_AVX2
  if constexpr (G == 4) {
    scores4_avx2(q + h0 * p.A, K, rows, p.A, p.scale, p.T, s);
    soften<G>(p, rows, h0, s, top, total, acc);
    values4_avx2(s, K, rows, p.A, p.C, p.T, acc + h0 * p.C);
    return;
  }
#endif
  scores<G>(q + h0 * p.A, K, rows, p.A, p.scale, p.T, s);
  soften<G>(p, rows, h0, s, top, total, acc);
  values<G>(s, K, rows, p.A, p.C, p.T, acc + h0 * p.C);
}

#ifdef DEEPINFER_DECODE_AMX
inline uint16_t to_bf16(float x) {  // round to nearest even (finite x)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
#endif


#ifdef DEEPINFER_DECODE_AMX
// The AMX path (pages of whole 32-row steps, 16 heads to a tile): both products read the page's rows as they
// lie in the pool, with no per-page copy. Scores transposed, S^T = K Q^T: the page's rows are the A operand (16
// rows of 32 latent columns per tile load) and only the queries are re-laid, once per piece; the softmax runs
// lane-wise (a tile row holds one key's 16 heads). Values out = P V: the page's rows are the B operand as they
// lie (16 keys of 32 value columns, each 32-bit word a column pair), so a product sums a column pair. Each head's
// weights go into the A operand twice, in two rows: once beside zeros in the pairs' first halves (that row of the
// product is the head's even columns) and once in their second halves (its odd columns). An A tile holds 8 heads
// that way, so a group of up to 8 heads (`mini`'s) takes as many value products as with the page re-laid into
// pairs of rows, and a group of 16 twice as many. The re-layout took ~45% of the call (perf, 16 sequences x 512).
constexpr int64_t kHeads = 16;  // heads per tile (a query tile's columns; heads past N are zero)

struct Tiles {  // one thread's buffers, for every piece it takes in one call
  std::vector<uint32_t> q;       // (A / 32, 16 dim pairs, 16 heads): the B operand of the scores, per head group
  std::vector<float> st;         // (T, 16): one page's scores, rows x heads
  std::vector<uint16_t> w;       // (T / 16, 2 halves, 16, 32): the weights, A operand of the values (see weigh)
  std::vector<uint16_t> tail;    // (16, C): a last block of fewer than 16 rows, zeros past them
  std::vector<float> acc;        // (groups, C / 16, 16 heads, 16): each column tile's 1 KB in one piece
  std::vector<float> top, total;  // (groups x 16)
  Tiles(const Problem& p, int64_t groups)
      : q(groups * (p.A / 32) * 256), st(p.T * kHeads), w(4 * p.T * kHeads),
        tail(16 * p.C), acc(groups * kHeads * p.C),
        top(groups * kHeads), total(groups * kHeads) {}
};

// Whether pages take the AMX path: a bfloat16 pool, pages of whole 32-row steps, widths in whole 32s, AMX granted.
inline bool amx_path(const Problem& p) {
  return p.bf16 && p.A % 32 == 0 && p.C % 32 == 0 && p.T % 32 == 0 && p.path != 1 && deepinfer::amx_granted();
}

// Scores of head group g (its queries laid in t.q) against rows [0, rows) of page K into t.st, scaled; rows
// past `rows` are read (they are in the page) and masked later.
void scores_amx(const Problem& p, const uint16_t* K, int64_t rows, int64_t g, Tiles& t) {
  const int64_t steps = p.A / 32, row_groups = (rows + 15) / 16;
  const uint32_t* q = t.q.data() + g * steps * 256;
  for (int64_t r0 = 0; r0 < row_groups; r0 += 4) {  // tiles 0-3: up to four groups of 16 rows
    const int64_t n = std::min<int64_t>(4, row_groups - r0);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < steps; ++j) {
      _tile_loadd(5, q + j * 256, 64);
      const uint16_t* k = K + (r0 * 16) * p.A + j * 32;
#define DEEPINFER_SCORE(i) \
  if (n > i) { _tile_loadd(4, k + i * 16 * p.A, p.A * 2); _tile_dpbf16ps(i, 4, 5); }
      DEEPINFER_SCORE(0) DEEPINFER_SCORE(1) DEEPINFER_SCORE(2) DEEPINFER_SCORE(3)
#undef DEEPINFER_SCORE
    }
    float* st = t.st.data() + r0 * 16 * kHeads;
    _tile_stored(0, st, 64);
    if (n > 1) _tile_stored(1, st + 256, 64);
    if (n > 2) _tile_stored(2, st + 512, 64);
    if (n > 3) _tile_stored(3, st + 768, 64);
  }
}

// The online-softmax update of group g from t.st (lane-wise over heads); the weights go to t.w as bfloat16
// (zero past `rows`, up to the next 16): A tile (r / 16, h / 8) holds head h's weight of key r at row h % 8, word
// r % 16, first half (its even columns), and at row 8 + h % 8, second half (its odd columns); the other halves
// stay zero.
void soften_amx(const Problem& p, int64_t rows, int64_t g, Tiles& t) {
  const __m512 scale = _mm512_set1_ps(p.scale);
  __m512 m = _mm512_loadu_ps(t.top.data() + g * kHeads);
  const __m512 old = m;
  for (int64_t r = 0; r < rows; ++r) m = _mm512_max_ps(m, _mm512_mul_ps(_mm512_loadu_ps(t.st.data() + r * 16), scale));
  // ~1e-38 for the first page (old = -inf; exp_nonpositive clamps at -87): acc and total are still 0 then
  const F16 keep = exp_nonpositive((F16)_mm512_sub_ps(old, m));
  F16 add{};
  const int64_t padded = (rows + 15) / 16 * 16;
  alignas(64) uint16_t e16[16];
  for (int64_t r = 0; r < padded; ++r) {
    F16 e{};
    if (r < rows) e = exp_nonpositive((F16)_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(t.st.data() + r * 16), scale), m));
    add += e;
    _mm256_store_si256(reinterpret_cast<__m256i*>(e16), (__m256i)_mm512_cvtneps_pbh((__m512)e));
    uint16_t* w = t.w.data() + (r / 16) * 2 * 512 + 2 * (r % 16);
    for (int h = 0; h < kHeads; ++h) {
      uint16_t* a = w + (h / 8) * 512 + (h % 8) * 32;
      a[0] = a[8 * 32 + 1] = e16[h];
    }
  }
  float* total = t.total.data() + g * kHeads;
  _mm512_storeu_ps(total, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(total), (__m512)keep), (__m512)add));
  _mm512_storeu_ps(t.top.data() + g * kHeads, m);
  alignas(64) float kept[16];
  _mm512_store_ps(kept, (__m512)keep);
  for (int h = 0; h < kHeads; ++h) {  // head h's rows of its accumulator tiles (values_amx)
    if (kept[h] == 1.f) continue;
    const __m512 k = _mm512_set1_ps(kept[h]);
    for (int64_t j = 0; j < p.C / 32; ++j)
      for (int e = 0; e < 2; ++e) {
        float* a = t.acc.data() + g * kHeads * p.C + (2 * j + h / 8) * 256 + (8 * e + h % 8) * 16;
        _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), k));
      }
  }
}

// Group g's accumulators += its weights (t.w) x the page's values. Accumulator tile 2j + k holds value columns
// 32j .. 32j + 32 of heads 8k .. 8k + 8: row h % 8 column i is head h's column 32j + 2i, row 8 + h % 8 its column
// 32j + 2i + 1. `halves` is 1 for a group of up to 8 heads (tiles 2j + 1 unused), else 2. A last block of fewer
// than 16 rows is copied to t.tail with zero rows after it, so a stale pool row never meets a zero weight as
// 0 x inf.
void values_amx(const Problem& p, const uint16_t* K, int64_t rows, int64_t g, int64_t halves, Tiles& t) {
  const int64_t ksteps = (rows + 15) / 16, blocks = p.C / 32, per = halves == 2 ? 2 : 4;  // blocks per pass
  if (rows % 16) {
    const int64_t first = rows / 16 * 16;
    std::fill(t.tail.begin(), t.tail.end(), uint16_t{0});
    for (int64_t r = first; r < rows; ++r) std::memcpy(&t.tail[(r - first) * p.C], K + r * p.A, p.C * 2);
  }
  float* acc = t.acc.data() + g * kHeads * p.C;
  for (int64_t j0 = 0; j0 < blocks; j0 += per) {
    const int64_t n = std::min(per, blocks - j0) * halves;  // accumulators: i -> tile 2 (j0 + i / halves) + i % halves
    auto tile = [&](int64_t i) { return acc + (2 * (j0 + i / halves) + i % halves) * 256; };
#define DEEPINFER_ACC(i, op) if (n > i) op(i, tile(i), 64);
    DEEPINFER_ACC(0, _tile_loadd) DEEPINFER_ACC(1, _tile_loadd) DEEPINFER_ACC(2, _tile_loadd) DEEPINFER_ACC(3, _tile_loadd)
    for (int64_t ks = 0; ks < ksteps; ++ks) {
      const bool partial = ks * 16 + 16 > rows;
      const uint16_t* v = partial ? t.tail.data() + j0 * 32 : K + ks * 16 * p.A + j0 * 32;
      const int64_t stride = (partial ? p.C : p.A) * 2;
      const uint16_t* w = t.w.data() + ks * 2 * 512;
      _tile_loadd(4, w, 64);
      if (halves == 2) {  // blocks j0, j0 + 1; heads 0-7 and 8-15
        _tile_loadd(5, w + 512, 64);
        _tile_loadd(6, v, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (n > 2) {
          _tile_loadd(7, v + 32, stride);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      } else {  // blocks j0 .. j0 + 3
        _tile_loadd(6, v, stride);
        _tile_dpbf16ps(0, 4, 6);
        if (n > 1) { _tile_loadd(7, v + 32, stride); _tile_dpbf16ps(1, 4, 7); }
        if (n > 2) { _tile_loadd(5, v + 64, stride); _tile_dpbf16ps(2, 4, 5); }
        if (n > 3) { _tile_loadd(6, v + 96, stride); _tile_dpbf16ps(3, 4, 6); }
      }
    }
    DEEPINFER_ACC(0, _tile_stored) DEEPINFER_ACC(1, _tile_stored) DEEPINFER_ACC(2, _tile_stored) DEEPINFER_ACC(3, _tile_stored)
#undef DEEPINFER_ACC
  }
}
#endif

void heads_step(const Problem& p, const float* q, const float* K, int64_t rows, float* s, float* top, float* total,
                float* acc) {
  int64_t h = 0;
#if defined(__AVX512F__)
  for (; h + 8 <= p.N; h += 8) page_step<8>(p, q, K, rows, h, s, top, total, acc);
  if (h + 4 <= p.N) page_step<4>(p, q, K, rows, h, s, top, total, acc), h += 4;
#elif defined(DEEPINFER_DECODE_AVX2)
  for (; h + 4 <= p.N; h += 4) page_step<4>(p, q, K, rows, h, s, top, total, acc);  // scores4_avx2, values4_avx2
#else
  // 16 vector registers of 8 floats: 2 heads' accumulators for two rows (or two column vectors) fill 8 of
  // them, where 8 heads' (32) spilled to the stack on every step (each head's sums are the same either way)
  for (; h + 2 <= p.N; h += 2) page_step<2>(p, q, K, rows, h, s, top, total, acc);
#endif
  if (h + 2 <= p.N) page_step<2>(p, q, K, rows, h, s, top, total, acc), h += 2;
  if (h < p.N) page_step<1>(p, q, K, rows, h, s, top, total, acc);
}

constexpr int64_t kSplitRows = 2048;  // a long sequence is split into pieces of this many rows (whole pages)

inline bool uses_amx(const Problem& p) {
#ifdef DEEPINFER_DECODE_AMX
  return amx_path(p);
#else
  return false;
#endif
}

struct Scratch {
  std::vector<float> page, s;
#ifdef DEEPINFER_DECODE_AMX
  std::unique_ptr<Tiles> tiles;  // the AMX path's (made on first use)
#endif
  explicit Scratch(const Problem& p) : page(p.bf16 && !uses_amx(p) ? p.T * p.A : 0), s(8 * p.T) {}
};

// One piece's online-softmax state: per head its top score, the sum of exp(score - top), and the
// weighted values (C floats per head), all relative to top.
struct State {
  float* top;
  float* total;
  float* acc;
  State(float* base, int64_t N) : top(base), total(base + N), acc(base + 2 * N) {}
  void clear(const Problem& p) {
    std::fill(top, top + p.N, -std::numeric_limits<float>::infinity());
    std::fill(total, total + p.N, 0.f);
    std::fill(acc, acc + p.N * p.C, 0.f);
  }
};

// Rows [first, last) of sequence b (first and last on page boundaries, or last its length) into `state`.
void piece(const Problem& p, int64_t b, int64_t first, int64_t last, Scratch& w, State state) {
  state.clear(p);
  const float* q = p.q + b * p.N * p.A;
#ifdef DEEPINFER_DECODE_AMX
  if (amx_path(p)) {
    const int64_t groups = (p.N + kHeads - 1) / kHeads, steps = p.A / 32;
    if (!w.tiles) w.tiles = std::make_unique<Tiles>(p, groups);
    Tiles& t = *w.tiles;
    std::fill(t.q.begin(), t.q.end(), 0u);  // heads past N stay zero
    for (int64_t n = 0; n < p.N; ++n)  // group n / 16, step j, dim pair k, head n % 16
      for (int64_t j = 0; j < steps; ++j)
        for (int64_t k = 0; k < 16; ++k)
          t.q[((n / kHeads) * steps + j) * 256 + k * 16 + n % kHeads] =
              to_bf16(q[n * p.A + 32 * j + 2 * k]) | uint32_t{to_bf16(q[n * p.A + 32 * j + 2 * k + 1])} << 16;
    std::fill(t.acc.begin(), t.acc.end(), 0.f);
    std::fill(t.top.begin(), t.top.end(), -std::numeric_limits<float>::infinity());
    std::fill(t.total.begin(), t.total.end(), 0.f);
    const uint16_t* pool = static_cast<const uint16_t*>(p.pool);
    for (int64_t start = first; start < last; start += p.T) {
      const uint16_t* K = pool + p.tables[b * p.Q + start / p.T] * p.T * p.A;
      const int64_t rows = std::min(p.T, last - start);
      for (int64_t g = 0; g < groups; ++g) {
        scores_amx(p, K, rows, g, t);
        soften_amx(p, rows, g, t);
        values_amx(p, K, rows, g, std::min<int64_t>(kHeads, p.N - g * kHeads) > 8 ? 2 : 1, t);
      }
    }
    for (int64_t n = 0; n < p.N; ++n) {  // heads past N are dropped
      state.top[n] = t.top[n], state.total[n] = t.total[n];
      const int64_t h = n % kHeads;  // its rows of its group's accumulator tiles (values_amx)
      const float* a = t.acc.data() + (n / kHeads) * kHeads * p.C + (h / 8) * 256 + (h % 8) * 16;
      float* out = state.acc + n * p.C;
      for (int64_t j = 0; j < p.C / 32; ++j)
        for (int64_t i = 0; i < 16; ++i) out[32 * j + 2 * i] = a[2 * j * 256 + i], out[32 * j + 2 * i + 1] = a[2 * j * 256 + 128 + i];
    }
    return;
  }
#endif
  for (int64_t start = first; start < last; start += p.T) {
    const int64_t rows = std::min(p.T, last - start);
    const float* K = page_rows(p, p.tables[b * p.Q + start / p.T], rows, w.page.data());
    heads_step(p, q, K, rows, w.s.data(), state.top, state.total, state.acc);
  }
}

// into = into (+) piece: the two softmax states as one, over the union of their rows.
void fold(const Problem& p, State into, State piece) {
  for (int64_t h = 0; h < p.N; ++h) {
    if (piece.total[h] == 0.f) continue;  // an empty piece (a sequence with no earlier rows)
    const float m = std::max(into.top[h], piece.top[h]);
    const float a = std::exp(into.top[h] - m), b = std::exp(piece.top[h] - m);  // a = 0 while into is empty
    into.total[h] = into.total[h] * a + piece.total[h] * b;
    into.top[h] = m;
    float* x = into.acc + h * p.C;
    const float* y = piece.acc + h * p.C;
    for (int64_t c = 0; c < p.C; ++c) x[c] = x[c] * a + y[c] * b;
  }
}

// Sequence b's pieces folded in order, then its own latent, normalised into out.
void finish(const Problem& p, int64_t b, int64_t first_piece, int64_t pieces, std::vector<float>& states,
            Scratch& w) {
  const int64_t stride = p.N * (p.C + 2);
  std::vector<float> mine(stride);
  State total(mine.data(), p.N);
  total.clear(p);
  for (int64_t i = 0; i < pieces; ++i) fold(p, total, State(states.data() + (first_piece + i) * stride, p.N));
  heads_step(p, p.q + b * p.N * p.A, p.fresh + b * p.A, 1, w.s.data(), total.top, total.total, total.acc);
  float* out = p.out + b * p.N * p.C;
  for (int64_t h = 0; h < p.N; ++h) {
    const float inv = 1.f / total.total[h];
    for (int64_t c = 0; c < p.C; ++c) out[h * p.C + c] = total.acc[h * p.C + c] * inv;
  }
}

ffi::Error PagedMlaDecodeImpl(ffi::ThreadPool pool_threads, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer pool,
                              ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lengths,
                              ffi::Buffer<ffi::F32> fresh, float scale, int32_t path,
                              ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), pd = pool.dimensions(), td = tables.dimensions(), od = out->dimensions();
  if (qd.size() != 3 || pd.size() != 3 || td.size() != 2 || od.size() != 3)
    return ffi::Error::InvalidArgument("paged_mla_decode: q (B, N, A), pool (P, T, A), tables (B, Q), out (B, N, C)");
  Problem p;
  p.B = qd[0], p.N = qd[1], p.A = qd[2], p.P = pd[0], p.T = pd[1], p.Q = td[1], p.C = od[2];
  const auto type = pool.element_type();
  if (type != ffi::DataType::U16 && type != ffi::DataType::U32)
    return ffi::Error::InvalidArgument("paged_mla_decode: the pool holds bfloat16 (u16) or float32 (u32) bits");
  if (pd[2] != p.A || td[0] != p.B || lengths.element_count() != static_cast<size_t>(p.B) || od[0] != p.B ||
      od[1] != p.N || fresh.element_count() != static_cast<size_t>(p.B * p.A) || p.A % kLanes || p.C % kLanes ||
      p.C > p.A)
    return ffi::Error::InvalidArgument("paged_mla_decode: mismatched shapes");
  p.q = q.typed_data(), p.pool = pool.untyped_data(), p.bf16 = type == ffi::DataType::U16;
  p.tables = tables.typed_data(), p.lengths = lengths.typed_data(), p.fresh = fresh.typed_data();
  p.out = out->typed_data(), p.scale = scale, p.path = path;
  if (path < 0 || path > 2) return ffi::Error::InvalidArgument("paged_mla_decode: path is 0 to 2");
  if (path == 2 && !uses_amx(p))
    return ffi::Error::InvalidArgument("paged_mla_decode: the asked-for path is unavailable for this CPU or these widths");
  for (int64_t b = 0; b < p.B; ++b) {  // the table is trusted only as far as it is checked
    const int64_t length = p.lengths[b];
    if (length < 0 || length > p.Q * p.T)
      return ffi::Error::InvalidArgument("paged_mla_decode: a length past its table");
    for (int64_t i = 0; i * p.T < length; ++i)
      if (p.tables[b * p.Q + i] < 0 || p.tables[b * p.Q + i] >= p.P)
        return ffi::Error::InvalidArgument("paged_mla_decode: a page id outside the pool");
  }

  // Work items are pieces of kSplitRows rows (a short sequence is one piece, an empty one an empty piece),
  // so a long sequence alone still uses every thread. Pieces go to whichever thread is free next (the
  // calling thread works too); whoever finishes a sequence's last piece folds its pieces, always in order:
  // how a sequence is cut depends on its length alone, never on the batch.
  const int64_t split = std::max<int64_t>(1, kSplitRows / p.T) * p.T;
  std::vector<int64_t> first_piece(p.B + 1, 0);  // sequence b's pieces are items [first_piece[b], first_piece[b + 1])
  for (int64_t b = 0; b < p.B; ++b)
    first_piece[b + 1] = first_piece[b] + std::max<int64_t>(1, (p.lengths[b] + split - 1) / split);
  const int64_t items = first_piece[p.B];
  std::vector<float> states(items * p.N * (p.C + 2));
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[p.B]);
  for (int64_t b = 0; b < p.B; ++b) left[b].store(first_piece[b + 1] - first_piece[b]);
  deepinfer::parallel_tiled_items(pool_threads, items, uses_amx(p), [&](int64_t first, auto claim) {
    Scratch scratch(p);
    for (int64_t i = first; i >= 0; i = claim()) {
      const int64_t b = std::upper_bound(first_piece.begin(), first_piece.end(), i) - first_piece.begin() - 1;
      const int64_t start = (i - first_piece[b]) * split;
      piece(p, b, start, std::min<int64_t>(p.lengths[b], start + split), scratch,
            State(states.data() + i * p.N * (p.C + 2), p.N));
      if (left[b].fetch_sub(1, std::memory_order_acq_rel) == 1)
        finish(p, b, first_piece[b], first_piece[b + 1] - first_piece[b], states, scratch);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedMlaDecode, PagedMlaDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("path")
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Whether this build and CPU have the AMX path (for a bfloat16 pool whose widths allow it).
extern "C" int PagedMlaDecodeAmxAvailable() {
#ifdef DEEPINFER_DECODE_AMX
  return deepinfer::amx_granted() ? 1 : 0;
#else
  return 0;
#endif
}

// MLA prefill attention in the absorbed form for the CPU's AMX tiles, as an XLA FFI custom call.
//
// Each query row (a head of a token: [q_nope @ W_UK | q_pe], A = C + R wide) attends over the rows of a
// sequence's latent view ([c_kv | k_pe], A wide) up to its own position: scores against the whole
// latent, a softmax, values from the first C columns (FlashMLA's layout). This is what
// `MLAttention._attend_blockwise` computes in XLA; there the scores go to memory and back for each of the
// mask, the max, the exponent, the sum and the conversion (BENCHMARKS.md, prefill attention kernel, has
// both side by side).
// Here it is flash attention on tiles: 16 query rows to a tile, 64 view rows per step, the scores of a step
// kept in a 4 KB buffer, an online softmax in AVX-512, probabilities rounded to bfloat16 (as XLA's path
// rounds them) and the values accumulated in float32. Groups of 16 tiles (256 query rows) go through each
// step's view rows together, so the view streams from memory once per group, not once per tile, and two
// tiles at a time, so each key and value tile loaded serves both.
//
// The view is re-laid once per call for the tiles, shared by every query row: keys as (dim pairs x rows)
// tiles, values as (row pairs x columns) tiles. Query tiles go to XLA's intra-op threads.
//
// Inputs:  q      bf16  (N, T, A): the absorbed queries, head-major
//          view   u16   (S, A): the latent view's raw bfloat16 bits
//          pos    s32   (T,): each token's position; a query sees view rows [0, min(pos + 1, view))
// Attrs:   scale  f32   the softmax scale;  view  s64  the view's valid rows (<= S);  C  s64  value columns
// Output:  out    f32   (N, T, C): the softmax-weighted values, normalised
//
// MlaPrefillPagedAttention is the same for M tiles of T tokens at once, each over its own sequence's pages of
// the latent pool read in place (no gathered view): what a pass of several sequences' prefill segments
// computes (model/runner.py). Called once per tile, XLA's loop over the tiles, the view each one gathered
// and the copies in and out of the loop cost about as much as the attention itself.
// Inputs:  q      bf16  (N, M * T, A): tile m's queries are rows m * T .. + T of each head
//          pool   u16   (P, B, A): the pool's pages (B a multiple of 64 rows)
//          tables s32   (M, Q): tile m's pages, in position order; view rows [0, valid) of a tile are in its
//                       first ceil(valid / B) pages (valid <= Q * B)
//          pos    s32   (M, T): each token's position
// Output:  out    f32   (N, M * T, C)
// A tile's rows give the bits the single-view call gives for the same queries over the same rows. Consecutive
// tiles with the same table are laid out once together (a segment of several tiles).
//
// A query row's result depends on its own query, its position and the view alone, summed in a fixed
// order (blocks of 64 view rows from row 0): whatever else shares the call, its bits are the same.
//
// The expanded form over one sequence's pages, in two calls: each head attends with its own keys
// [c_kv @ W_UK | k_pe] (A = H + R wide) and values c_kv @ W_UV (V wide), 320 multiply-adds per query-key pair and
// head against the absorbed form's 1,088.
// MlaExpandPages computes the keys and values of the view's first `end` rows straight into the layout the
// attention reads: for each 64-row step the latent rows are transposed once, then per head K_nope^T = W_UK^T .
// latent^T and V = latent . W_UV are tile products (k_pe's tiles are the latent's own, shared by every head),
// rounded to bfloat16 from float32 sums. A layer's chunks share it.
// Inputs:  pool   u16   (P, B, L): the pool's pages, L = Cl + R
//          table  s32   (Q,): the sequence's pages, in position order
//          end    s32   (1,): rows to compute (<= S; the last step's rows past it are zeros, rows past its step
//                       are not written)
//          w_uk   bf16  W_UK^T as A tiles (N, H / 16, Cl / 32, 16, 32)
//          w_uv   bf16  W_UV as B tiles (N, V / 16, Cl / 32, 16, 16, 2)
//          into   u16   (N, S, A + V): the output's memory (aliased to it: a buffer reused layer after layer, so
//                       a layer's call does not fault in fresh pages)
// Output:  laid   u16   (N, S, A + V): per head its key tiles (S x A), then its value tiles (S x V)
// MlaPrefillExpandedAttention: each head's query rows a problem as above, over its laid-out keys and values.
// Inputs:  q      bf16  (N, T, A): [q_nope | q_pe], head-major;  laid  as above;  pos  s32  (T,): positions < end
// Attrs:   scale  f32
// Output:  out    f32   (N, T, V)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "xla/ffi/api/ffi.h"

#if defined(DEEPINFER_AMX) && defined(__AVX512BF16__)
#define DEEPINFER_AMX_ATTENTION 1
#endif

namespace ffi = xla::ffi;

namespace {

#ifdef DEEPINFER_AMX_ATTENTION

constexpr int64_t kRows = 16;   // query rows per tile
constexpr int64_t kStep = 64;   // view rows per softmax step
constexpr int64_t kMaxC = 1024; // value columns a call may have

// 2^y for y <= kSlack to ~1e-7: 2^n 2^f, n = round(y), f = y - n in [-0.5, 0.5], 2^f by degree 6 (Taylor in
// f ln 2); y below -126 gives ~0.
constexpr float kSlack = 8.f;  // how far (log2) a row's scores may pass its reference maximum before a rescale
inline __m512 exp2_bounded(__m512 y) {
  y = _mm512_max_ps(y, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-04f);  // ln2^6 / 720
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));  // ln2^5 / 120
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));  // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

struct Problem {
  const uint16_t* q;     // (N, stride, A) bfloat16 bits: this problem's token t of head n is row n * stride + t0 + t
  const uint16_t* view;  // (S, A), or the pool's pages (P, B, A) when `table` is given
  const int32_t* table;  // the view's pages, or null
  int64_t page;          // rows per page
  const int32_t* pos;    // (T,)
  float* out;            // (N, stride, C), rows as q's
  int64_t stride, t0;
  int64_t N, T, A, C, rows, span;  // rows: N * T; span: view rows the call reads (a multiple of kStep, zero past `view`)
  int64_t valid;                   // the view's valid rows
  float scale;
  uint16_t* keys;    // (span / 16, A / 32) tiles of (16 dim pairs x 16 rows x 2)
  uint16_t* values;  // (span / 32, C / 16) tiles of (16 row pairs x 16 columns x 2)
};

// View rows [s0, s0 + kStep) of a problem's view (rows L bfloat16 wide): in place, or, for the last step, a copy
// with zeros past `valid` (this thread's buffer, until its next call).
const uint16_t* step_rows(const Problem& p, int64_t L, int64_t s0) {
  const uint16_t* first = p.table ? p.view + (p.table[s0 / p.page] * p.page + s0 % p.page) * L : p.view + s0 * L;
  if (s0 + kStep <= p.valid) return first;
  thread_local std::vector<uint16_t> buffer;
  buffer.assign(kStep * L, 0);
  if (p.valid > s0) std::memcpy(buffer.data(), first, (p.valid - s0) * L * 2);
  return buffer.data();
}

// A step's rows (L bfloat16 wide) as B tiles: tile (j, kk), at out + (j * block + kk) * 256 words, row d (column
// pair 16 kk + d) holds rows 16 j .. + 16 of that pair.
void transpose_step(const uint16_t* rows, int64_t L, int64_t block, uint32_t* out) {
  const int64_t words = L / 2;  // a row is L / 2 words of two bfloat16
  for (int64_t j = 0; j < kStep / 16; ++j)
    for (int64_t kk = 0; kk < L / 32; ++kk)
      deepinfer::transpose16(reinterpret_cast<const uint32_t*>(rows) + 16 * j * words + 16 * kk, words,
                             out + (j * block + kk) * 256);
}

// Rows [s0, s0 + kStep) of the view into the key and value tiles (rows past `valid` as zeros).
void lay_out(const Problem& p, int64_t s0) {
  const int64_t A = p.A, kk_tiles = A / 32;
  const uint16_t* rows = step_rows(p, A, s0);
  // keys: tile (s0 / 16 + j, kk) row d (dim pair 16 kk + d) holds rows s0 + 16 j .. + 16 of that pair
  transpose_step(rows, A, kk_tiles, reinterpret_cast<uint32_t*>(p.keys) + (s0 / 16) * kk_tiles * 256);
  // values: tile (s0 / 32 + h, c / 16) row e (row pair) holds columns c .. c + 16 of rows 2e, 2e + 1 interleaved
  const int64_t c_tiles = p.C / 16;
  for (int64_t h = 0; h < kStep / 32; ++h)
    for (int64_t e = 0; e < 16; ++e) {
      const uint16_t* a = rows + (32 * h + 2 * e) * A;
      const uint16_t* b = a + A;
      for (int64_t c = 0; c < p.C; c += 32) {
        const __m512i va = _mm512_loadu_si512(a + c), vb = _mm512_loadu_si512(b + c);
        uint16_t* t0 = p.values + (((s0 / 32 + h) * c_tiles + c / 16) * 512) + e * 32;
        __m512i lo, hi;
        deepinfer::pair_rows(va, vb, lo, hi);
        _mm512_storeu_si512(t0, lo);
        _mm512_storeu_si512(t0 + 512, hi);
      }
    }
}

constexpr int64_t kGroup = 16;  // query tiles that share each step's view rows while they are in cache

struct Scratch {  // one thread's: a group of query tiles' state
  std::vector<uint16_t> q = std::vector<uint16_t>(kGroup * kRows * 1024);  // per tile (A / 32) A tiles
  // running values, per tile C / 16 blocks of 16 rows x 16 columns (a tile load of one reads 1 KB in a row;
  // in rows of C floats its 16 rows lay 2 KB apart, in two of L1's sets)
  std::vector<float> acc = std::vector<float>(kGroup * kRows * kMaxC);
  alignas(64) float scores[2][2][kRows * kStep];  // a step's scores of a pair of tiles, two pairs (pipelined)
  alignas(64) uint16_t probs[2][2 * kRows * 32];                           // their probabilities: two A tiles each
  alignas(64) float total[kGroup * kRows * 16];  // each row's running sum, by lane (summed at the end)
  float top[kGroup * kRows];                     // each row's reference maximum (raw scores)
  int64_t limit[kGroup * kRows], span[kGroup], seen_all[kGroup];  // seen_all: view rows every real row of a tile sees
};

// The online softmax of tile x's 16 rows over view rows [s0, s0 + 64) (their scores in `scores`), with a lazy
// reference: e = 2^((score - top) scale log2 e), where a row's `top` only moves (and its running values and sum
// are rescaled) when a score passes it by more than kSlack in log2 units, so that most steps rescale nothing
// and need no horizontal maximum (FlashAttention-3's trick; the final division makes any reference give the
// same softmax). Probabilities to bfloat16 in two A tiles in `probs` (view rows s0 .. +32 and +32 .. +64),
// zeros where a row does not see a view row.
void softmax_step(const Problem& p, Scratch& w, int64_t x, int64_t s0, const float* scores, uint16_t* probs) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float c = p.scale * 1.4426950408889634f;  // scores to log2 units
  const __m512 vc = _mm512_set1_ps(c);
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const bool masked = s0 + kStep > w.seen_all[x];  // some row of the tile stops seeing in this step
  float* acc = w.acc.data() + x * kRows * p.C;
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t i = x * kRows + r;
    uint16_t* p0 = probs + r * 32;
    __m512 v[4];
    __mmask16 seen[4] = {0xffff, 0xffff, 0xffff, 0xffff};
    if (masked) {
      if (w.limit[i] <= s0) {  // nothing visible to this row in this step
        std::memset(p0, 0, 64);
        std::memset(p0 + 512, 0, 64);
        continue;
      }
      for (int j = 0; j < 4; ++j)
        seen[j] = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(s0 + 16 * j))),
                                          _mm512_set1_epi32(static_cast<int>(w.limit[i])));
    }
    __m512 m = _mm512_set1_ps(neg_inf);
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm512_load_ps(scores + r * kStep + 16 * j);
      m = _mm512_mask_max_ps(m, seen[j], m, v[j]);
    }
    // scores past top + kSlack / c move the reference (always on a row's first step: top is -inf)
    if (_mm512_cmp_ps_mask(m, _mm512_set1_ps(w.top[i] + kSlack / c), _CMP_GT_OQ)) {
      const float new_top = _mm512_reduce_max_ps(m);
      float* total = w.total + i * 16;
      if (w.top[i] != neg_inf) {
        const __m512 k = _mm512_set1_ps(std::exp2((w.top[i] - new_top) * c));
        _mm512_store_ps(total, _mm512_mul_ps(_mm512_load_ps(total), k));
        for (int64_t col = 0; col < p.C; col += 16)
          _mm512_storeu_ps(acc + col * 16 + r * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + col * 16 + r * 16), k));
      }
      w.top[i] = new_top;
    }
    const __m512 tc = _mm512_set1_ps(w.top[i] * c);
    __m512 e[4];
    for (int j = 0; j < 4; ++j) e[j] = _mm512_maskz_mov_ps(seen[j], exp2_bounded(_mm512_fmsub_ps(v[j], vc, tc)));
    float* total = w.total + i * 16;
    _mm512_store_ps(total, _mm512_add_ps(_mm512_load_ps(total),
                                         _mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3]))));
    _mm512_store_si512(p0, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    _mm512_store_si512(p0 + 512, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
  }
}

// Query rows are taken token-major inside the kernel (row i is token i / N, head i % N), so a tile's rows
// and a group's tiles have nearby positions. Rows [g * 256, + 256) (fewer at the end): flash attention over
// their visible view rows, every tile of the group through one step's view rows before the next step, two
// tiles at a time so that each key and value tile loaded serves both (a group's odd last tile pairs with an
// empty one).
void group_rows(const Problem& p, int64_t g, Scratch& w) {
  const int64_t A = p.A, C = p.C, kk_tiles = A / 32, c_tiles = C / 16;
  const int64_t first = g * kGroup * kRows, n = std::min<int64_t>(kGroup * kRows, p.rows - first);
  const int64_t tiles = (n + 2 * kRows - 1) / (2 * kRows) * 2;  // even
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t span = 0;
  for (int64_t x = 0; x < tiles; ++x) w.span[x] = 0, w.seen_all[x] = std::numeric_limits<int64_t>::max();
  for (int64_t i = 0; i < tiles * kRows; ++i) {
    const int64_t row = first + i, token = row / p.N, head = row % p.N;
    const bool real = i < n;
    w.limit[i] = real ? std::min<int64_t>(p.pos[token] + 1, p.valid) : 0;
    w.span[i / kRows] = std::max(w.span[i / kRows], w.limit[i]);
    if (real) w.seen_all[i / kRows] = std::min(w.seen_all[i / kRows], w.limit[i]);
    span = std::max(span, w.limit[i]);
    w.top[i] = neg_inf;
    std::memset(w.total + i * 16, 0, 64);
    for (int64_t kk = 0; kk < kk_tiles; ++kk) {  // tile i / 16's A tile kk holds dims 32 kk .. + 32
      uint16_t* dst = w.q.data() + ((i / kRows) * kk_tiles + kk) * 512 + (i % kRows) * 32;
      if (real) std::memcpy(dst, p.q + (head * p.stride + p.t0 + token) * A + kk * 32, 64);
      else std::memset(dst, 0, 64);
    }
  }
  std::memset(w.acc.data(), 0, sizeof(float) * tiles * kRows * C);

  for (int64_t s0 = 0; s0 < span; s0 += kStep) {
    const uint16_t* keys = p.keys + (s0 / 16) * kk_tiles * 512;
    const uint16_t* values = p.values + (s0 / 32) * c_tiles * 512;
    // scores of the pair (x, x + 1) (2 x 16 x 64) = queries (2 x 16 x A) . keys (A x 64) into `scores`, 32 view
    // rows at a time: accumulators 0-1 for tile x, 2-3 for tile x + 1, each (query tile, key tile) load used
    // twice
    auto scores_of = [&](int64_t x, float (*scores)[kRows * kStep]) {
      const uint16_t* qx = w.q.data() + x * kk_tiles * 512;
      const uint16_t* qy = qx + kk_tiles * 512;
      for (int64_t h = 0; h < 2; ++h) {
        const uint16_t* k0 = keys + (2 * h) * kk_tiles * 512;
        const uint16_t* k1 = k0 + kk_tiles * 512;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kk = 0; kk < kk_tiles; ++kk) {
          _tile_loadd(4, qx + kk * 512, 64);
          _tile_loadd(6, k0 + kk * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(5, qy + kk * 512, 64);
          _tile_dpbf16ps(2, 5, 6);
          _tile_loadd(7, k1 + kk * 512, 64);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, scores[0] + 32 * h, kStep * 4);
        _tile_stored(1, scores[0] + 32 * h + 16, kStep * 4);
        _tile_stored(2, scores[1] + 32 * h, kStep * 4);
        _tile_stored(3, scores[1] + 32 * h + 16, kStep * 4);
      }
    };
    // the pair's softmax, then values: acc (16 x C) += probs (16 x 64) . view rows (64 x C) for both tiles, 16
    // columns at a time; A tiles 4-5 tile x's probabilities, 6-7 tile x + 1's; each value tile loaded serves both
    auto values_of = [&](int64_t x, float (*scores)[kRows * kStep]) {
      softmax_step(p, w, x, s0, scores[0], w.probs[0]);
      softmax_step(p, w, x + 1, s0, scores[1], w.probs[1]);
      float* ax = w.acc.data() + x * kRows * C;
      float* ay = ax + kRows * C;
      _tile_loadd(4, w.probs[0], 64);
      _tile_loadd(5, w.probs[0] + 512, 64);
      _tile_loadd(6, w.probs[1], 64);
      _tile_loadd(7, w.probs[1] + 512, 64);
      for (int64_t c = 0; c < c_tiles; ++c) {
        _tile_loadd(0, ax + c * 256, 64);
        _tile_loadd(1, ay + c * 256, 64);
        _tile_loadd(2, values + c * 512, 64);
        _tile_dpbf16ps(0, 4, 2);
        _tile_dpbf16ps(1, 6, 2);
        _tile_loadd(3, values + (c_tiles + c) * 512, 64);
        _tile_dpbf16ps(0, 5, 3);
        _tile_dpbf16ps(1, 7, 3);
        _tile_stored(0, ax + c * 256, 64);
        _tile_stored(1, ay + c * 256, 64);
      }
    };
    // Pipelined: a pair's scores are issued before the previous pair's softmax, so the tiles compute them while
    // the vector units run the softmax.
    int64_t pending = -1, slot = 0;
    for (int64_t x = 0; x < tiles; x += 2) {
      if (s0 >= std::max(w.span[x], w.span[x + 1])) continue;
      scores_of(x, w.scores[slot]);
      if (pending >= 0) values_of(pending, w.scores[slot ^ 1]);
      pending = x, slot ^= 1;
    }
    if (pending >= 0) values_of(pending, w.scores[slot ^ 1]);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = first + i, token = row / p.N, head = row % p.N;
    const float total = _mm512_reduce_add_ps(_mm512_load_ps(w.total + i * 16));
    const float inv = total > 0.f ? 1.f / total : 0.f;
    const float* acc = w.acc.data() + (i / kRows) * kRows * C + (i % kRows) * 16;  // row i % 16 of its tile
    float* out = p.out + (head * p.stride + p.t0 + token) * C;
    for (int64_t c = 0; c < C; c += 16)
      _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_loadu_ps(acc + c * 16), _mm512_set1_ps(inv)));
  }
}

// The expanded form read from the pool's pages: per head, keys [K_nope | k_pe] (A = H + R wide) and values (C = V
// wide) computed from the latents on the tiles and laid out as `lay_out` lays out a view's rows.
struct Expansion {
  const uint16_t* w_uk;  // (N, H / 16, Cl / 32) A tiles: 16 nope dims x 32 latent columns (W_UK transposed)
  const uint16_t* w_uv;  // (N, V / 16, Cl / 32) B tiles: 16 latent column pairs x 16 value columns x 2
  int64_t L, Cl, H, R;   // the latent's width (Cl + R), its columns that expand, nope dims, rope dims
};

// Two rows of 16 floats (a tile's rows 2m and 2m + 1) as one row of 16 words of a bfloat16 pair (lower: row 2m).
inline __m512i pair_words(const float* even, const float* odd) {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(odd), _mm512_load_ps(even));
  return _mm512_permutexvar_epi16(_mm512_load_si512(order), both);
}

// View rows [s0, s0 + 64) of every head (problems share the pages, the positions and so the span): the latent
// rows' transposed tiles once, then per head K_nope^T = W_UK^T . latent^T (16 dims x 16 rows a tile) into the key
// tiles, k_pe's tiles copied from the latent's, and V = latent . W_UV (16 rows x 16 columns) into the value tiles.
// Keys and values are rounded to bfloat16 from float32 sums (as XLA's expanded form rounds them).
void expand_step(const std::vector<Problem>& heads, const Expansion& e, int64_t s0) {
  const Problem& p0 = heads[0];
  const int64_t L = e.L, lat_kk = L / 32, c_kk = e.Cl / 32;
  const uint16_t* rows = step_rows(p0, L, s0);
  thread_local std::vector<uint16_t> latent;
  latent.resize(4 * lat_kk * 512);  // tile (j, kk): latent column pairs 16 kk .. + 16 x rows s0 + 16 j .. + 16
  transpose_step(rows, L, lat_kk, reinterpret_cast<uint32_t*>(latent.data()));
  const int64_t A = p0.A, kk_tiles = A / 32, C = p0.C, c_tiles = C / 16;
  alignas(64) float out[4][256];
  auto store = [&]() {  // tile numbers are immediates
    _tile_stored(0, out[0], 64);
    _tile_stored(1, out[1], 64);
    _tile_stored(2, out[2], 64);
    _tile_stored(3, out[3], 64);
  };
  for (size_t h = 0; h < heads.size(); ++h) {
    uint32_t* keys = reinterpret_cast<uint32_t*>(heads[h].keys) + (s0 / 16) * kk_tiles * 256;
    uint32_t* values = reinterpret_cast<uint32_t*>(heads[h].values) + (s0 / 32) * c_tiles * 256;
    const uint16_t* w_uk = e.w_uk + h * (e.H / 16) * c_kk * 512;
    const uint16_t* w_uv = e.w_uv + h * (C / 16) * c_kk * 512;
    // K_nope^T, two dim blocks (b, b + 1) x two row blocks (j, j + 1) at a time: accumulator 2 x + y for (b + x, j + y)
    for (int64_t b = 0; b < e.H / 16; b += 2)
      for (int64_t j = 0; j < 4; j += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kk = 0; kk < c_kk; ++kk) {
          _tile_loadd(4, w_uk + (b * c_kk + kk) * 512, 64);
          _tile_loadd(6, latent.data() + (j * lat_kk + kk) * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(5, w_uk + ((b + 1) * c_kk + kk) * 512, 64);
          _tile_dpbf16ps(2, 5, 6);
          _tile_loadd(7, latent.data() + ((j + 1) * lat_kk + kk) * 512, 64);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
        store();
        for (int t = 0; t < 4; ++t) {  // dims 16 bb + 2m, + 1 are pair (bb % 2) * 8 + m of key tile (jj, bb / 2)
          const int64_t bb = b + t / 2, jj = j + t % 2;
          uint32_t* tile = keys + (jj * kk_tiles + bb / 2) * 256;
          for (int m = 0; m < 8; ++m)
            _mm512_storeu_si512(tile + ((bb % 2) * 8 + m) * 16, pair_words(out[t] + 32 * m, out[t] + 32 * m + 16));
        }
      }
    for (int64_t j = 0; j < 4; ++j)  // k_pe: the latent's last R columns, shared by every head
      std::memcpy(keys + (j * kk_tiles + e.H / 32) * 256, latent.data() + (j * lat_kk + c_kk) * 512, e.R / 32 * 1024);
    // V, two row blocks (r, r + 1) x two column blocks (c, c + 1): A tiles are the latent rows read in place
    for (int64_t r = 0; r < 4; r += 2)
      for (int64_t c = 0; c < c_tiles; c += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kk = 0; kk < c_kk; ++kk) {
          _tile_loadd(4, rows + 16 * r * L + 32 * kk, L * 2);
          _tile_loadd(6, w_uv + (c * c_kk + kk) * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(5, rows + 16 * (r + 1) * L + 32 * kk, L * 2);
          _tile_dpbf16ps(2, 5, 6);
          _tile_loadd(7, w_uv + ((c + 1) * c_kk + kk) * 512, 64);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
        store();
        for (int t = 0; t < 4; ++t) {  // rows 16 rr + 2m, + 1 are pair (rr % 2) * 8 + m of value tile (rr / 2, cc)
          const int64_t rr = r + t / 2, cc = c + t % 2;
          uint32_t* tile = values + ((rr / 2) * c_tiles + cc) * 256;
          for (int m = 0; m < 8; ++m)
            _mm512_storeu_si512(tile + ((rr % 2) * 8 + m) * 16, pair_words(out[t] + 32 * m, out[t] + 32 * m + 16));
        }
      }
  }
}

#endif  // DEEPINFER_AMX_ATTENTION

bool available() {
#ifdef DEEPINFER_AMX_ATTENTION
  return deepinfer::amx_granted();
#else
  return false;
#endif
}

#ifdef DEEPINFER_AMX_ATTENTION
// Problems (each with its `valid` set): every view laid out for the tiles, then every problem's query rows in
// groups, both spread over XLA's intra-op threads across all the problems at once (a problem of one group
// would otherwise leave the other threads idle: a head of a short chunk, or a short segment).
template <typename LayOut>
void run(ffi::ThreadPool& threads, std::vector<Problem>& problems, LayOut&& lay_out_step) {
  int64_t steps = 0, groups = 0;
  std::vector<int64_t> first_step, first_group;  // each problem's first item of each kind
  for (Problem& p : problems) {
    p.rows = p.N * p.T;
    int64_t last = 0;
    for (int64_t t = 0; t < p.T; ++t) last = std::max<int64_t>(last, std::min<int64_t>(p.pos[t] + 1, p.valid));
    p.span = (last + kStep - 1) / kStep * kStep;
    first_step.push_back(steps), first_group.push_back(groups);
    steps += p.span / kStep, groups += (p.rows + kGroup * kRows - 1) / (kGroup * kRows);
  }
  // The laid-out views (unless the problems come laid out), reused across calls on this thread (grown, never
  // shrunk): no page faults per call.
  thread_local std::vector<uint16_t> keys, values;
  const int64_t A = problems.empty() ? 0 : problems[0].A, C = problems.empty() ? 0 : problems[0].C;
  if (!problems.empty() && !problems[0].keys) {
    if (keys.size() < static_cast<size_t>(steps * kStep * A)) keys.resize(steps * kStep * A);
    if (values.size() < static_cast<size_t>(steps * kStep * C)) values.resize(steps * kStep * C);
    for (size_t i = 0; i < problems.size(); ++i)
      problems[i].keys = keys.data() + first_step[i] * kStep * A,
      problems[i].values = values.data() + first_step[i] * kStep * C;
  }
  auto owner = [](const std::vector<int64_t>& firsts, int64_t item) {  // the problem item belongs to
    return static_cast<size_t>(std::upper_bound(firsts.begin(), firsts.end(), item) - firsts.begin() - 1);
  };
  lay_out_step(steps, [&](int64_t i) {
    const size_t k = owner(first_step, i);
    return std::pair<Problem*, int64_t>(&problems[k], (i - first_step[k]) * kStep);
  });
  deepinfer::parallel_for(threads, groups, true, [&](int64_t g) {
    thread_local Scratch* scratch = new Scratch;  // one per thread, kept
    const size_t k = owner(first_group, g);
    group_rows(problems[k], g - first_group[k], *scratch);
  });
}

// Each problem's view laid out by `lay_out`, its steps spread over the threads.
void run(ffi::ThreadPool& threads, std::vector<Problem>& problems) {
  run(threads, problems, [&](int64_t steps, auto step) {
    deepinfer::parallel_for(threads, steps, false, [&](int64_t i) {
      const auto [p, s0] = step(i);
      lay_out(*p, s0);
    });
  });
}
#endif

ffi::Error check_widths(int64_t A, int64_t C) {
  if (A % 32 || A > 1024 || C % 32 || C > A || C > 1024)  // 1024: kMaxC
    return ffi::Error::InvalidArgument("mla_prefill_attention: A and C multiples of 32, C <= A <= 1024");
  return ffi::Error::Success();
}

ffi::Error MlaPrefillAttentionImpl(ffi::ThreadPool threads, ffi::AnyBuffer q, ffi::Buffer<ffi::U16> view,
                                   ffi::Buffer<ffi::S32> pos, float scale, int64_t valid, int64_t C,
                                   ffi::ResultBuffer<ffi::F32> out) {
  if (!available()) return ffi::Error::Internal("mla_prefill_attention: this CPU or build has no AMX");
#ifdef DEEPINFER_AMX_ATTENTION
  const auto qd = q.dimensions(), vd = view.dimensions(), od = out->dimensions();
  if (qd.size() != 3 || vd.size() != 2 || od.size() != 3 || q.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("mla_prefill_attention: q (N, T, A) bfloat16, view (S, A), out (N, T, C)");
  Problem p{};
  p.N = qd[0], p.T = qd[1], p.A = qd[2], p.C = C, p.scale = scale, p.stride = p.T, p.t0 = 0;
  if (vd[1] != p.A || od[0] != p.N || od[1] != p.T || od[2] != C || pos.element_count() != static_cast<size_t>(p.T))
    return ffi::Error::InvalidArgument("mla_prefill_attention: mismatched shapes");
  if (auto bad = check_widths(p.A, C); bad.failure()) return bad;
  if (valid < 0 || valid > vd[0]) return ffi::Error::InvalidArgument("mla_prefill_attention: valid <= S");
  p.q = static_cast<const uint16_t*>(q.untyped_data()), p.view = view.typed_data(), p.pos = pos.typed_data();
  p.out = out->typed_data(), p.valid = valid;
  std::vector<Problem> problems{p};
  run(threads, problems);
#endif
  return ffi::Error::Success();
}

ffi::Error MlaPrefillPagedAttentionImpl(ffi::ThreadPool threads, ffi::AnyBuffer q, ffi::Buffer<ffi::U16> pool,
                                        ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> pos, float scale,
                                        int64_t valid, int64_t C, ffi::ResultBuffer<ffi::F32> out) {
  if (!available()) return ffi::Error::Internal("mla_prefill_paged_attention: this CPU or build has no AMX");
#ifdef DEEPINFER_AMX_ATTENTION
  const auto qd = q.dimensions(), pd = pool.dimensions(), td = tables.dimensions(), sd = pos.dimensions();
  const auto od = out->dimensions();
  if (qd.size() != 3 || pd.size() != 3 || td.size() != 2 || sd.size() != 2 || od.size() != 3 ||
      q.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument(
        "mla_prefill_paged_attention: q (N, M * T, A) bfloat16, pool (P, B, A), tables (M, Q), pos (M, T), "
        "out (N, M * T, C)");
  const int64_t N = qd[0], R = qd[1], A = qd[2], P = pd[0], B = pd[1], M = td[0], Q = td[1], T = sd[1];
  if (pd[2] != A || sd[0] != M || M * T != R || od[0] != N || od[1] != R || od[2] != C)
    return ffi::Error::InvalidArgument("mla_prefill_paged_attention: mismatched shapes");
  if (auto bad = check_widths(A, C); bad.failure()) return bad;
  if (B <= 0 || B % kStep || valid < 0 || valid > Q * B)
    return ffi::Error::InvalidArgument("mla_prefill_paged_attention: pages of a multiple of 64 rows, valid <= Q * B");
  const int32_t* table = tables.typed_data();
  for (int64_t i = 0; i < M * Q; ++i)  // a page outside the pool is refused, never read
    if (i % Q < (valid + B - 1) / B && (table[i] < 0 || table[i] >= P))
      return ffi::Error::InvalidArgument("mla_prefill_paged_attention: a table names a page outside the pool");
  // Consecutive tiles with the same table (a segment of several tiles) are one problem: their view is laid
  // out once for all of them, and their rows are contiguous in q, pos and out.
  std::vector<Problem> problems;
  for (int64_t m = 0, k = 1; m < M; m += k) {
    for (k = 1; m + k < M && std::equal(table + m * Q, table + (m + 1) * Q, table + (m + k) * Q); ++k) {
    }
    Problem p{};
    p.N = N, p.T = k * T, p.A = A, p.C = C, p.scale = scale, p.stride = R, p.t0 = m * T;
    p.q = static_cast<const uint16_t*>(q.untyped_data()), p.view = pool.typed_data(), p.table = table + m * Q;
    p.page = B, p.pos = pos.typed_data() + m * T, p.out = out->typed_data(), p.valid = valid;
    problems.push_back(p);
  }
  run(threads, problems);
#endif
  return ffi::Error::Success();
}

ffi::Error MlaExpandPagesImpl(ffi::ThreadPool threads, ffi::Buffer<ffi::U16> pool, ffi::Buffer<ffi::S32> table,
                              ffi::Buffer<ffi::S32> end, ffi::AnyBuffer w_uk, ffi::AnyBuffer w_uv,
                              ffi::Buffer<ffi::U16> /* the output's memory (aliased) */,
                              ffi::ResultBuffer<ffi::U16> laid) {
  if (!available()) return ffi::Error::Internal("mla_expand_pages: this CPU or build has no AMX");
#ifdef DEEPINFER_AMX_ATTENTION
  const auto pd = pool.dimensions(), kd = w_uk.dimensions(), vd = w_uv.dimensions(), ld = laid->dimensions();
  const auto bf16 = ffi::DataType::BF16;
  if (pd.size() != 3 || kd.size() != 5 || vd.size() != 6 || ld.size() != 3 || w_uk.element_type() != bf16 ||
      w_uv.element_type() != bf16 || end.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "mla_expand_pages: pool (P, B, L), W_UK and W_UV as bfloat16 tiles, end (1,), laid (N, S, H + R + V)");
  const int64_t P = pd[0], B = pd[1], L = pd[2], N = kd[0], H = kd[1] * 16, Cl = kd[2] * 32, V = vd[1] * 16;
  const int64_t R = L - Cl, A = H + R, S = ld[1], Q = static_cast<int64_t>(table.element_count());
  if (kd[3] != 16 || kd[4] != 32 || vd[0] != N || vd[2] != Cl / 32 || vd[3] != 16 || vd[4] != 16 || vd[5] != 2 ||
      ld[0] != N || ld[2] != A + V || R <= 0)
    return ffi::Error::InvalidArgument("mla_expand_pages: mismatched shapes");
  if (H % 32 || R % 32 || V % 32 || Cl % 32 || L > 1024 || A > 1024 || V > A || S % kStep)
    return ffi::Error::InvalidArgument("mla_expand_pages: widths multiples of 32 (at most 1024), S of 64");
  const int64_t rows = std::min<int64_t>(end.typed_data()[0], S);
  if (B <= 0 || B % kStep || rows < 0 || rows > Q * B)
    return ffi::Error::InvalidArgument("mla_expand_pages: pages of a multiple of 64 rows, end <= Q * B");
  const int32_t* pages = table.typed_data();
  for (int64_t i = 0; i < (rows + B - 1) / B; ++i)  // a page outside the pool is refused, never read
    if (pages[i] < 0 || pages[i] >= P)
      return ffi::Error::InvalidArgument("mla_expand_pages: the table names a page outside the pool");
  std::vector<Problem> heads;  // what expand_step reads of them: the pages, and where each head's tiles go
  for (int64_t n = 0; n < N; ++n) {
    Problem p{};
    p.A = A, p.C = V, p.valid = rows, p.view = pool.typed_data(), p.table = pages, p.page = B;
    p.keys = laid->typed_data() + n * S * (A + V), p.values = p.keys + S * A;
    heads.push_back(p);
  }
  const Expansion e{static_cast<const uint16_t*>(w_uk.untyped_data()),
                    static_cast<const uint16_t*>(w_uv.untyped_data()), L, Cl, H, R};
  deepinfer::parallel_for(threads, (rows + kStep - 1) / kStep, true,
                          [&](int64_t i) { expand_step(heads, e, i * kStep); });
#endif
  return ffi::Error::Success();
}

ffi::Error MlaPrefillExpandedAttentionImpl(ffi::ThreadPool threads, ffi::AnyBuffer q, ffi::Buffer<ffi::U16> laid,
                                           ffi::Buffer<ffi::S32> pos, float scale, ffi::ResultBuffer<ffi::F32> out) {
  if (!available()) return ffi::Error::Internal("mla_prefill_expanded_attention: this CPU or build has no AMX");
#ifdef DEEPINFER_AMX_ATTENTION
  const auto qd = q.dimensions(), ld = laid.dimensions(), od = out->dimensions();
  if (qd.size() != 3 || ld.size() != 3 || od.size() != 3 || q.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument(
        "mla_prefill_expanded_attention: q (N, T, A) bfloat16, laid (N, S, A + V), out (N, T, V)");
  const int64_t N = qd[0], T = qd[1], A = qd[2], S = ld[1], V = od[2];
  if (ld[0] != N || ld[2] != A + V || od[0] != N || od[1] != T || pos.element_count() != static_cast<size_t>(T))
    return ffi::Error::InvalidArgument("mla_prefill_expanded_attention: mismatched shapes");
  if (auto bad = check_widths(A, V); bad.failure()) return bad;
  if (S % kStep) return ffi::Error::InvalidArgument("mla_prefill_expanded_attention: S a multiple of 64");
  std::vector<Problem> problems;
  for (int64_t n = 0; n < N; ++n) {  // each head a problem over its own laid-out keys and values
    Problem p{};
    p.N = 1, p.T = T, p.A = A, p.C = V, p.scale = scale, p.stride = T, p.t0 = 0, p.valid = S;
    p.q = static_cast<const uint16_t*>(q.untyped_data()) + n * T * A;
    p.keys = const_cast<uint16_t*>(laid.typed_data()) + n * S * (A + V), p.values = p.keys + S * A;  // read only
    p.pos = pos.typed_data(), p.out = out->typed_data() + n * T * V;
    problems.push_back(p);
  }
  run(threads, problems, [](int64_t, auto) {});  // laid out already
#endif
  return ffi::Error::Success();
}

}  // namespace

extern "C" int MlaPrefillAttentionAvailable() { return available() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(MlaPrefillAttention, MlaPrefillAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("valid")
                                  .Attr<int64_t>("C")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MlaPrefillPagedAttention, MlaPrefillPagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("valid")
                                  .Attr<int64_t>("C")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MlaExpandPages, MlaExpandPagesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::Buffer<ffi::U16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MlaPrefillExpandedAttention, MlaPrefillExpandedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());

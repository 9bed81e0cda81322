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
// computes (PagedRunner.prefill_segments). Called once per tile, XLA's loop over the tiles, the view each one
// gathered and the copies in and out of the loop cost about as much as the attention itself.
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

// e^x for x <= 0 to ~2 ulp: 2^n e^f, n = round(x / ln 2), f = x - n ln 2 (two steps), e^f by degree 7.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
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

// Rows [s0, s0 + kStep) of the view into the key and value tiles (rows past `valid` as zeros).
void lay_out(const Problem& p, int64_t s0) {
  const int64_t A = p.A, words = A / 2, kk_tiles = A / 32;  // a row is A / 2 words of two bfloat16
  const uint16_t* first = p.table ? p.view + (p.table[s0 / p.page] * p.page + s0 % p.page) * A : p.view + s0 * A;
  const uint32_t* rows32 = reinterpret_cast<const uint32_t*>(first);
  if (s0 + kStep > p.valid) {  // the last step: a copy with zeros past `valid`
    thread_local std::vector<uint32_t> buffer;
    buffer.assign(kStep * words, 0);
    if (p.valid > s0) std::memcpy(buffer.data(), rows32, (p.valid - s0) * A * 2);
    rows32 = buffer.data();
  }
  // keys: tile (s0 / 16 + j, kk) row d (dim pair 16 kk + d) holds rows s0 + 16 j .. + 16 of that pair
  for (int64_t j = 0; j < kStep / 16; ++j)
    for (int64_t kk = 0; kk < kk_tiles; ++kk)
      deepinfer::transpose16(rows32 + (16 * j) * words + 16 * kk, words,
                             reinterpret_cast<uint32_t*>(p.keys) + ((s0 / 16 + j) * kk_tiles + kk) * 256);
  // values: tile (s0 / 32 + h, c / 16) row e (row pair) holds columns c .. c + 16 of rows 2e, 2e + 1 interleaved
  const int64_t c_tiles = p.C / 16;
  for (int64_t h = 0; h < kStep / 32; ++h)
    for (int64_t e = 0; e < 16; ++e) {
      const uint16_t* a = reinterpret_cast<const uint16_t*>(rows32 + (32 * h + 2 * e) * words);
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
  alignas(64) float scores[2][kRows * kStep];                              // a step's scores, a pair of tiles
  alignas(64) uint16_t probs[2][2 * kRows * 32];                           // their probabilities: two A tiles each
  float top[kGroup * kRows], total[kGroup * kRows];
  int64_t limit[kGroup * kRows], span[kGroup];
};

// The online softmax of tile x's 16 rows over view rows [s0, s0 + 64) (their scores in `scores`), the
// running values rescaled where a row's maximum grew; probabilities to bfloat16 in two A tiles in `probs`
// (view rows s0 .. +32 and +32 .. +64), zeros where a row sees none of these view rows.
void softmax_step(const Problem& p, Scratch& w, int64_t x, int64_t s0, const float* scores, uint16_t* probs) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 scale = _mm512_set1_ps(p.scale);
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  float* acc = w.acc.data() + x * kRows * p.C;
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t i = x * kRows + r;
    __m512 v[4];
    __mmask16 seen[4];
    __m512 m = _mm512_set1_ps(neg_inf);
    for (int j = 0; j < 4; ++j) {
      seen[j] = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(s0 + 16 * j))),
                                        _mm512_set1_epi32(static_cast<int>(w.limit[i])));
      v[j] = _mm512_mul_ps(_mm512_load_ps(scores + r * kStep + 16 * j), scale);
      m = _mm512_mask_max_ps(m, seen[j], m, v[j]);
    }
    const float step_top = _mm512_reduce_max_ps(m);
    uint16_t* p0 = probs + r * 32;
    if (step_top == neg_inf) {  // nothing visible to this row in this step
      std::memset(p0, 0, 64);
      std::memset(p0 + 512, 0, 64);
      continue;
    }
    const float new_top = std::max(w.top[i], step_top);
    const __m512 t = _mm512_set1_ps(new_top);
    __m512 sum = _mm512_setzero_ps();
    __m512 e[4];
    for (int j = 0; j < 4; ++j) {
      e[j] = _mm512_maskz_mov_ps(seen[j], exp_nonpositive(_mm512_sub_ps(v[j], t)));
      sum = _mm512_add_ps(sum, e[j]);
    }
    const float rescale = w.top[i] == neg_inf ? 0.f : std::exp(w.top[i] - new_top);
    w.total[i] = w.total[i] * rescale + _mm512_reduce_add_ps(sum);
    if (rescale != 1.f) {
      const __m512 k = _mm512_set1_ps(rescale);
      for (int64_t c = 0; c < p.C; c += 16)
        _mm512_storeu_ps(acc + c * 16 + r * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + c * 16 + r * 16), k));
    }
    w.top[i] = new_top;
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
  for (int64_t x = 0; x < tiles; ++x) w.span[x] = 0;
  for (int64_t i = 0; i < tiles * kRows; ++i) {
    const int64_t row = first + i, token = row / p.N, head = row % p.N;
    const bool real = i < n;
    w.limit[i] = real ? std::min<int64_t>(p.pos[token] + 1, p.valid) : 0;
    w.span[i / kRows] = std::max(w.span[i / kRows], w.limit[i]);
    span = std::max(span, w.limit[i]);
    w.top[i] = neg_inf, w.total[i] = 0.f;
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
    for (int64_t x = 0; x < tiles; x += 2) {
      if (s0 >= std::max(w.span[x], w.span[x + 1])) continue;
      const uint16_t* qx = w.q.data() + x * kk_tiles * 512;
      const uint16_t* qy = qx + kk_tiles * 512;
      // scores of the pair (2 x 16 x 64) = queries (2 x 16 x A) . keys (A x 64), 32 view rows at a time:
      // accumulators 0-1 for tile x, 2-3 for tile x + 1, each (query tile, key tile) load used twice
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
        _tile_stored(0, w.scores[0] + 32 * h, kStep * 4);
        _tile_stored(1, w.scores[0] + 32 * h + 16, kStep * 4);
        _tile_stored(2, w.scores[1] + 32 * h, kStep * 4);
        _tile_stored(3, w.scores[1] + 32 * h + 16, kStep * 4);
      }
      softmax_step(p, w, x, s0, w.scores[0], w.probs[0]);
      softmax_step(p, w, x + 1, s0, w.scores[1], w.probs[1]);

      // values: acc (16 x C) += probs (16 x 64) . view rows (64 x C) for both tiles, 16 columns at a time;
      // A tiles 4-5 tile x's probabilities, 6-7 tile x + 1's; each value tile loaded serves both
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
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = first + i, token = row / p.N, head = row % p.N;
    const float inv = w.total[i] > 0.f ? 1.f / w.total[i] : 0.f;
    const float* acc = w.acc.data() + (i / kRows) * kRows * C + (i % kRows) * 16;  // row i % 16 of its tile
    float* out = p.out + (head * p.stride + p.t0 + token) * C;
    for (int64_t c = 0; c < C; c += 16)
      _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_loadu_ps(acc + c * 16), _mm512_set1_ps(inv)));
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
// One problem: its view laid out for the tiles, then its query rows in groups, on XLA's intra-op threads.
void run(ffi::ThreadPool& threads, Problem& p, int64_t valid) {
  p.rows = p.N * p.T, p.valid = valid;
  int64_t last = 0;
  for (int64_t t = 0; t < p.T; ++t) last = std::max<int64_t>(last, std::min<int64_t>(p.pos[t] + 1, valid));
  p.span = (last + kStep - 1) / kStep * kStep;
  // The laid-out view, reused across calls on this thread (grown, never shrunk): no page faults per call.
  thread_local std::vector<uint16_t> keys, values;
  if (keys.size() < static_cast<size_t>(p.span * p.A)) keys.resize(p.span * p.A);
  if (values.size() < static_cast<size_t>(p.span * p.C)) values.resize(p.span * p.C);
  p.keys = keys.data(), p.values = values.data();
  deepinfer::parallel_for(threads, p.span / kStep, false, [&](int64_t i) { lay_out(p, i * kStep); });
  deepinfer::parallel_for(threads, (p.rows + kGroup * kRows - 1) / (kGroup * kRows), true, [&](int64_t g) {
    thread_local Scratch* scratch = new Scratch;  // one per thread, kept
    group_rows(p, g, *scratch);
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
  p.out = out->typed_data();
  run(threads, p, valid);
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
  for (int64_t m = 0, k = 1; m < M; m += k) {
    for (k = 1; m + k < M && std::equal(table + m * Q, table + (m + 1) * Q, table + (m + k) * Q); ++k) {
    }
    Problem p{};
    p.N = N, p.T = k * T, p.A = A, p.C = C, p.scale = scale, p.stride = R, p.t0 = m * T;
    p.q = static_cast<const uint16_t*>(q.untyped_data()), p.view = pool.typed_data(), p.table = table + m * Q;
    p.page = B, p.pos = pos.typed_data() + m * T, p.out = out->typed_data();
    run(threads, p, valid);
  }
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

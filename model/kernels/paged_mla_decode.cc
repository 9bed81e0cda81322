// Paged MLA decode attention for the CPU, as an XLA FFI custom call.
//
// One query token per sequence attends over its own earlier latents, read in place from the paged pool
// through its block table, plus its own new latent. This is what `_attend_decode` computes after
// `_view` has gathered a dense (B, S, A) copy of every sequence's pages; on XLA:CPU that gather and the
// operand packing of the two products took most of a long-context decode step. Here each page is read
// once, widened to float32 in a small buffer, and used for both products: scores against the whole
// 576-wide latent ([c_kv | k_pe]) and values from its first C columns (FlashMLA's layout).
//
// Inputs:  q_BNA   f32   the absorbed queries [q_nope @ W_UK | q_pe], at the attention dtype's precision
//          pool    u16 (bfloat16 bits) or u32 (float32 bits), (P, T, A): one layer of the latent pool
//          tables  s32   (B, Q) page ids of each sequence, in position order
//          lengths s32   (B,) rows of earlier positions each query attends over (its position)
//          fresh   f32   (B, A) each query's own latent, which is not in the pool yet
// Attrs:   scale   f32   the softmax scale
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

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;
// An unaligned vector of 16 floats: GCC lowers it to one AVX-512 register, or two AVX2 ones.
typedef float F16 __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

inline F16 load(const float* p) { return *reinterpret_cast<const F16*>(p); }
inline void store(float* p, F16 v) { *reinterpret_cast<F16*>(p) = v; }
inline F16 splat(float x) { return F16{} + x; }
// e^x for x <= 0 (a score minus its running maximum), to ~2 ulp: 2^n by the exponent bits times a
// degree-6 polynomial of 2^f, f in [-0.5, 0.5]. Below -87 it is 0.
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

// One page's rows for heads [h0, h0 + G): scores, the online-softmax update of (top, total, acc), values.
template <int G>
void page_step(const Problem& p, const float* q, const float* K, int64_t rows, int64_t h0, float* s,
               float* top, float* total, float* acc) {
  scores<G>(q + h0 * p.A, K, rows, p.A, p.scale, p.T, s);
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
  values<G>(s, K, rows, p.A, p.C, p.T, acc + h0 * p.C);
}

void heads_step(const Problem& p, const float* q, const float* K, int64_t rows, float* s, float* top, float* total,
                float* acc) {
  int64_t h = 0;
  for (; h + 8 <= p.N; h += 8) page_step<8>(p, q, K, rows, h, s, top, total, acc);
  if (h + 4 <= p.N) page_step<4>(p, q, K, rows, h, s, top, total, acc), h += 4;
  if (h + 2 <= p.N) page_step<2>(p, q, K, rows, h, s, top, total, acc), h += 2;
  if (h < p.N) page_step<1>(p, q, K, rows, h, s, top, total, acc);
}

constexpr int64_t kSplitRows = 2048;  // a long sequence is split into pieces of this many rows (whole pages)

struct Scratch {
  std::vector<float> page, s;
  explicit Scratch(const Problem& p) : page(p.bf16 ? p.T * p.A : 0), s(8 * p.T) {}
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
                              ffi::Buffer<ffi::F32> fresh, float scale, ffi::ResultBuffer<ffi::F32> out) {
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
  p.out = out->typed_data(), p.scale = scale;
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
  deepinfer::parallel_items(pool_threads, items, [&](int64_t first, auto claim) {
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
                                  .Ret<ffi::Buffer<ffi::F32>>());

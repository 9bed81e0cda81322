// A product of a few rows with a bfloat16 weight matrix for the CPU, as an XLA FFI custom call.
//
// y (M, O) = x (M, I) @ W (O, I)^T for a few rows M: what `ServingLinear` computes for a decode step of a
// few sequences (up to 32 on a CPU with AMX or AVX-512, else up to 4; `FewRowProductMaxRows` says which). Such a
// product reads every weight once and does little with it, so its time should be the time to stream W from
// memory; XLA:CPU's bfloat16 product of one or two rows took 1.6-1.8x this kernel's time on `mini`'s LM head
// (BENCHMARKS.md, few-row products). Here each weight row is read once for all M rows, the next block of
// rows is prefetched while this one is multiplied, and blocks of outputs go to XLA's intra-op threads. One
// row is AVX-512 BF16 dot products; 2-32 rows are AMX tile products (16 weight rows by 16 x rows, x laid out
// in bfloat16 pairs, padded with zero rows, by 16 x 16 transposes of 32-bit words; each result tile transposed
// in registers into y's rows), where the CPU and the kernel allow AMX (amx.h); without AMX, 2-32 rows are
// float32 FMAs of weights widened in registers (one unpack per 16), 4 weight rows by 4 x rows at a time, over
// chunks of weight rows that stay in L2 while every group of 4 x rows takes them: where a CPU has AVX-512 BF16
// but no AMX, its dot products may retire at well under half the FMAs' rate (1.2 against 5.2 G/s on one core
// of a Xeon without AMX), so a product of more than a few rows is bound by them. float32 sums.
//
// Inputs:  x   f32   (M, I): each row rounded to bfloat16 (to nearest even), as `x.astype(bfloat16)` does
//          w   bf16  (O, I)
// Output:  y   f32   (M, O): bfloat16 products summed in float32
// Or each with a leading batch N (x (N, M, I), w (N, O, I), y (N, M, O)): N such products in one call, as
// decode's absorbed attention takes per head (a few rows through W_UK and W_UV of each head).
//
// Each output is one weight row's dot product with one x row, summed in an order fixed by I and by the
// path (one row; or 2-32 rows, AMX tiles or FMAs): within a path a row's result does not depend on the other
// rows or on how the outputs are shared.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && !defined(DEEPINFER_FEW_ROWS_PORTABLE)
#define DEEPINFER_FEW_ROWS_AVX2 1  // float32 FMAs in 8-float registers (a CPU with AVX2 and FMA, no AVX-512)
#endif
#if defined(__AVX512F__) || defined(DEEPINFER_FEW_ROWS_AVX2)
#define DEEPINFER_FEW_ROWS_FMA 1  // 2-32 rows (AVX2: 1-32) as float32 FMAs on weights widened in registers
#include <immintrin.h>
#endif

#include "amx.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 4;      // without AMX, AVX-512 or AVX2
constexpr int64_t kMaxFmaRows = 32;  // without AMX, with AVX-512 or AVX2: groups of kGroupRows x rows
#if defined(__AVX512F__)
constexpr int64_t kGroupRows = 4;    // x rows whose float32 FMAs share a block of widened weight rows
constexpr int64_t kFmaFromRows = 2;  // one row is AVX-512 BF16 dot products (or the portable loop)
#else
constexpr int64_t kGroupRows = 2;    // AVX2's 16 registers: 4 weight rows x 2 x rows of sums
constexpr int64_t kFmaFromRows = 1;
#endif
constexpr int64_t kChunkBytes = 1 << 17;  // weights a chunk of rows holds while every group of x rows takes it
constexpr int64_t kMaxAmxRows = 32;  // two groups of 16 x rows per pass over a block of weight rows
constexpr int64_t kStep = 32;       // bfloat16 weights per vector step (one 64-byte line)
constexpr int64_t kBlockRows = 4;   // weight rows multiplied together, their lines prefetched one block ahead
constexpr int64_t kItemRows = 512;  // weight rows per work item handed to a thread
constexpr int64_t kConvertRows = 64;  // x rows converted to bfloat16 per work item
constexpr int64_t kSpreadWords = 1 << 18;  // x of this many words or more is prepared on every thread

// n floats to bfloat16 bits, rounded to nearest even (NaN stays NaN), as XLA's convert does.
void to_bf16(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    out[i] = (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((u >> 16) | 0x40)
                                              : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)

// Rows [o0, o1) of y for M x rows (xb: M rows of I bfloat16 bits).
template <int M>
void rows_block(const uint16_t* w, const uint16_t* xb, float* y, int64_t O, int64_t I, int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + kBlockRows <= o1; o += kBlockRows) {
    __m512 acc[kBlockRows][M];
    for (int r = 0; r < kBlockRows; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    const uint16_t* block = w + o * I;
    for (int64_t k = 0; k < I; k += kStep) {
      for (int r = 0; r < kBlockRows; ++r)  // the same line of the next block's rows (past o1 is harmless)
        _mm_prefetch(reinterpret_cast<const char*>(block + (kBlockRows + r) * I + k), _MM_HINT_T0);
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(xb + m * I + k);
      for (int r = 0; r < kBlockRows; ++r) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(block + r * I + k);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
      }
    }
    for (int r = 0; r < kBlockRows; ++r)
      for (int m = 0; m < M; ++m) y[m * O + o + r] = _mm512_reduce_add_ps(acc[r][m]);
  }
  for (; o < o1; ++o) {  // the same sums, one row at a time
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < I; k += kStep) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + o * I + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(xb + m * I + k));
    }
    for (int m = 0; m < M; ++m) y[m * O + o] = _mm512_reduce_add_ps(acc[m]);
  }
}

#else

// Without AVX-512 BF16: each weight widened to float32 (exact) and multiplied by the rounded x, in lanes
// of 16 as GCC's vector extension lays them out for the target.
typedef float F16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t U16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t H16 __attribute__((vector_size(32), aligned(2)));

inline F16 widen(const uint16_t* p) {
  const U16 u = __builtin_convertvector(*reinterpret_cast<const H16*>(p), U16) << 16;
  F16 f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <int M>
void rows_block(const uint16_t* w, const uint16_t* xb, float* y, int64_t O, int64_t I, int64_t o0, int64_t o1) {
  std::vector<F16> x(M * I / 16);  // x widened once for the block's weight rows, not once per weight row
  for (int64_t i = 0; i < M * I; i += 16) x[i / 16] = widen(xb + i);
  for (int64_t o = o0; o < o1; ++o) {
    F16 acc[M] = {};
    for (int64_t k = 0; k < I; k += 16) {
      const F16 wv = widen(w + o * I + k);
      for (int m = 0; m < M; ++m) acc[m] += wv * x[(m * I + k) / 16];
    }
    for (int m = 0; m < M; ++m) {
      float s = 0;
      for (int l = 0; l < 16; ++l) s += acc[m][l];
      y[m * O + o] = s;
    }
  }
}

#endif


#if defined(__AVX512F__)

// x rows (bfloat16 bits) as float32, each 32 columns in the order that widening a 64-byte line of weights by
// unpacking its words with zeros gives (per 128-bit lane, its low four words, then its high four).
void widen_rows(const uint16_t* xb, float* xf, int64_t n) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t k = 0; k < n; k += kStep) {
    const __m512i v = _mm512_loadu_si512(xb + k);
    _mm512_storeu_si512(xf + k, _mm512_unpacklo_epi16(zero, v));
    _mm512_storeu_si512(xf + k + 16, _mm512_unpackhi_epi16(zero, v));
  }
}

// Rows [o0, o1) of y for G x rows (xf: G rows of I floats laid out by widen_rows), R weight rows at a time:
// each output a 16-lane float32 sum of FMAs, the low then the high half of every 32 columns, then reduced.
template <int R, int G>
inline void fma_rows(const uint16_t* block, const float* xf, float* y, int64_t O, int64_t I, bool prefetch) {
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t k = 0; k < I; k += kStep) {
    if (prefetch)  // the same line of the next block's rows (past the end is harmless)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(block + (R + r) * I + k), _MM_HINT_T0);
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      const __m512i v = _mm512_loadu_si512(block + r * I + k);
      lo[r] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v));
      hi[r] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v));
    }
    for (int g = 0; g < G; ++g) {
      const __m512 xl = _mm512_loadu_ps(xf + g * I + k), xh = _mm512_loadu_ps(xf + g * I + k + 16);
      for (int r = 0; r < R; ++r) acc[r][g] = _mm512_fmadd_ps(hi[r], xh, _mm512_fmadd_ps(lo[r], xl, acc[r][g]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) y[g * O + r] = _mm512_reduce_add_ps(acc[r][g]);
}

#elif defined(DEEPINFER_FEW_ROWS_AVX2)

// widen_rows in AVX2's 16-word steps: per 16 columns, each 128-bit lane's low four words, then its high four.
void widen_rows(const uint16_t* xb, float* xf, int64_t n) {
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t k = 0; k < n; k += 16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + k));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xf + k), _mm256_unpacklo_epi16(zero, v));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xf + k + 8), _mm256_unpackhi_epi16(zero, v));
  }
}

inline float reduce_add(__m256 v) {  // the 8 lanes' sum, in a fixed order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// fma_rows for AVX2: each weight row's 16 columns widened by unpacking (two registers), then FMAs for every x row
// of the group; R x G sums of 8 lanes, reduced at the end.
template <int R, int G>
inline void fma_rows(const uint16_t* block, const float* xf, float* y, int64_t O, int64_t I, bool prefetch) {
  const __m256i zero = _mm256_setzero_si256();
  __m256 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
  for (int64_t k = 0; k < I; k += 16) {
    if (prefetch && k % kStep == 0)  // the same line of the next block's rows (past the end is harmless)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(block + (R + r) * I + k), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + r * I + k));
      const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
      const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
      for (int g = 0; g < G; ++g)
        acc[r][g] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xf + g * I + k + 8),
                                    _mm256_fmadd_ps(lo, _mm256_loadu_ps(xf + g * I + k), acc[r][g]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) y[g * O + r] = reduce_add(acc[r][g]);
}

#endif

#ifdef DEEPINFER_FEW_ROWS_FMA
template <int G>
void fma_block(const uint16_t* w, const float* xf, float* y, int64_t O, int64_t I, int64_t o0, int64_t o1,
               bool prefetch) {
  int64_t o = o0;
  for (; o + kBlockRows <= o1; o += kBlockRows) fma_rows<kBlockRows, G>(w + o * I, xf, y + o, O, I, prefetch);
  for (; o < o1; ++o) fma_rows<1, G>(w + o * I, xf, y + o, O, I, false);  // the same sums, a row at a time
}
#endif

#ifdef DEEPINFER_AMX

// A tile of results (16 weight rows x 16 x rows, float32) into y: rows of x group `group`, outputs from `first`,
// transposed in registers (a store per x row, not 256 scalar stores).
inline void store_tile(const float* tile, float* y, int64_t M, int64_t O, int64_t group, int64_t first) {
  deepinfer::transpose16(reinterpret_cast<const uint32_t*>(tile), 16,
                         reinterpret_cast<uint32_t*>(y + group * 16 * O + first), O,
                         std::min<int64_t>(16, M - group * 16));
}

// Rows [o0, o1) of y, o1 - o0 a multiple of 32, for M x rows laid out as xv: groups of 16 rows, each
// (I / 2, 16, 2) bfloat16 pairs, the last group padded with zero rows. Tiles 0-3 accumulate (16 weight rows
// x 16 x rows), 4-5 hold 16 weight rows x 32 columns, 6-7 a group's 16 pairs x 16 rows.
void amx_block(const uint16_t* w, const uint16_t* xv, float* y, int64_t M, int64_t O, int64_t I, int64_t o0,
               int64_t o1) {
  alignas(64) float tile[16 * 16];
  const int64_t groups = (M + 15) / 16;
  auto store = [&](int64_t group, int64_t first) {  // tile -> y rows of x group `group`, outputs from `first`
    store_tile(tile, y, M, O, group, first);
  };
  for (int64_t o = o0; o < o1; o += 32) {
    const uint16_t* a0 = w + o * I;
    const uint16_t* a1 = a0 + 16 * I;
    for (int64_t g = 0; g < groups; g += 2) {
      const bool two = g + 1 < groups;
      const uint16_t* b0 = xv + g * 16 * I;
      const uint16_t* b1 = b0 + 16 * I;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < I; k += kStep) {
        if (g == 0)  // the same lines of the next 32 weight rows
          for (int64_t r = 0; r < 32; ++r)
            _mm_prefetch(reinterpret_cast<const char*>(a0 + (32 + r) * I + k), _MM_HINT_T0);
        _tile_loadd(4, a0 + k, I * 2);
        _tile_loadd(5, a1 + k, I * 2);
        _tile_loadd(6, b0 + k * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
          _tile_loadd(7, b1 + k * 16, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, tile, 64);
      store(g, o);
      _tile_stored(1, tile, 64);
      store(g, o + 16);
      if (two) {
        _tile_stored(2, tile, 64);
        store(g + 1, o);
        _tile_stored(3, tile, 64);
        store(g + 1, o + 16);
      }
    }
  }
}

#endif

int64_t max_rows() {
#ifdef DEEPINFER_AMX
  if (deepinfer::amx_granted()) return kMaxAmxRows;
#endif
#ifdef DEEPINFER_FEW_ROWS_FMA
  return kMaxFmaRows;
#else
  return kMaxRows;
#endif
}

ffi::Error FewRowProductImpl(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                             ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const size_t rank = xd.size();
  if ((rank != 2 && rank != 3) || wd.size() != rank || yd.size() != rank)
    return ffi::Error::InvalidArgument("few_row_product: x (M, I), w (O, I), y (M, O), or each with a leading batch N");
  if (w.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("few_row_product: the weights must be bfloat16");
  const int64_t N = rank == 3 ? xd[0] : 1, M = xd[rank - 2], I = xd[rank - 1], O = wd[rank - 2];
  if (wd[rank - 1] != I || yd[rank - 2] != M || yd[rank - 1] != O || (rank == 3 && (wd[0] != N || yd[0] != N)))
    return ffi::Error::InvalidArgument("few_row_product: mismatched shapes");
  if (M < 1 || M > max_rows() || I % kStep)
    return ffi::Error::InvalidArgument("few_row_product: 1 to FewRowProductMaxRows() rows of a multiple of 32 columns");

  // Preparing x (as bfloat16, and laid out for the tiles) is spread over the threads when it is large.
  const bool spread = N * M * I >= kSpreadWords;
  auto each = [&](int64_t items, auto&& body) {
    if (spread)
      deepinfer::parallel_for(threads, items, false, body);
    else
      for (int64_t i = 0; i < items; ++i) body(i);
  };
  std::unique_ptr<uint16_t[]> xb(new uint16_t[N * M * I]);
  const int64_t all_rows = N * M;
  each((all_rows + kConvertRows - 1) / kConvertRows, [&](int64_t i) {
    const int64_t first = i * kConvertRows, rows = std::min(kConvertRows, all_rows - first);
    to_bf16(x.typed_data() + first * I, xb.get() + first * I, rows * I);
  });
  const auto* wp = static_cast<const uint16_t*>(w.untyped_data());
  float* yp = y->typed_data();
  // run(n, o0, o1): rows [o0, o1) of batch n's y
  std::function<void(int64_t, int64_t, int64_t)> run = [&](int64_t n, int64_t o0, int64_t o1) {
    const uint16_t* wn = wp + n * O * I;
    const uint16_t* xn = xb.get() + n * M * I;
    float* yn = yp + n * M * O;
    switch (M) {
      case 1: return rows_block<1>(wn, xn, yn, O, I, o0, o1);
      case 2: return rows_block<2>(wn, xn, yn, O, I, o0, o1);
      case 3: return rows_block<3>(wn, xn, yn, O, I, o0, o1);
      default: return rows_block<4>(wn, xn, yn, O, I, o0, o1);
    }
  };
  int64_t unit = kBlockRows;  // an item's rows are a multiple of this
  bool tiles = false;
#ifdef DEEPINFER_FEW_ROWS_FMA
  std::unique_ptr<float[]> xf;
  if (M >= kFmaFromRows && !deepinfer::amx_granted()) {  // float32 FMAs (AMX tiles below where granted)
    xf.reset(new float[N * M * I]);
    each((all_rows + kConvertRows - 1) / kConvertRows, [&](int64_t i) {
      const int64_t first = i * kConvertRows, rows = std::min(kConvertRows, all_rows - first);
      widen_rows(xb.get() + first * I, xf.get() + first * I, rows * I);
    });
    const int64_t chunk = std::max<int64_t>(kBlockRows, kChunkBytes / (2 * I) / kBlockRows * kBlockRows);
    run = [&, chunk](int64_t n, int64_t o0, int64_t o1) {
      const uint16_t* wn = wp + n * O * I;
      const float* xn = xf.get() + n * M * I;
      float* yn = yp + n * M * O;
      for (int64_t c0 = o0; c0 < o1; c0 += chunk) {  // a chunk of weight rows, for every group of x rows
        const int64_t c1 = std::min(o1, c0 + chunk);
        for (int64_t g = 0; g < M; g += kGroupRows) {
          const float* xg = xn + g * I;
          float* yg = yn + g * O;
          const bool first = g == 0;  // the first group streams the chunk from memory: it prefetches
          switch (std::min(kGroupRows, M - g)) {
            case 1: fma_block<1>(wn, xg, yg, O, I, c0, c1, first); break;
#if defined(__AVX512F__)
            case 2: fma_block<2>(wn, xg, yg, O, I, c0, c1, first); break;
            case 3: fma_block<3>(wn, xg, yg, O, I, c0, c1, first); break;
            default: fma_block<4>(wn, xg, yg, O, I, c0, c1, first); break;
#else
            default: fma_block<2>(wn, xg, yg, O, I, c0, c1, first); break;
#endif
          }
        }
      }
    };
  }
#endif
#ifdef DEEPINFER_AMX
  std::unique_ptr<uint16_t[]> xv;
  const int64_t groups = (M + 15) / 16, padded = groups * 16 * I;  // one batch's x as laid out for the tiles
  if (M > 1 && deepinfer::amx_granted()) {
    tiles = true;  // AMX: x as bfloat16 pairs in groups of 16 rows, zero rows padding the last group
    unit = 32;
    xv.reset(new uint16_t[N * padded]);
    each(N * groups, [&](int64_t i) {  // one group of 16 rows each
      const int64_t n = i / groups, g = i % groups, rows = std::min<int64_t>(16, M - g * 16);
      const uint16_t* src = xb.get() + (n * M + g * 16) * I;
      std::vector<uint16_t> last;
      if (rows < 16) {  // the last group's rows past M as zeros
        last.assign(16 * I, 0);
        std::memcpy(last.data(), src, rows * I * 2);
        src = last.data();
      }
      // per 32 columns, a 16 x 16 block of 32-bit words (column pairs x rows) transposed into pairs x rows
      for (int64_t k = 0; k < I; k += kStep)
        deepinfer::transpose16(reinterpret_cast<const uint32_t*>(src + k), I / 2,
                               reinterpret_cast<uint32_t*>(xv.get() + n * padded + g * 16 * I + k * 16));
    });
    run = [&](int64_t n, int64_t o0, int64_t o1) {
      const uint16_t* wn = wp + n * O * I;
      float* yn = yp + n * M * O;
      const int64_t tiled = o0 + (o1 - o0) / 32 * 32;
      amx_block(wn, xv.get() + n * padded, yn, M, O, I, o0, tiled);
      for (int64_t m = 0; m < M; ++m)  // the last rows of W, fewer than a tile's: one x row at a time
        rows_block<1>(wn, xb.get() + (n * M + m) * I, yn + m * O, O, I, tiled, o1);
    };
  }
#endif

  // Blocks of about kItemRows weight rows (of one batch) go to whichever thread is free next; the calling
  // thread works too.
  const int64_t workers = std::max<int64_t>(threads.num_threads(), 1);
  const int64_t item =
      std::max<int64_t>(unit, std::min<int64_t>(kItemRows, (N * O / workers + unit - 1) / unit * unit));
  const int64_t per_batch = (O + item - 1) / item;
  deepinfer::parallel_for(threads, N * per_batch, tiles, [&](int64_t i) {
    const int64_t n = i / per_batch, o0 = (i % per_batch) * item;
    run(n, o0, std::min(O, o0 + item));
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" int64_t FewRowProductMaxRows() { return max_rows(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowProduct, FewRowProductImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

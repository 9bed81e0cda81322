// A product of a few rows with a bfloat16 weight matrix for the CPU, as an XLA FFI custom call.
//
// y (M, O) = x (M, I) @ W (O, I)^T for M <= kMaxRows: what `ServingLinear` computes when a decode step
// carries one to four sequences. Such a product reads every weight once and does little with it, so its
// time should be the time to stream W from memory; XLA:CPU's bfloat16 product of one or two rows took
// 1.6-1.8x this kernel's time on `mini`'s LM head (BENCHMARKS.md, few-row products). Here each weight row
// is read once for all M rows (AVX-512 BF16 dot products, float32 sums), the next block of rows is
// prefetched while this one is multiplied, and blocks of outputs go to XLA's intra-op threads.
//
// Inputs:  x   f32   (M, I): each row rounded to bfloat16 (to nearest even), as `x.astype(bfloat16)` does
//          w   bf16  (O, I)
// Output:  y   f32   (M, O): bfloat16 products summed in float32
//
// Each output is one weight row's dot product with one x row, summed in a fixed order that depends on I
// alone: a row's result does not depend on the other rows, on M, or on how the outputs are shared.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 4;
constexpr int64_t kStep = 32;       // bfloat16 weights per vector step (one 64-byte line)
constexpr int64_t kBlockRows = 4;   // weight rows multiplied together, their lines prefetched one block ahead
constexpr int64_t kItemRows = 512;  // weight rows per work item handed to a thread

inline uint16_t to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
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
  for (int64_t o = o0; o < o1; ++o) {
    F16 acc[M] = {};
    for (int64_t k = 0; k < I; k += 16) {
      const F16 wv = widen(w + o * I + k);
      for (int m = 0; m < M; ++m) acc[m] += wv * widen(xb + m * I + k);
    }
    for (int m = 0; m < M; ++m) {
      float s = 0;
      for (int l = 0; l < 16; ++l) s += acc[m][l];
      y[m * O + o] = s;
    }
  }
}

#endif

ffi::Error FewRowProductImpl(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                             ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("few_row_product: x (M, I), w (O, I), y (M, O)");
  if (w.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("few_row_product: the weights must be bfloat16");
  const int64_t M = xd[0], I = xd[1], O = wd[0];
  if (wd[1] != I || yd[0] != M || yd[1] != O)
    return ffi::Error::InvalidArgument("few_row_product: mismatched shapes");
  if (M < 1 || M > kMaxRows || I % kStep)
    return ffi::Error::InvalidArgument("few_row_product: 1-4 rows of a multiple of 32 columns");

  std::vector<uint16_t> xb(M * I);
  for (int64_t i = 0; i < M * I; ++i) xb[i] = to_bf16(x.typed_data()[i]);
  const auto* wp = static_cast<const uint16_t*>(w.untyped_data());
  float* yp = y->typed_data();
  auto run = [&](int64_t o0, int64_t o1) {
    switch (M) {
      case 1: return rows_block<1>(wp, xb.data(), yp, O, I, o0, o1);
      case 2: return rows_block<2>(wp, xb.data(), yp, O, I, o0, o1);
      case 3: return rows_block<3>(wp, xb.data(), yp, O, I, o0, o1);
      default: return rows_block<4>(wp, xb.data(), yp, O, I, o0, o1);
    }
  };

  // Blocks of kItemRows weight rows go to whichever thread is free next; the calling thread works too.
  const int64_t workers = std::max<int64_t>(threads.num_threads(), 1);
  const int64_t item = std::max<int64_t>(kBlockRows, std::min<int64_t>(kItemRows, (O / workers + kBlockRows - 1) /
                                                                                      kBlockRows * kBlockRows));
  const int64_t items = (O + item - 1) / item;
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i; (i = next.fetch_add(1)) < items;) run(i * item, std::min(O, (i + 1) * item));
  };
  const int64_t helpers = std::min(workers, items) - 1;
  std::atomic<int64_t> done{0};
  for (int64_t i = 0; i < helpers; ++i)
    threads.Schedule([&work, &done] {
      work();
      done.fetch_add(1, std::memory_order_release);
    });
  work();
  while (done.load(std::memory_order_acquire) < helpers) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowProduct, FewRowProductImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// AMX for our FFI kernels: the process's grant, the one tile layout they use, and work items spread over
// XLA's threads (parallel.h) with the tiles configured on each thread that takes part.
#pragma once

#include <cstdint>

#include "parallel.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define DEEPINFER_AMX 1
#endif

namespace deepinfer {

// Linux lends AMX's tile state to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM); false in a build
// without AMX.
inline bool amx_granted() {
#ifdef DEEPINFER_AMX
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
#else
  return false;
#endif
}

#ifdef DEEPINFER_AMX
struct TileConfig {  // palette 1; every tile 16 rows of 64 bytes
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
  }
};
#endif

// parallel_items (parallel.h) with each thread that takes part configuring the tiles first, with `tiles` (an
// AMX build only), and releasing them after: tile state is per thread. worker(first, claim) as there, for
// kernels that keep per-thread buffers across the items a thread takes.
template <typename Worker>
void parallel_tiled_items(xla::ffi::ThreadPool& threads, int64_t items, bool tiles, Worker&& worker) {
  parallel_items(threads, items, [&](int64_t first, auto claim) {
#ifdef DEEPINFER_AMX
    if (tiles) {
      const TileConfig config;
      _tile_loadconfig(&config);
    }
#endif
    worker(first, claim);
#ifdef DEEPINFER_AMX
    if (tiles) _tile_release();
#endif
  });
}

// body(i) for every item in [0, items), tiles configured as above.
template <typename Body>
void parallel_for(xla::ffi::ThreadPool& threads, int64_t items, bool tiles, Body&& body) {
  parallel_tiled_items(threads, items, tiles, [&](int64_t first, auto claim) {
    for (int64_t i = first; i >= 0; i = claim()) body(i);
  });
}

#ifdef DEEPINFER_AMX
// A 16 x 16 block of 32-bit words transposed: out[d * out_stride + s] = in[s * stride + d] for the first
// out_rows rows d of the result (all 16 by default).
inline void transpose16(const uint32_t* in, int64_t stride, uint32_t* out, int64_t out_stride = 16,
                        int64_t out_rows = 16) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(in + i * stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4 g + k] now holds, in its 128-bit lane L, rows 4 g .. 4 g + 3 of column 4 L + k
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);
    t[8 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
  }
  for (int k = 0; k < 4; ++k) {  // result rows k, 4 + k, 8 + k, 12 + k
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
    r[12 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0xdd);
  }
  for (int64_t d = 0; d < out_rows; ++d) _mm512_storeu_si512(out + d * out_stride, r[d]);
}

// Two rows of 32 bfloat16 words (x0, x1: columns c .. c + 32 of rows 2e and 2e + 1) as two rows of a B tile
// (VNNI: each 32-bit word one column's pair): lo holds columns c .. c + 16, hi c + 16 .. c + 32.
inline void pair_rows(__m512i x0, __m512i x1, __m512i& lo, __m512i& hi) {
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  lo = _mm512_permutex2var_epi16(x0, lo_idx, x1);
  hi = _mm512_permutex2var_epi16(x0, _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16)), x1);
}
#endif

}  // namespace deepinfer

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

// body(i) for every item in [0, items) on the calling thread and XLA's intra-op threads (parallel_items);
// with `tiles` (an AMX build only), each thread that takes part configures the tiles first and releases
// them after: tile state is per thread.
template <typename Body>
void parallel_for(xla::ffi::ThreadPool& threads, int64_t items, bool tiles, Body&& body) {
  parallel_items(threads, items, [&](int64_t first, auto claim) {
#ifdef DEEPINFER_AMX
    if (tiles) {
      const TileConfig config;
      _tile_loadconfig(&config);
    }
#endif
    for (int64_t i = first; i >= 0; i = claim()) body(i);
#ifdef DEEPINFER_AMX
    if (tiles) _tile_release();
#endif
  });
}

}  // namespace deepinfer

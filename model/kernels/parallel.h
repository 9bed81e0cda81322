// Work items spread over the calling thread and XLA's intra-op threads, for our FFI kernels.
//
// The caller takes items too, and it waits only for helpers that took one. A helper the pool starts after
// the items are gone does nothing; the caller never waits for a helper that has not started. XLA:CPU may
// run independent custom calls (two projections of the same input) at once on its pool: callers that each
// waited for their queued helpers while every worker was such a caller would never return.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace deepinfer {

// worker(first, claim): item `first`, then every item claim() returns until it returns -1. Each thread that
// takes part calls worker once (per-thread set-up goes there). At most `threads.num_threads()` threads.
template <typename Worker>
void parallel_items(xla::ffi::ThreadPool& threads, int64_t items, Worker&& worker) {
  struct Shared {
    std::atomic<int64_t> next{0}, active{0};
    int64_t items = 0;
    std::function<void(int64_t)> run;  // only ever called with an item taken while the caller waits
  };
  auto shared = std::make_shared<Shared>();
  shared->items = items;
  Shared* raw = shared.get();
  auto claim = [raw]() -> int64_t {
    const int64_t i = raw->next.fetch_add(1);
    return i < raw->items ? i : -1;
  };
  shared->run = [&worker, claim](int64_t first) { worker(first, claim); };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(threads.num_threads(), 1), items) - 1;
  for (int64_t h = 0; h < helpers; ++h)
    threads.Schedule([shared] {
      shared->active.fetch_add(1);  // before taking an item: the caller sees it busy from here on
      const int64_t i = shared->next.fetch_add(1);
      if (i < shared->items) shared->run(i);
      shared->active.fetch_sub(1, std::memory_order_release);
    });
  const int64_t first = claim();
  if (first >= 0) worker(first, claim);
  while (shared->active.load(std::memory_order_acquire) > 0) std::this_thread::yield();
}

}  // namespace deepinfer

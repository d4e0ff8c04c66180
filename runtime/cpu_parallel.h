// Work sharing for the CPU kernels (cpu_attention.cc, cpu_matmul.cc): XLA's intra-op
// thread pool runs a call's items beside the calling thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define PAGEDJAX_PAUSE() _mm_pause()
#else
#define PAGEDJAX_PAUSE() ((void)0)
#endif

namespace pagedjax {

namespace ffi = xla::ffi;

// Work items are handed out one at a time from a shared counter: the calling thread works
// too, and a pool task that starts late finds nothing left. The counters live on the heap
// so such a task never touches a finished call's stack.
struct Phase {
  std::function<void(int64_t)> item;
  int64_t count = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

inline void drain(Phase& ph) {
  for (int64_t i; (i = ph.next.fetch_add(1)) < ph.count;) {
    ph.item(i);
    if (ph.done.fetch_add(1, std::memory_order_release) + 1 == ph.count) ph.done.notify_all();
  }
}

// As drain, but a thread claims its next item before it runs the current one and is told
// which (or -1): a kernel that streams weights from memory can prefetch the next item's
// while it computes on this one's, instead of stalling on memory at each item's start.
struct PhaseAhead {
  std::function<void(int64_t, int64_t)> item;
  int64_t count = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> ready{true};  // false until the caller's prologue is done (run_parallel_ahead)
};

inline void drain(PhaseAhead& ph) {
  while (!ph.ready.load(std::memory_order_acquire)) PAGEDJAX_PAUSE();
  for (int64_t i = ph.next.fetch_add(1); i < ph.count;) {
    const int64_t j = ph.next.fetch_add(1);
    ph.item(i, j < ph.count ? j : -1);
    if (ph.done.fetch_add(1, std::memory_order_release) + 1 == ph.count) ph.done.notify_all();
    i = j;
  }
}

template <class PhaseT, class Fn>
inline void run_phase(ffi::ThreadPool& pool, int64_t threads, int64_t count, Fn item,
                      const std::function<void()>& prologue = {}) {
  auto ph = std::make_shared<PhaseT>();
  ph->item = std::move(item);
  ph->count = count;
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(threads, 1), count) - 1;
  if constexpr (std::is_same_v<PhaseT, PhaseAhead>) {
    if (prologue) ph->ready.store(false, std::memory_order_relaxed);
  }
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([ph] { drain(*ph); });
  if constexpr (std::is_same_v<PhaseT, PhaseAhead>) {
    if (prologue) {  // while the helpers wake up (~25 us in a VM), not before waking them
      prologue();
      ph->ready.store(true, std::memory_order_release);
    }
  }
  drain(*ph);
  // Sleep (futex), not spin, until the last item is done: on a 2-core machine a spinning
  // caller takes the core the host thread needs to plan the next step.
  for (int64_t d; (d = ph->done.load(std::memory_order_acquire)) < count;) ph->done.wait(d);
}

inline void run_parallel(ffi::ThreadPool& pool, int64_t threads, int64_t count, std::function<void(int64_t)> item) {
  run_phase<Phase>(pool, threads, count, std::move(item));
}

// `prologue` (if any) runs on the calling thread before any item, while the helpers start.
inline void run_parallel_ahead(ffi::ThreadPool& pool, int64_t threads, int64_t count,
                               std::function<void(int64_t, int64_t)> item,
                               const std::function<void()>& prologue = {}) {
  run_phase<PhaseAhead>(pool, threads, count, std::move(item), prologue);
}

}  // namespace pagedjax

// Work sharing for the CPU kernels (cpu_attention.cc, cpu_matmul.cc): XLA's intra-op
// thread pool runs a call's items beside the calling thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
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

// Dependent phases in one call (a layer's products: each reads the one before's output),
// items numbered across them. A thread claims its next item before it runs the current one
// and is told which (or -1): a kernel that streams weights from memory prefetches the next
// item's while it computes on this one's, across a phase boundary too (weights need no
// input), instead of stalling on memory at each item's (and each call's) start. An item of
// phase p waits until phase p - 1 is done and `between(p - 1)` has run (once, on the thread
// that finished p - 1's last item); phase 0 waits for `prologue`.
struct Chain {
  static constexpr int kMaxPhases = 4;
  std::function<void(int64_t, int64_t)> item;
  std::function<void(int)> between;  // after phase p's last item, before p + 1's first
  int phases = 1;
  int64_t end[kMaxPhases] = {};  // one past each phase's last item
  int64_t count = 0;             // = end[phases - 1]
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<int64_t> phase_done[kMaxPhases] = {};
  std::atomic<int> ready{1};  // items of phases below `ready` may run

  int64_t begin(int p) const { return p ? end[p - 1] : 0; }  // phase p's first item
  int phase_of(int64_t i) const {
    int p = 0;
    while (i >= end[p]) ++p;
    return p;
  }
  void wait_ready(int p) {
    // spin a while (the other thread is finishing a few-microsecond item), then sleep: it may
    // have lost its core to the host thread
    for (int spins = 0; ready.load(std::memory_order_acquire) <= p; ++spins) {
      if (spins < 20000) {
        PAGEDJAX_PAUSE();
      } else {
        const int r = ready.load(std::memory_order_acquire);
        if (r <= p) ready.wait(r);
      }
    }
  }
};

inline void drain(Chain& ch) {
  for (int64_t i = ch.next.fetch_add(1); i < ch.count;) {
    const int64_t j = ch.next.fetch_add(1);
    const int p = ch.phase_of(i);
    ch.wait_ready(p);
    ch.item(i, j < ch.count ? j : -1);
    const int64_t phase_items = ch.end[p] - ch.begin(p);
    if (ch.phase_done[p].fetch_add(1, std::memory_order_acq_rel) + 1 == phase_items && p + 1 < ch.phases) {
      if (ch.between) ch.between(p);
      ch.ready.store(p + 2, std::memory_order_release);
      ch.ready.notify_all();
    }
    if (ch.done.fetch_add(1, std::memory_order_release) + 1 == ch.count) ch.done.notify_all();
    i = j;
  }
}

// Handoff between calls. A pool helper that has run out of items waits, spinning, up to
// linger_ns() for the next call's work, and a call hands its work to such a helper through
// `slot` instead of waking a pool thread. Why: one decode step of SmolLM2 is ~60 kernel
// calls 10-100 us apart, and a pool thread asleep between them took ~90 us to start
// (futex wake of an idle vCPU), while the caller streamed alone at half the bandwidth. Only
// after a short call (kShortCallNs): after a long one the next call is as far off in
// proportion, and at 64 rows, where XLA runs its own ops on the same pool between the
// kernels, lingering after every call made the SmolLM2 step 3-5% slower.
constexpr int64_t kShortCallNs = 1000000;

struct Job {
  std::function<void()> run;
};

struct Handoff {
  std::atomic<Job*> slot{nullptr};
  std::atomic<int> lingering{0};
  std::atomic<int64_t> taken{0};  // jobs a lingering helper took (read by tests/kernels/ffi_driver.cc)
};

inline Handoff& handoff() {
  static Handoff h;
  return h;
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// How long a helper lingers for the next call's work: the engine sets it from its
// KernelConfig (PagedjaxSetLingerUs); until then PAGEDJAX_LINGER_US or 100 us (the standalone
// sanitizer driver). 0 turns the handoff off (an A/B); 25-400 us measured alike at batch 1.
inline std::atomic<int64_t>& linger_setting_ns() {
  static std::atomic<int64_t> ns{[] {
    const char* v = std::getenv("PAGEDJAX_LINGER_US");
    return (v ? std::atoll(v) : 100) * 1000;
  }()};
  return ns;
}

inline int64_t linger_ns() { return linger_setting_ns().load(std::memory_order_relaxed); }

inline void linger() {
  Handoff& h = handoff();
  if (linger_ns() <= 0) return;
  h.lingering.fetch_add(1);
  for (int64_t deadline = now_ns() + linger_ns(), spins = 0;; ++spins) {
    Job* j = h.slot.load(std::memory_order_acquire);
    if (j != nullptr && (j = h.slot.exchange(nullptr, std::memory_order_acq_rel)) != nullptr) {
      h.lingering.fetch_sub(1);
      h.taken.fetch_add(1, std::memory_order_relaxed);
      const int64_t t0 = now_ns();
      j->run();
      delete j;
      if (now_ns() - t0 > kShortCallNs) return;
      h.lingering.fetch_add(1);
      deadline = now_ns() + linger_ns();
      continue;
    }
    if (spins % 64 == 0 && now_ns() > deadline) break;
    PAGEDJAX_PAUSE();
  }
  h.lingering.fetch_sub(1);
}

// Wakes min(threads, count) - 1 helpers (a lingering one first, see Handoff) and drains beside
// them; returns when every item is done. `prologue` (if any) runs on the calling thread
// while the helpers wake, not before waking them.
template <class PhaseT>
inline void run_phase(ffi::ThreadPool& pool, int64_t threads, std::shared_ptr<PhaseT> ph,
                      const std::function<void()>& prologue = {}) {
  const int64_t count = ph->count;
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(threads, 1), count) - 1;
  if constexpr (std::is_same_v<PhaseT, Chain>) {
    if (prologue) ph->ready.store(0, std::memory_order_relaxed);
  }
  Handoff& h = handoff();
  Job* posted = nullptr;
  for (int64_t i = 0; i < helpers; ++i) {
    if (posted == nullptr && h.lingering.load(std::memory_order_acquire) > 0) {
      Job* j = new Job{[ph] { drain(*ph); }};
      Job* empty = nullptr;
      if (h.slot.compare_exchange_strong(empty, j, std::memory_order_acq_rel)) {
        posted = j;
        continue;
      }
      delete j;
    }
    pool.Schedule([ph] {
      const int64_t t0 = now_ns();
      drain(*ph);
      if (now_ns() - t0 <= kShortCallNs) linger();
    });
  }
  if constexpr (std::is_same_v<PhaseT, Chain>) {
    if (prologue) {
      prologue();
      ph->ready.store(1, std::memory_order_release);
      ph->ready.notify_all();
    }
  }
  drain(*ph);
  if (posted != nullptr) {  // not taken (the helper stopped lingering): take it back
    Job* mine = posted;
    if (h.slot.compare_exchange_strong(mine, nullptr, std::memory_order_acq_rel)) delete posted;
  }
  // Sleep (futex), not spin, until the last item is done: on a 2-core machine a spinning
  // caller takes the core the host thread needs to plan the next step.
  for (int64_t d; (d = ph->done.load(std::memory_order_acquire)) < count;) ph->done.wait(d);
}

inline void run_parallel(ffi::ThreadPool& pool, int64_t threads, int64_t count, std::function<void(int64_t)> item) {
  auto ph = std::make_shared<Phase>();
  ph->item = std::move(item);
  ph->count = count;
  run_phase(pool, threads, ph);
}

// One phase of items claimed one ahead (see Chain).
inline void run_parallel_ahead(ffi::ThreadPool& pool, int64_t threads, int64_t count,
                               std::function<void(int64_t, int64_t)> item,
                               const std::function<void()>& prologue = {}) {
  auto ch = std::make_shared<Chain>();
  ch->item = std::move(item);
  ch->end[0] = ch->count = count;
  run_phase(pool, threads, ch, prologue);
}

}  // namespace pagedjax

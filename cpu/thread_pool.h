// A small persistent thread pool for the CPU kernel.
//
// Why our own pool: XLA's FFI ThreadPool only offers Schedule(); a handler that
// blocks on work it scheduled there can starve when XLA's intra-op threads are
// busy. Here the calling thread always takes part in its own job, so a job
// completes even if every worker is busy elsewhere (concurrent custom calls),
// and workers stay parked between calls.
#pragma once

#include <cstdint>

namespace jax_sdpa {
namespace cpu {

// fn(ctx, task, participant): participant is in [0, participants()) and unique
// among the threads running one job at a time, so callers can index
// per-thread scratch with it.
using TaskFn = void (*)(void* ctx, int64_t task, int participant);

class ThreadPool {
 public:
  // The process-wide pool: std::thread::hardware_concurrency() participants
  // (JAX_SDPA_CPU_THREADS overrides). Intentionally leaked (no join at exit).
  static ThreadPool& global();

  int participants() const { return participants_; }

  // Runs fn(ctx, i, participant) for i in [0, n) and returns when all are done.
  void parallel_for(int64_t n, TaskFn fn, void* ctx);

 private:
  explicit ThreadPool(int participants);
  struct Impl;
  Impl* impl_;
  int participants_;
};

}  // namespace cpu
}  // namespace jax_sdpa

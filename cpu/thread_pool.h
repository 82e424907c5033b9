// A small persistent thread pool for the CPU kernel.
//
// Why our own pool: XLA's FFI ThreadPool only offers Schedule(); a handler that
// blocks on work it scheduled there can starve when XLA's intra-op threads are
// busy. Here the calling thread always takes part in its own job, so a job
// completes even if every worker is busy elsewhere (concurrent custom calls),
// and workers stay parked between calls.
//
// A busy machine: the kernel's share of the cores is one thread's fair share times its
// threads. While other processes keep the cores busy (measured: the CPU time the threads of
// long jobs get against their wall time), long jobs are offered to twice as many threads,
// which win them a larger share of the contended cores. On a quiet machine the extra threads
// stay parked: more threads than cores would only preempt each other. Only long jobs measure,
// so the busy verdict ends on its own unless they keep confirming it.
#pragma once

#include <cstdint>

namespace jax_sdpa {
namespace cpu {

// fn(ctx, task, participant): participant is in [0, capacity()) and unique
// among the threads running one job at a time, so callers can index
// per-thread scratch with it.
using TaskFn = void (*)(void* ctx, int64_t task, int participant);

class ThreadPool {
 public:
  // The process-wide pool: std::thread::hardware_concurrency() cores
  // (JAX_SDPA_CPU_THREADS overrides). Intentionally leaked (no join at exit).
  static ThreadPool& global();

  // Threads that take part in a job now: the cores, or for a long job (one a caller expects
  // to take about a millisecond on a core or more) twice that while the machine is busy.
  // What a caller splits its work for.
  int participants(bool long_job) const;
  // The most threads that take part in one job (per-participant scratch is sized for this).
  int capacity() const { return cores_ == 1 ? 1 : 2 * cores_; }
  int cores() const { return cores_; }
  // Whether long jobs are offered to the extra threads now (the machine was found busy
  // within the last busy_verdict_seconds()).
  bool oversubscribed() const;
  static double busy_verdict_seconds();

  // Runs fn(ctx, i, participant) for i in [0, n) on participants(long_job) threads and
  // returns when all are done.
  void parallel_for(int64_t n, TaskFn fn, void* ctx, bool long_job);

 private:
  explicit ThreadPool(int cores);
  struct Impl;
  Impl* impl_;
  int cores_;
};

}  // namespace cpu
}  // namespace jax_sdpa

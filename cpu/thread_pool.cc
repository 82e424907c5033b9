#include "cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include <time.h>

namespace jax_sdpa {
namespace cpu {

namespace {

// How long a thread that ran out of work polls before it sleeps: a worker, for the next job,
// and the caller, for the last tasks of its own. On a quiet machine it polls across the gap
// between two calls (a decode step calls attention once a layer, a few hundred microseconds
// apart; a Python loop's dispatch alone is tens): a sleeping worker costs a futex round trip
// to wake, and in a VM whose host halts idle vCPUs, a wake-up lasts until the host's halt
// polling adapts, tens of milliseconds of slower calls after each pause (docs/cpu.md). While
// other processes hold the cores (the contention probe below), polling would take a core from
// them and from our own threads with work: then briefly.
constexpr auto kPollQuiet = std::chrono::microseconds(1000);
constexpr auto kPollBusy = std::chrono::microseconds(50);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls cond() for up to `period`; returns whether it became true.
template <typename Cond>
bool poll_for(std::chrono::microseconds period, Cond cond) {
  const auto until = std::chrono::steady_clock::now() + period;
  for (int i = 0;; ++i) {
    if (cond()) return true;
    cpu_relax();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) return false;
  }
}

// The contention probe. Every long job of at least cores() tasks is sampled: each thread that
// runs its tasks reads its own CPU time around them (about 1.5 us of system calls a thread),
// the caller the job's wall time. On a quiet machine the job's threads keep
// min(threads, cores) cores busy for its whole wall time; where other processes hold cores,
// threads are preempted or woken late. Every kWindow of sampled wall time the pool compares
// the CPU time its jobs got with that: below kBusyBelow of it, it offers long jobs to the
// extra threads; above kQuietAbove, where those only preempt each other, it parks them
// again. Short jobs neither probe (waking the workers is a large part of them) nor take the
// extra threads. (The process's CPU clock is no measure here: it counts a thread that is
// running on another core only up to its last tick.)
constexpr int64_t kWindowNs = 4'000'000;
constexpr double kBusyBelow = 0.70, kQuietAbove = 0.85;
// A busy verdict lasts this long past the last window that found the cores contended. Short
// jobs never probe, so without an end a busy spell left every later short call in busy mode
// (workers asleep between calls) on a quiet machine until some long job ran again: B1
// H32/KV8 D128 Lk1024 float32 decode 1 s after stress-ng had stopped 0.395-0.410 ms, with
// this end 0.29-0.37 (Intel Xeon VM, docs/cpu.md). Long jobs on a busy machine keep the
// verdict fresh (a window every few milliseconds).
constexpr int64_t kBusyVerdictNs = 250'000'000;

int64_t ns(const timespec& t) { return t.tv_sec * 1'000'000'000LL + t.tv_nsec; }
int64_t thread_cpu_ns() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return ns(t);
}
int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Job {
  TaskFn fn;
  void* ctx;
  int64_t n;
  int width;  // threads that may take part, the caller included
  bool sampled = false;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<int> next_participant{1};  // 0 is the caller
  // A sampled job's threads' summed CPU time running its tasks.
  std::atomic<int64_t> run_cpu{0};
  std::mutex mu;
  std::condition_variable cv;
};

// Runs tasks of `job` until none is left (a sampled job: adds this thread's CPU time for them).
void drain(Job& job, int participant) {
  int64_t ran = 0;
  const int64_t cpu0 = job.sampled ? thread_cpu_ns() : 0;
  for (int64_t i; (i = job.next.fetch_add(1)) < job.n;) {
    job.fn(job.ctx, i, participant);
    ++ran;
  }
  if (!ran) return;
  // before the count: the caller reads run_cpu once every task is done
  if (job.sampled) job.run_cpu.fetch_add(thread_cpu_ns() - cpu0);
  if (job.done.fetch_add(ran) + ran == job.n) {
    std::lock_guard<std::mutex> lock(job.mu);
    job.cv.notify_all();
  }
}

}  // namespace

struct ThreadPool::Impl {
  explicit Impl(int cores) : cores(cores) {}
  const int cores;
  std::mutex mu;
  // Workers 1 .. cores-1 wait on core_cv, the extra ones (cores .. 2 cores-1) on extra_cv, so
  // that waking a quiet job's helpers never lands on a worker that may not join it.
  std::condition_variable core_cv, extra_cv;
  std::deque<std::shared_ptr<Job>> queue;
  std::atomic<int> front_width{0};  // the front job's width (0: none), polled without the lock
  // Until when (wall_ns) long jobs are offered to the extra threads; 0: the cores were quiet.
  std::atomic<int64_t> busy_until{0};
  bool busy() const { return wall_ns() < busy_until.load(std::memory_order_relaxed); }
  std::chrono::microseconds poll_period() const { return busy() ? kPollBusy : kPollQuiet; }
  // The contention probe's window: sampled jobs' wall time times the cores they could keep
  // busy, and the CPU time they got.
  std::mutex probe_mu;
  int64_t window_wall = 0, window_cpu = 0;

  void worker(int w) {
    std::condition_variable& cv = w < cores ? core_cv : extra_cv;
    for (;;) {
      std::shared_ptr<Job> job;
      // Extra workers don't poll: they run only while the cores are contended, where a
      // polling thread would take a core from one with tasks.
      if (w < cores)
        poll_for(poll_period(), [&] { return front_width.load(std::memory_order_acquire) > w; });
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return !queue.empty() && queue.front()->width > w; });
        job = queue.front();
        // Once its tasks are all claimed the job leaves the queue.
        if (job->next.load() >= job->n) {
          pop_front();
          continue;
        }
      }
      // A worker joins a job at most once (it leaves the queue before the worker looks again),
      // and only workers below its width do: participants stay below the width.
      int participant = job->next_participant.fetch_add(1);
      drain(*job, participant);
      std::lock_guard<std::mutex> lock(mu);
      if (!queue.empty() && queue.front() == job) pop_front();
    }
  }
  void push_back(std::shared_ptr<Job> job) {  // mu held
    queue.push_back(std::move(job));
    front_width.store(queue.front()->width, std::memory_order_release);
  }
  void pop_front() {  // mu held
    queue.pop_front();
    front_width.store(queue.empty() ? 0 : queue.front()->width, std::memory_order_release);
    // the new front may be a job the extra workers may join
    if (!queue.empty() && queue.front()->width > cores) extra_cv.notify_all();
  }
  // A sampled job of `wall` ns into the window; at the window's end, the verdict.
  void probe(const Job& job, int64_t wall) {
    const int64_t busy_cores = std::min<int64_t>(std::min(job.width, cores), job.n);
    std::lock_guard<std::mutex> lock(probe_mu);
    window_wall += wall * busy_cores;
    window_cpu += job.run_cpu.load();
    if (window_wall < kWindowNs * busy_cores) return;
    const double share = static_cast<double>(window_cpu) / window_wall;
    const bool was_busy = busy();
    if (was_busy ? share <= kQuietAbove : share < kBusyBelow)
      busy_until.store(wall_ns() + kBusyVerdictNs);
    else if (was_busy)
      busy_until.store(0);
    window_wall = window_cpu = 0;
  }
};

ThreadPool::ThreadPool(int cores) : impl_(new Impl(cores)), cores_(cores) {
  if (cores_ == 1) return;  // one core: the caller runs every job alone
  // Where the process may not start them all (a container's thread limit), fewer workers
  // join: a job's caller runs whatever tasks no worker takes.
  try {
    for (int w = 1; w < capacity(); ++w)
      std::thread([impl = impl_, w] { impl->worker(w); }).detach();
  } catch (const std::system_error&) {
  }
}

int ThreadPool::participants(bool long_job) const {
  return long_job && impl_->busy() ? capacity() : cores_;
}

bool ThreadPool::oversubscribed() const { return impl_->busy(); }
double ThreadPool::busy_verdict_seconds() { return kBusyVerdictNs * 1e-9; }

ThreadPool& ThreadPool::global() {
  static ThreadPool* pool = [] {
    int n = static_cast<int>(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("JAX_SDPA_CPU_THREADS")) {
      int v = std::atoi(env);
      if (v > 0) n = v;
    }
    if (n < 1) n = 1;
    if (n > 256) n = 256;
    return new ThreadPool(n);
  }();
  return *pool;
}

void ThreadPool::parallel_for(int64_t n, TaskFn fn, void* ctx, bool long_job) {
  if (n <= 0) return;
  const int width = participants(long_job);
  if (n == 1 || width == 1) {
    for (int64_t i = 0; i < n; ++i) fn(ctx, i, 0);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = fn;
  job->ctx = ctx;
  job->n = n;
  job->width = width;
  job->sampled = long_job && n >= cores_;
  const int64_t start = job->sampled ? wall_ns() : 0;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->push_back(job);
  }
  // More participants than tasks would only spin on an empty job.
  const int64_t helpers = n - 1 < width - 1 ? n - 1 : width - 1;
  if (helpers >= cores_ - 1) impl_->core_cv.notify_all();
  else for (int64_t i = 0; i < helpers; ++i) impl_->core_cv.notify_one();
  if (helpers >= cores_) impl_->extra_cv.notify_all();
  drain(*job, 0);
  if (!poll_for(impl_->poll_period(),
                [&] { return job->done.load(std::memory_order_acquire) == job->n; })) {
    std::unique_lock<std::mutex> lock(job->mu);
    job->cv.wait(lock, [&] { return job->done.load() == job->n; });
  }
  if (job->sampled) impl_->probe(*job, wall_ns() - start);
}

}  // namespace cpu
}  // namespace jax_sdpa

#include "cpu/thread_pool.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace jax_sdpa {
namespace cpu {

namespace {

// How long a thread that ran out of work polls before it sleeps: a worker, for the next job (a
// decode step calls attention once a layer, a few hundred microseconds apart), and the caller,
// for the last tasks of its own. Sleeping and being woken again cost a futex round trip each
// (tens of microseconds in a VM); polling longer would take cores from other processes.
constexpr auto kPollFor = std::chrono::microseconds(50);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls cond() for up to kPollFor; returns whether it became true.
template <typename Cond>
bool poll_for(Cond cond) {
  const auto until = std::chrono::steady_clock::now() + kPollFor;
  for (int i = 0;; ++i) {
    if (cond()) return true;
    cpu_relax();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) return false;
  }
}

struct Job {
  TaskFn fn;
  void* ctx;
  int64_t n;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<int> next_participant{1};  // 0 is the caller
  std::mutex mu;
  std::condition_variable cv;
};

// Runs tasks of `job` until none is left; returns how many this thread ran.
void drain(Job& job, int participant) {
  int64_t ran = 0;
  for (int64_t i; (i = job.next.fetch_add(1)) < job.n;) {
    job.fn(job.ctx, i, participant);
    ++ran;
  }
  if (ran && job.done.fetch_add(ran) + ran == job.n) {
    std::lock_guard<std::mutex> lock(job.mu);
    job.cv.notify_all();
  }
}

}  // namespace

struct ThreadPool::Impl {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Job>> queue;
  std::atomic<int64_t> queued{0};  // jobs in the queue, for polling without the lock

  void worker() {
    for (;;) {
      std::shared_ptr<Job> job;
      poll_for([&] { return queued.load(std::memory_order_acquire) > 0; });
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return !queue.empty(); });
        job = queue.front();
        // Once its tasks are all claimed the job leaves the queue.
        if (job->next.load() >= job->n) {
          pop_front();
          continue;
        }
      }
      int participant = job->next_participant.fetch_add(1);
      drain(*job, participant);
      std::lock_guard<std::mutex> lock(mu);
      if (!queue.empty() && queue.front() == job) pop_front();
    }
  }
  void pop_front() {  // mu held
    queue.pop_front();
    queued.fetch_sub(1, std::memory_order_release);
  }
};

ThreadPool::ThreadPool(int participants) : impl_(new Impl), participants_(participants) {
  for (int i = 1; i < participants_; ++i) std::thread([impl = impl_] { impl->worker(); }).detach();
}

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

void ThreadPool::parallel_for(int64_t n, TaskFn fn, void* ctx) {
  if (n <= 0) return;
  if (n == 1 || participants_ == 1) {
    for (int64_t i = 0; i < n; ++i) fn(ctx, i, 0);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = fn;
  job->ctx = ctx;
  job->n = n;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->queue.push_back(job);
    impl_->queued.fetch_add(1, std::memory_order_release);
  }
  // More participants than tasks would only spin on an empty job.
  int64_t helpers = n - 1 < participants_ - 1 ? n - 1 : participants_ - 1;
  if (helpers >= participants_ - 1) impl_->cv.notify_all();
  else for (int64_t i = 0; i < helpers; ++i) impl_->cv.notify_one();
  drain(*job, 0);
  if (poll_for([&] { return job->done.load(std::memory_order_acquire) == job->n; })) return;
  std::unique_lock<std::mutex> lock(job->mu);
  job->cv.wait(lock, [&] { return job->done.load() == job->n; });
}

}  // namespace cpu
}  // namespace jax_sdpa

// msl_emulator.h — compiles a subset of the Metal Shading Language as C++ (clang >= 16) and runs
// it on the CPU. Include it before a .metal file; the same file compiles unchanged with Apple's
// compiler (which never sees this header).
//
// Two modes:
//   MSL_EMU_CHECK defined: type check only (clang -fsyntax-only). `device`, `constant` and
//     `threadgroup` become distinct clang address spaces, so passing a device pointer where a
//     threadgroup (or thread) pointer is expected is a compile error, as it is in MSL.
//   otherwise (run mode): address spaces vanish; each threadgroup runs as a set of ucontext
//     fibers (one per thread) on one OS thread, threadgroups spread over OS threads.
//     threadgroup_barrier / simd_* / simdgroup_matrix ops are rendezvous points. A barrier or
//     simd op reached by only part of its threads (divergence) or a group that can make no
//     progress (deadlock) is reported as an error from launch(), never a hang.
//
// Supported: scalar types incl. half (_Float16) and bfloat (__bf16), 2/3/4-vectors (no MSL
// vector constructors: write scalar code), the math and simd functions below, 8x8
// simdgroup_matrix with Metal's per-lane fragment layout, threadgroup arrays through
// MSL_TG_ARRAY, kernels instantiated by name with MSL_INSTANTIATE_KERNEL.
// Kernel convention (so that launches can bind arguments generically): buffer arguments
// (pointers / references) first, in [[buffer(i)]] order, then exactly
//   uint3 [[threadgroup_position_in_grid]], uint [[simdgroup_index_in_threadgroup]],
//   uint [[thread_index_in_simdgroup]], uint [[thread_index_in_threadgroup]].
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if !defined(__clang__)
#error "msl_emulator.h needs clang (half/bfloat, ext_vector_type, address spaces)"
#endif

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MSL_EMU_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(MSL_EMU_ASAN)
#define MSL_EMU_ASAN 1
#endif
#ifdef MSL_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

// Context switches: glibc's swapcontext makes two signal-mask syscalls per switch, which
// dominated the emulator's time, so on x86-64 and aarch64 fibers switch with a few
// instructions that save the callee-saved registers (MSL_EMU_UCONTEXT=1 forces ucontext).
// Under ASan, ucontext + the sanitizer's fiber annotations are used.
#if !defined(MSL_EMU_ASAN) && !defined(MSL_EMU_UCONTEXT) && \
    (defined(__x86_64__) || defined(__aarch64__))
#define MSL_EMU_FAST_SWITCH 1
namespace mslemu {
// Saves callee-saved registers on the current stack, stores its sp in *save, switches to
// the stack `to` and restores the registers saved there.
__attribute__((naked, noinline)) static void fast_switch(void** save, void* to) {
#if defined(__x86_64__)
  asm volatile(
      "pushq %rbp\n pushq %rbx\n pushq %r12\n pushq %r13\n pushq %r14\n pushq %r15\n"
      "movq %rsp, (%rdi)\n movq %rsi, %rsp\n"
      "popq %r15\n popq %r14\n popq %r13\n popq %r12\n popq %rbx\n popq %rbp\n"
      "ret\n");
#else
  asm volatile(
      "sub sp, sp, #160\n"
      "stp x19, x20, [sp, #0]\n stp x21, x22, [sp, #16]\n stp x23, x24, [sp, #32]\n"
      "stp x25, x26, [sp, #48]\n stp x27, x28, [sp, #64]\n stp x29, x30, [sp, #80]\n"
      "stp d8, d9, [sp, #96]\n stp d10, d11, [sp, #112]\n stp d12, d13, [sp, #128]\n"
      "stp d14, d15, [sp, #144]\n"
      "mov x2, sp\n str x2, [x0]\n mov sp, x1\n"
      "ldp x19, x20, [sp, #0]\n ldp x21, x22, [sp, #16]\n ldp x23, x24, [sp, #32]\n"
      "ldp x25, x26, [sp, #48]\n ldp x27, x28, [sp, #64]\n ldp x29, x30, [sp, #80]\n"
      "ldp d8, d9, [sp, #96]\n ldp d10, d11, [sp, #112]\n ldp d12, d13, [sp, #128]\n"
      "ldp d14, d15, [sp, #144]\n"
      "add sp, sp, #160\n ret\n");
#endif
}
// A fresh stack whose first fast_switch "returns" into entry() (which never returns).
inline void* fast_stack_init(char* stack, size_t size, void (*entry)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
#if defined(__x86_64__)
  *--sp = nullptr;                          // entry's (never used) return address
  *--sp = reinterpret_cast<void*>(entry);   // popped by ret: rsp % 16 == 8 at entry
  for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp rbx r12-r15
#else
  sp -= 20;  // x19..x28, x29, x30, d8..d15
  for (int i = 0; i < 20; ++i) sp[i] = nullptr;
  sp[11] = reinterpret_cast<void*>(entry);  // x30 (lr): where ret goes
#endif
  return sp;
}
}  // namespace mslemu
#endif

// ---- MSL scalar and vector types ------------------------------------------------------------
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;
typedef __bf16 bfloat;
#define MSL_EMU_VEC(T)                                  \
  typedef T T##2 __attribute__((ext_vector_type(2))); \
  typedef T T##3 __attribute__((ext_vector_type(3))); \
  typedef T T##4 __attribute__((ext_vector_type(4)));
MSL_EMU_VEC(float)
MSL_EMU_VEC(half)
MSL_EMU_VEC(int)
MSL_EMU_VEC(uint)
MSL_EMU_VEC(short)
MSL_EMU_VEC(ushort)
MSL_EMU_VEC(ulong)
MSL_EMU_VEC(long)
#undef MSL_EMU_VEC

namespace mslemu {

// ---- fiber scheduler (run mode) -------------------------------------------------------------
enum class State : uint8_t { kRunnable, kAtBarrier, kAtSimd, kDone };

struct Fiber {
  ucontext_t ctx;
  void* sp = nullptr;  // saved stack pointer (fast switch)
  char* stack = nullptr;
  size_t stack_size = 0;
  State state = State::kRunnable;
  int wait_line = 0;         // source line of the barrier / simd op it waits at
  uint64_t simd_seq = 0;     // simd ops executed so far (lanes must agree)
  uint64_t barrier_seq = 0;  // barriers passed so far
};

constexpr int kSimdWidth = 32;
constexpr int kSlotBytes = 64;  // largest value exchanged by one simd op

struct SimdState {
  int arrived = 0;
  int line = 0;
  const char* op = nullptr;
  uint64_t seq = 0;
  // Double-buffered by op parity: a lane released from op n may run ahead into op n+1 while
  // slower lanes still read op n's slots; it cannot reach op n+2 before they have.
  alignas(16) unsigned char slots[2][kSimdWidth][kSlotBytes];
};

struct Group {
  int nthreads = 0;
  int nsimd = 0;
  Fiber* fibers = nullptr;
  SimdState* simd = nullptr;
  int cur = -1;
  ucontext_t sched;
  void* sched_sp = nullptr;
  std::vector<int> runq;
  int barrier_arrived = 0;
  int barrier_line = 0;
  uint64_t barrier_seq = 0;
  bool failed = false;
  std::string error;
  std::vector<std::pair<const void*, size_t>> tg_arrays;  // threadgroup memory seen
  size_t tg_bytes = 0;
  void (*body)(void* ctx, int tid) = nullptr;
  void* body_ctx = nullptr;
#ifdef MSL_EMU_ASAN
  void* sched_fake_stack = nullptr;
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
#endif
};

inline thread_local Group* t_group = nullptr;

inline Fiber& cur_fiber() { return t_group->fibers[t_group->cur]; }
inline int cur_lane() { return t_group->cur % kSimdWidth; }
inline int cur_simdgroup() { return t_group->cur / kSimdWidth; }
inline int lanes_in(const Group& g, int sg) {
  return std::min(kSimdWidth, g.nthreads - sg * kSimdWidth);
}

// Fiber -> scheduler switch; returns when the scheduler resumes this fiber.
inline void switch_to_scheduler(bool exiting = false) {
  Group* g = t_group;
  Fiber& f = g->fibers[g->cur];
#if defined(MSL_EMU_FAST_SWITCH)
  (void)exiting;
  fast_switch(&f.sp, g->sched_sp);
#elif defined(MSL_EMU_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(exiting ? nullptr : &fake, g->sched_stack_bottom,
                                 g->sched_stack_size);
  swapcontext(&f.ctx, &g->sched);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  (void)exiting;
  swapcontext(&f.ctx, &g->sched);
#endif
}

// Records the first error and parks the fiber forever (the scheduler abandons the group).
// Takes a C string: an abandoned fiber never unwinds, so it must own no heap objects.
[[noreturn]] inline void fail(const char* msg) {
  Group* g = t_group;
  if (!g->failed) {
    g->failed = true;
    g->error = msg;
  }
  cur_fiber().state = State::kDone;
  switch_to_scheduler(true);
  std::abort();  // never resumed
}

inline void block(State st, int line) {
  Fiber& f = cur_fiber();
  f.state = st;
  f.wait_line = line;
  switch_to_scheduler();
}

inline void fiber_entry() {
  Group* g = t_group;
#ifdef MSL_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g->sched_stack_bottom, &g->sched_stack_size);
#endif
  int tid = g->cur;
  g->body(g->body_ctx, tid);
  g->fibers[tid].state = State::kDone;
  switch_to_scheduler(true);
  std::abort();  // never resumed
}

// Fiber stacks are reused across groups run by the same OS thread.
struct StackPool {
  std::vector<std::pair<char*, size_t>> stacks;
  ~StackPool() {
    for (auto& s : stacks) std::free(s.first);
  }
  char* get(int i, size_t size) {
    while ((int)stacks.size() <= i) stacks.push_back({nullptr, 0});
    if (stacks[i].second < size) {
      std::free(stacks[i].first);
      stacks[i].first = static_cast<char*>(std::aligned_alloc(64, size));
      stacks[i].second = size;
    }
    return stacks[i].first;
  }
};

inline size_t fiber_stack_size() {
#ifdef MSL_EMU_ASAN
  return 512 * 1024;
#else
  return 128 * 1024;
#endif
}

inline std::string describe_waits(const Group& g) {
  std::map<std::string, int> counts;
  for (int t = 0; t < g.nthreads; ++t) {
    const Fiber& f = g.fibers[t];
    std::string k;
    switch (f.state) {
      case State::kDone: k = "exited"; break;
      case State::kRunnable: k = "runnable"; break;
      case State::kAtBarrier: k = "at threadgroup_barrier line " + std::to_string(f.wait_line); break;
      case State::kAtSimd: k = "at simd op line " + std::to_string(f.wait_line); break;
    }
    counts[k]++;
  }
  std::string s;
  for (auto& kv : counts) s += (s.empty() ? "" : ", ") + std::to_string(kv.second) + " " + kv.first;
  return s;
}

// Runs one threadgroup of `nthreads` threads to completion. Returns "" or an error.
inline std::string run_group(int nthreads, void (*body)(void*, int), void* ctx) {
  thread_local StackPool pool;
  thread_local std::vector<Fiber> fibers;
  thread_local std::vector<SimdState> simd;
  Group g;
  g.nthreads = nthreads;
  g.nsimd = (nthreads + kSimdWidth - 1) / kSimdWidth;
  fibers.assign(nthreads, Fiber{});
  simd.assign(g.nsimd, SimdState{});
  g.fibers = fibers.data();
  g.simd = simd.data();
  g.body = body;
  g.body_ctx = ctx;
  const size_t ss = fiber_stack_size();
  for (int t = 0; t < nthreads; ++t) {
    Fiber& f = fibers[t];
    f.stack = pool.get(t, ss);
    f.stack_size = ss;
#if defined(MSL_EMU_FAST_SWITCH)
    f.sp = fast_stack_init(f.stack, ss, fiber_entry);
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = ss;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
#endif
  }
  g.runq.reserve(nthreads);
  for (int t = nthreads - 1; t >= 0; --t) g.runq.push_back(t);
  Group* saved = t_group;
  t_group = &g;
  while (!g.failed) {
    if (g.runq.empty()) {
      int done = 0;
      for (int t = 0; t < nthreads; ++t) done += fibers[t].state == State::kDone;
      if (done == nthreads) break;
      bool barrier_div = false;
      for (int t = 0; t < nthreads; ++t)
        if (fibers[t].state == State::kAtBarrier && done > 0) barrier_div = true;
      g.failed = true;
      g.error = std::string(barrier_div ? "divergent threadgroup_barrier"
                                        : "deadlock (divergent simd op or barrier)") +
                ": " + describe_waits(g);
      break;
    }
    int t = g.runq.back();
    g.runq.pop_back();
    g.cur = t;
    fibers[t].state = State::kRunnable;
#if defined(MSL_EMU_FAST_SWITCH)
    fast_switch(&g.sched_sp, fibers[t].sp);
#elif defined(MSL_EMU_ASAN)
    __sanitizer_start_switch_fiber(&g.sched_fake_stack, fibers[t].stack, fibers[t].stack_size);
    swapcontext(&g.sched, &fibers[t].ctx);
    __sanitizer_finish_switch_fiber(g.sched_fake_stack, nullptr, nullptr);
#else
    swapcontext(&g.sched, &fibers[t].ctx);
#endif
  }
  t_group = saved;
  return g.failed ? g.error : std::string();
}

// Threadgroup arrays (MSL_TG_ARRAY): the first thread of a group to reach a declaration
// fills the array with 0xFF bytes (NaN for floats), since GPU threadgroup memory starts
// undefined, and the group's total is held to Apple GPUs' 32 KiB.
constexpr size_t kThreadgroupMemoryLimit = 32768;
inline void tg_register(void* p, size_t bytes) {
  Group& g = *t_group;
  for (auto& a : g.tg_arrays)
    if (a.first == p) return;
  g.tg_arrays.push_back({p, bytes});
  g.tg_bytes += bytes;
  if (g.tg_bytes > kThreadgroupMemoryLimit) {
    char msg[160];
    std::snprintf(msg, sizeof(msg), "threadgroup memory of %zu bytes exceeds %zu", g.tg_bytes,
                  kThreadgroupMemoryLimit);
    fail(msg);
  }
  std::memset(p, 0xFF, bytes);
}

// ---- rendezvous primitives used by the metal:: functions ------------------------------------
inline void barrier(int line) {
  Group& g = *t_group;
  Fiber& f = cur_fiber();
  if (g.barrier_arrived == 0) {
    g.barrier_line = line;
    g.barrier_seq = f.barrier_seq;
  } else if (g.barrier_line != line || g.barrier_seq != f.barrier_seq) {
    char msg[256];
    std::snprintf(msg, sizeof(msg),
                  "divergent threadgroup_barrier: thread %d at line %d while others wait at line %d",
                  g.cur, line, g.barrier_line);
    fail(msg);
  }
  f.barrier_seq++;
  if (++g.barrier_arrived == g.nthreads) {
    g.barrier_arrived = 0;
    for (int t = 0; t < g.nthreads; ++t)
      if (g.fibers[t].state == State::kAtBarrier) {
        g.fibers[t].state = State::kRunnable;
        g.runq.push_back(t);
      }
    return;
  }
  block(State::kAtBarrier, line);
}

// Deposits `n` bytes for this lane, waits for the whole simdgroup, returns the op's slots.
// `combine(slots, nlanes)`, if given, runs once, in the last lane to arrive, before any lane
// reads: it may rewrite the slots in place (a reduction or a matrix product computed once
// instead of by every lane).
using SimdSlots = unsigned char (*)[kSlotBytes];
struct NoCombine {
  void operator()(SimdSlots, int) const {}
};
template <class Combine = NoCombine>
inline const unsigned char (*simd_exchange(const void* data, size_t n, const char* op, int line,
                                           const Combine& combine = Combine()))[kSlotBytes] {
  Group& g = *t_group;
  Fiber& f = cur_fiber();
  const int sg = cur_simdgroup();
  SimdState& s = g.simd[sg];
  const int buf = int(f.simd_seq & 1);
  std::memcpy(s.slots[buf][cur_lane()], data, n);
  if (s.arrived == 0) {
    s.line = line;
    s.op = op;
    s.seq = f.simd_seq;
  } else if (s.line != line || s.seq != f.simd_seq || std::strcmp(s.op, op) != 0) {
    char msg[256];
    std::snprintf(msg, sizeof(msg),
                  "divergent simd op: lane %d of simdgroup %d at %s line %d while other lanes "
                  "wait at %s line %d",
                  cur_lane(), sg, op, line, s.op, s.line);
    fail(msg);
  }
  f.simd_seq++;
  if (++s.arrived == lanes_in(g, sg)) {
    s.arrived = 0;
    combine(s.slots[buf], lanes_in(g, sg));
    for (int t = sg * kSimdWidth; t < sg * kSimdWidth + lanes_in(g, sg); ++t)
      if (g.fibers[t].state == State::kAtSimd) {
        g.fibers[t].state = State::kRunnable;
        g.runq.push_back(t);
      }
  } else {
    block(State::kAtSimd, line);
  }
  return s.slots[buf];
}

template <class T>
T simd_gather_lane(const unsigned char (*slots)[kSlotBytes], int lane) {
  T r;
  std::memcpy(&r, slots[lane], sizeof(T));
  return r;
}

// ---- grid launch ----------------------------------------------------------------------------
struct Dim3 {
  uint x = 1, y = 1, z = 1;
};

inline int worker_count() { return int(std::max(1u, std::thread::hardware_concurrency())); }

// Runs body(tg_pos, tid) for every thread of a grid of threadgroups, over `workers` OS threads.
template <class Body>
std::string dispatch(Dim3 grid, int threads_per_group, const Body& body, int workers = 0) {
  if (threads_per_group <= 0 || threads_per_group > 1024) return "bad threadgroup size";
  const uint64_t ngroups = uint64_t(grid.x) * grid.y * grid.z;
  if (ngroups == 0) return "";
  if (workers <= 0) workers = worker_count();
  workers = int(std::min<uint64_t>(workers, ngroups));
  std::atomic<uint64_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::string first_error;
  auto work = [&] {
    for (;;) {
      if (stop.load()) return;
      uint64_t gi = next.fetch_add(1);
      if (gi >= ngroups) return;
      uint3 pos;
      pos.x = uint(gi % grid.x);
      pos.y = uint((gi / grid.x) % grid.y);
      pos.z = uint(gi / (uint64_t(grid.x) * grid.y));
      struct Ctx {
        const Body* body;
        uint3 pos;
      } ctx{&body, pos};
      std::string err = run_group(
          threads_per_group,
          [](void* c, int tid) {
            auto* cx = static_cast<Ctx*>(c);
            (*cx->body)(cx->pos, uint(tid));
          },
          &ctx);
      if (!err.empty()) {
        std::lock_guard<std::mutex> lk(mu);
        if (first_error.empty())
          first_error = err + " (threadgroup " + std::to_string(pos.x) + "," +
                        std::to_string(pos.y) + "," + std::to_string(pos.z) + ")";
        stop = true;
        return;
      }
    }
  };
  if (workers == 1) {
    work();
  } else {
    std::vector<std::thread> ts;
    for (int i = 0; i < workers; ++i) ts.emplace_back(work);
    for (auto& t : ts) t.join();
  }
  return first_error;
}

// ---- kernels by name --------------------------------------------------------------------------
// A launcher binds buffers[i] to the kernel's i-th argument and runs the grid.
using Launcher = std::string (*)(Dim3 grid, int threads, void* const* buffers, int nbuffers);

inline std::map<std::string, Launcher>& registry() {
  static std::map<std::string, Launcher> r;
  return r;
}

template <class A>
A bind_arg(void* p) {
  if constexpr (std::is_pointer_v<A>) {
    return reinterpret_cast<A>(p);
  } else {
    static_assert(std::is_reference_v<A>, "kernel buffer arguments are pointers or references");
    return *reinterpret_cast<std::remove_reference_t<A>*>(p);
  }
}

template <auto Fn, class... A, size_t... I>
std::string launch_impl(Dim3 grid, int threads, void* const* buffers, int nbuffers,
                        std::index_sequence<I...>) {
  using Args = std::tuple<A...>;
  constexpr size_t kBuffers = sizeof...(I);
  if (nbuffers != int(kBuffers))
    return "kernel takes " + std::to_string(kBuffers) + " buffers, got " + std::to_string(nbuffers);
  auto body = [&](uint3 pos, uint tid) {
    Fn(bind_arg<std::tuple_element_t<I, Args>>(buffers[I])..., pos, tid / kSimdWidth,
       tid % kSimdWidth, tid);
  };
  return dispatch(grid, threads, body);
}

template <auto Fn, class... A>
std::string launch_fn(void (*)(A...), Dim3 grid, int threads, void* const* buffers,
                      int nbuffers) {
  constexpr size_t n = sizeof...(A);
  static_assert(n >= 4, "kernel must end with the 4 thread-position arguments");
  using Args = std::tuple<A...>;
  static_assert(std::is_same_v<std::tuple_element_t<n - 4, Args>, uint3> &&
                    std::is_same_v<std::tuple_element_t<n - 3, Args>, uint> &&
                    std::is_same_v<std::tuple_element_t<n - 2, Args>, uint> &&
                    std::is_same_v<std::tuple_element_t<n - 1, Args>, uint>,
                "kernel tail must be (uint3 tg_pos, uint simdgroup, uint lane, uint tid)");
  return launch_impl<Fn, A...>(grid, threads, buffers, nbuffers, std::make_index_sequence<n - 4>{});
}

template <auto Fn>
std::string launcher(Dim3 grid, int threads, void* const* buffers, int nbuffers) {
  return launch_fn<Fn>(Fn, grid, threads, buffers, nbuffers);
}

struct Registrar {
  Registrar(const char* name, Launcher l) { registry()[name] = l; }
};

inline std::string launch(const std::string& name, Dim3 grid, int threads, void* const* buffers,
                          int nbuffers) {
  auto it = registry().find(name);
  if (it == registry().end()) return "no kernel named " + name;
  return it->second(grid, threads, buffers, nbuffers);
}

}  // namespace mslemu

#define MSL_EMU_CAT2(a, b) a##b
#define MSL_EMU_CAT(a, b) MSL_EMU_CAT2(a, b)
#ifdef MSL_EMU_CHECK
// Instantiating checks every template body with concrete types.
#define MSL_INSTANTIATE_KERNEL(name, func, ...) \
  template decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;
#else
#define MSL_INSTANTIATE_KERNEL(name, func, ...)                   \
  template decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;         \
  static const ::mslemu::Registrar MSL_EMU_CAT(msl_emu_reg_, __COUNTER__)( \
      name, &::mslemu::launcher<&func<__VA_ARGS__>>);
#endif

// ---- the metal namespace ----------------------------------------------------------------------
namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

inline void threadgroup_barrier(mem_flags, int line = __builtin_LINE()) {
  mslemu::barrier(line);
}
inline void simdgroup_barrier(mem_flags, int line = __builtin_LINE()) {
  char z = 0;
  mslemu::simd_exchange(&z, 1, "simdgroup_barrier", line);
}

namespace detail {
template <class T, class Op>
T simd_reduce(T x, const char* name, int line, Op op) {
  static_assert(sizeof(T) <= mslemu::kSlotBytes, "simd value too large");
  // Reduced once, in lane order (deterministic), into slot 0.
  auto slots = mslemu::simd_exchange(&x, sizeof(T), name, line,
                                     [&](mslemu::SimdSlots sl, int n) {
                                       T r = mslemu::simd_gather_lane<T>(sl, 0);
                                       for (int i = 1; i < n; ++i)
                                         r = op(r, mslemu::simd_gather_lane<T>(sl, i));
                                       std::memcpy(sl[0], &r, sizeof(T));
                                     });
  return mslemu::simd_gather_lane<T>(slots, 0);
}
template <class T>
T simd_read(T x, int src, const char* name, int line) {
  auto slots = mslemu::simd_exchange(&x, sizeof(T), name, line);
  const int n = mslemu::lanes_in(*mslemu::t_group, mslemu::cur_simdgroup());
  return (src >= 0 && src < n) ? mslemu::simd_gather_lane<T>(slots, src) : x;
}
}  // namespace detail

template <class T>
T simd_sum(T x, int line = __builtin_LINE()) {
  return detail::simd_reduce(x, "simd_sum", line, [](T a, T b) { return T(a + b); });
}
template <class T>
T simd_product(T x, int line = __builtin_LINE()) {
  return detail::simd_reduce(x, "simd_product", line, [](T a, T b) { return T(a * b); });
}
template <class T>
T simd_max(T x, int line = __builtin_LINE()) {
  return detail::simd_reduce(x, "simd_max", line, [](T a, T b) { return a < b ? b : a; });
}
template <class T>
T simd_min(T x, int line = __builtin_LINE()) {
  return detail::simd_reduce(x, "simd_min", line, [](T a, T b) { return b < a ? b : a; });
}
inline bool simd_all(bool x, int line = __builtin_LINE()) {
  return detail::simd_reduce(x, "simd_all", line, [](bool a, bool b) { return a && b; });
}
inline bool simd_any(bool x, int line = __builtin_LINE()) {
  return detail::simd_reduce(x, "simd_any", line, [](bool a, bool b) { return a || b; });
}
template <class T>
T simd_shuffle(T x, ushort src, int line = __builtin_LINE()) {
  return detail::simd_read(x, int(src), "simd_shuffle", line);
}
template <class T>
T simd_broadcast(T x, ushort src, int line = __builtin_LINE()) {
  return detail::simd_read(x, int(src), "simd_broadcast", line);
}
template <class T>
T simd_broadcast_first(T x, int line = __builtin_LINE()) {
  return detail::simd_read(x, 0, "simd_broadcast_first", line);
}
template <class T>
T simd_shuffle_xor(T x, ushort mask, int line = __builtin_LINE()) {
  return detail::simd_read(x, mslemu::cur_lane() ^ int(mask), "simd_shuffle_xor", line);
}
// A source lane out of range is not specified by MSL; here the lane keeps its own value.
template <class T>
T simd_shuffle_down(T x, ushort delta, int line = __builtin_LINE()) {
  return detail::simd_read(x, mslemu::cur_lane() + int(delta), "simd_shuffle_down", line);
}
template <class T>
T simd_shuffle_up(T x, ushort delta, int line = __builtin_LINE()) {
  return detail::simd_read(x, mslemu::cur_lane() - int(delta), "simd_shuffle_up", line);
}

// ---- math (precise; the host compiles shaders with safe math too) ---------------------------
using std::abs;
using std::fabs;
using std::ceil;
using std::exp;
using std::exp2;
using std::floor;
using std::fma;
using std::isfinite;
using std::isinf;
using std::isnan;
using std::log;
using std::log2;
using std::pow;
using std::sqrt;
using std::tanh;
template <class T>
T max(T a, T b) {
  return a < b ? b : a;
}
template <class T>
T min(T a, T b) {
  return b < a ? b : a;
}
template <class T>
T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
template <class T>
T select(T a, T b, bool c) {
  return c ? b : a;
}
template <class T>
T rsqrt(T x) {
  return T(1) / std::sqrt(x);
}
inline float exp2(half x) { return std::exp2(float(x)); }
namespace precise {
using std::exp;
using std::exp2;
using std::log;
using std::log2;
}  // namespace precise
namespace fast {
using std::exp;
using std::exp2;
using std::log;
using std::log2;
}  // namespace fast

template <class T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static constexpr half max() { return half(65504.0f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half infinity() { return half(__builtin_inff()); }
};

// ---- simdgroup_matrix (8x8) -----------------------------------------------------------------
// Metal's fragment layout (as used by MLX's steel MMA): with q = lane / 4, lane l holds row
// (q & 4) + ((l / 2) % 4) and columns (q & 2) * 2 + (l % 2) * 2 + {0, 1}.
inline void frag_coord(int lane, int& row, int& col) {
  const int q = lane / 4;
  row = (q & 4) + ((lane / 2) % 4);
  col = (q & 2) * 2 + (lane % 2) * 2;
}

template <class T, int Rows, int Cols>
struct simdgroup_matrix {
  static_assert(Rows == 8 && Cols == 8, "only 8x8 simdgroup matrices are emulated");
  typedef T E2 __attribute__((ext_vector_type(2)));
  E2 e;
  simdgroup_matrix() : e{T(0), T(0)} {}
  explicit simdgroup_matrix(T v) : e{v, v} {}
  E2& thread_elements() { return e; }
  const E2& thread_elements() const { return e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int R, int C>
simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
  return simdgroup_matrix<T, R, C>(v);
}

template <class T, class P>
void simdgroup_load(simdgroup_matrix<T, 8, 8>& m, P src, ulong elements_per_row = 8,
                    ulong2 origin = ulong2(0), bool transpose = false) {
  int r, c;
  frag_coord(mslemu::cur_lane(), r, c);
  for (int j = 0; j < 2; ++j) {
    const ulong row = r + origin.y, col = c + j + origin.x;
    m.e[j] = T(transpose ? src[col * elements_per_row + row] : src[row * elements_per_row + col]);
  }
}

template <class T, class P>
void simdgroup_store(const simdgroup_matrix<T, 8, 8>& m, P dst, ulong elements_per_row = 8,
                     ulong2 origin = ulong2(0), bool transpose = false) {
  int r, c;
  frag_coord(mslemu::cur_lane(), r, c);
  for (int j = 0; j < 2; ++j) {
    const ulong row = r + origin.y, col = c + j + origin.x;
    if (transpose)
      dst[col * elements_per_row + row] = m.e[j];
    else
      dst[row * elements_per_row + col] = m.e[j];
  }
}

// D = A * B + C in float, computed once per simdgroup from all lanes' fragments.
template <class TD, class TA, class TB, class TC>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d,
                                   const simdgroup_matrix<TA, 8, 8>& a,
                                   const simdgroup_matrix<TB, 8, 8>& b,
                                   const simdgroup_matrix<TC, 8, 8>& c,
                                   int line = __builtin_LINE()) {
  const float mine[6] = {float(a.e[0]), float(a.e[1]), float(b.e[0]),
                         float(b.e[1]), float(c.e[0]), float(c.e[1])};
  auto slots = mslemu::simd_exchange(
      mine, sizeof(mine), "simdgroup_multiply_accumulate", line,
      [](mslemu::SimdSlots sl, int n) {
        float A[8][8] = {}, B[8][8] = {}, C[8][8] = {};
        for (int l = 0; l < n; ++l) {
          float v[6];
          std::memcpy(v, sl[l], sizeof(v));
          int r, col;
          frag_coord(l, r, col);
          for (int j = 0; j < 2; ++j) {
            A[r][col + j] = v[j];
            B[r][col + j] = v[2 + j];
            C[r][col + j] = v[4 + j];
          }
        }
        for (int l = 0; l < n; ++l) {
          int r, col;
          frag_coord(l, r, col);
          float out[2];
          for (int j = 0; j < 2; ++j) {
            float acc = C[r][col + j];
            for (int k = 0; k < 8; ++k) acc += A[r][k] * B[k][col + j];
            out[j] = acc;
          }
          std::memcpy(sl[l], out, sizeof(out));
        }
      });
  float out[2];
  std::memcpy(out, slots[mslemu::cur_lane()], sizeof(out));
  d.e[0] = TD(out[0]);
  d.e[1] = TD(out[1]);
}

template <class TD, class TA, class TB>
void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                        const simdgroup_matrix<TB, 8, 8>& b, int line = __builtin_LINE()) {
  simdgroup_matrix<TD, 8, 8> zero;
  simdgroup_multiply_accumulate(d, a, b, zero, line);
}

}  // namespace metal

#ifndef INFINITY
#define INFINITY __builtin_inff()
#endif

// ---- address spaces and attributes (last: `thread` would clash with std::thread) ----------
#ifdef MSL_EMU_CHECK
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define MSL_TG_ARRAY(T, name, n) static threadgroup T name[n]
#else
#define device
#define constant const
#define threadgroup
// One copy per OS thread; an OS thread runs one threadgroup at a time, so this is shared by
// exactly the fibers of the running group, like threadgroup memory.
#define MSL_TG_ARRAY(T, name, n) \
  static thread_local T name[n];   \
  ::mslemu::tg_register(name, sizeof(name))
#endif
#define thread
#define METAL_FUNC inline


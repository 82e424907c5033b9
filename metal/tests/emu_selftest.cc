// Self-test of the MSL emulator and of the attention kernels under it, without Python:
//  - simdgroup_matrix fragment layout (Metal's, as documented by MLX/tinygrad) and MMA,
//  - simd_* semantics, threadgroup memory + barriers,
//  - divergent barriers, divergent simd ops and deadlocks are reported as errors,
//  - every attention kernel on odd shapes vs a float64 reference (built with ASan by
//    JAX_SDPA_METAL_EMULATOR_ASAN=ON, this is the out-of-bounds check of the kernels).
// Built by metal/CMakeLists.txt with clang; run by CTest (metal_emu_selftest).
#include "metal/host/runner_emulator.cc"  // plan + runner (before the MSL keywords exist)
//
#include "metal/host/host_emulator.cc"  // emulator + the project's kernels

#include <algorithm>
#include <random>

static int g_failures = 0;
#define CHECK(cond, ...)                                     \
  do {                                                       \
    if (!(cond)) {                                           \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__);       \
      std::printf(__VA_ARGS__);                              \
      std::printf("\n");                                     \
      ++g_failures;                                          \
    }                                                        \
  } while (0)

// ---- test kernels (MSL) -------------------------------------------------------------------
template <typename T>
[[kernel]] void t_layout(device const float* src [[buffer(0)]], device float* lanes [[buffer(1)]],
                         device float* prod [[buffer(2)]], uint3 tgp [[threadgroup_position_in_grid]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint tid [[thread_index_in_threadgroup]]) {
  simdgroup_matrix<T, 8, 8> a, b, c;
  simdgroup_load(a, src, 8);
  simdgroup_load(b, src + 64, 8, ulong2(0), true);  // transposed
  lanes[lane * 2] = float(a.thread_elements()[0]);
  lanes[lane * 2 + 1] = float(a.thread_elements()[1]);
  c = make_filled_simdgroup_matrix<T, 8, 8>(T(1));
  simdgroup_multiply_accumulate(c, a, b, c);
  simdgroup_store(c, prod, 8);
}
MSL_INSTANTIATE_KERNEL("t_layout_f32", t_layout, float)

[[kernel]] void t_simd(device float* out [[buffer(0)]], uint3 tgp [[threadgroup_position_in_grid]],
                       uint sg [[simdgroup_index_in_threadgroup]],
                       uint lane [[thread_index_in_simdgroup]],
                       uint tid [[thread_index_in_threadgroup]]) {
  MSL_TG_ARRAY(float, partial, 4);
  const float x = float(tid);
  const float s = simd_sum(x);
  const float mx = simd_max(x);
  const float xr = simd_shuffle_xor(x, ushort(5));
  const float dn = simd_shuffle_down(x, ushort(3));
  if (lane == 0) partial[sg] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float total = partial[0] + partial[1] + partial[2] + partial[3];
  out[tid * 5 + 0] = s;
  out[tid * 5 + 1] = mx;
  out[tid * 5 + 2] = xr;
  out[tid * 5 + 3] = dn;
  out[tid * 5 + 4] = total + float(tgp.x) * 1000.0f;
}
template <typename T = void>
[[kernel]] void t_simd_k(device float* out [[buffer(0)]], uint3 tgp [[threadgroup_position_in_grid]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]],
                         uint tid [[thread_index_in_threadgroup]]) {
  t_simd(out + tgp.x * 128 * 5, tgp, sg, lane, tid);
}
MSL_INSTANTIATE_KERNEL("t_simd", t_simd_k, void)

template <typename T = void>
[[kernel]] void t_div_barrier(device float* x [[buffer(0)]], uint3 tgp [[threadgroup_position_in_grid]],
                              uint sg [[simdgroup_index_in_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]],
                              uint tid [[thread_index_in_threadgroup]]) {
  if (tid < 16) return;  // early exit, then a barrier: undefined on a GPU
  threadgroup_barrier(mem_flags::mem_threadgroup);
  x[tid] = 1.0f;
}
MSL_INSTANTIATE_KERNEL("t_div_barrier", t_div_barrier, void)

template <typename T = void>
[[kernel]] void t_div_barrier2(device float* x [[buffer(0)]], uint3 tgp [[threadgroup_position_in_grid]],
                               uint sg [[simdgroup_index_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]],
                               uint tid [[thread_index_in_threadgroup]]) {
  if (sg == 0)
    threadgroup_barrier(mem_flags::mem_threadgroup);  // two different barriers
  else
    threadgroup_barrier(mem_flags::mem_threadgroup);
  x[tid] = 1.0f;
}
MSL_INSTANTIATE_KERNEL("t_div_barrier2", t_div_barrier2, void)

template <typename T = void>
[[kernel]] void t_div_simd(device float* x [[buffer(0)]], uint3 tgp [[threadgroup_position_in_grid]],
                           uint sg [[simdgroup_index_in_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint tid [[thread_index_in_threadgroup]]) {
  float v = 1.0f;
  if (lane < 16)
    v = simd_sum(v);
  else
    v = simd_max(v);
  x[tid] = v;
}
MSL_INSTANTIATE_KERNEL("t_div_simd", t_div_simd, void)

template <typename T = void>
[[kernel]] void t_deadlock(device float* x [[buffer(0)]], uint3 tgp [[threadgroup_position_in_grid]],
                           uint sg [[simdgroup_index_in_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint tid [[thread_index_in_threadgroup]]) {
  float v = 1.0f;
  if (lane < 16) v = simd_sum(v);  // waits for lanes 16..31, which wait at the barrier
  threadgroup_barrier(mem_flags::mem_threadgroup);
  x[tid] = v;
}
MSL_INSTANTIATE_KERNEL("t_deadlock", t_deadlock, void)

template <typename T = void>
[[kernel]] void t_tg_too_big(device float* x [[buffer(0)]], uint3 tgp [[threadgroup_position_in_grid]],
                             uint sg [[simdgroup_index_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]],
                             uint tid [[thread_index_in_threadgroup]]) {
  MSL_TG_ARRAY(float, a, 6000);
  MSL_TG_ARRAY(float, b, 3000);  // 36 000 bytes in all: more than Apple GPUs have
  a[tid] = b[tid] = 1.0f;
  x[tid] = a[tid] + b[tid];
}
MSL_INSTANTIATE_KERNEL("t_tg_too_big", t_tg_too_big, void)

template <typename T = void>
[[kernel]] void t_tg_poison(device float* x [[buffer(0)]], uint3 tgp [[threadgroup_position_in_grid]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint tid [[thread_index_in_threadgroup]]) {
  MSL_TG_ARRAY(float, a, 64);
  if (tid < 32) a[tid] = 1.0f;  // the other half is never written
  threadgroup_barrier(mem_flags::mem_threadgroup);
  x[tid] = a[tid];
}
MSL_INSTANTIATE_KERNEL("t_tg_poison", t_tg_poison, void)

// ---- checks -----------------------------------------------------------------------------------
static std::string launch1(const char* name, uint32_t gx, uint32_t threads,
                           std::vector<void*> bufs) {
  mslemu::Dim3 g;
  g.x = gx;
  return mslemu::launch(name, g, int(threads), bufs.data(), int(bufs.size()));
}

static void test_layout() {
  std::vector<float> src(128), lanes(64), prod(64);
  for (int i = 0; i < 128; ++i) src[i] = float(i % 64) * 0.25f - 3.0f + (i >= 64 ? 0.5f : 0.0f);
  std::string e = launch1("t_layout_f32", 1, 32, {src.data(), lanes.data(), prod.data()});
  CHECK(e.empty(), "t_layout: %s", e.c_str());
  // Metal's 8x8 fragment layout, spelled out for a few lanes: lane -> (row, first column).
  const int expect[][3] = {{0, 0, 0}, {1, 0, 2}, {2, 1, 0}, {3, 1, 2}, {4, 2, 0}, {6, 3, 0},
                           {8, 0, 4}, {9, 0, 6}, {16, 4, 0}, {17, 4, 2}, {24, 4, 4}, {31, 7, 6}};
  for (auto& x : expect) {
    const int l = x[0], r = x[1], c = x[2];
    CHECK(lanes[l * 2] == src[r * 8 + c] && lanes[l * 2 + 1] == src[r * 8 + c + 1],
          "lane %d should hold row %d cols %d,%d", l, r, c, c + 1);
  }
  double err = 0;
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) {
      double acc = 1.0;
      for (int k = 0; k < 8; ++k) acc += double(src[i * 8 + k]) * src[64 + j * 8 + k];  // B^T
      err = std::max(err, std::abs(acc - prod[i * 8 + j]));
    }
  CHECK(err < 1e-4, "simdgroup_multiply_accumulate error %g", err);
}

static void test_simd() {
  std::vector<float> out(3 * 128 * 5);
  std::string e = launch1("t_simd", 3, 128, {out.data()});
  CHECK(e.empty(), "t_simd: %s", e.c_str());
  for (int g = 0; g < 3; ++g)
    for (int t = 0; t < 128; ++t) {
      const float* o = &out[(g * 128 + t) * 5];
      const int sg = t / 32, lane = t % 32;
      const float sum = float(32 * sg * 32 + 31 * 32 / 2);
      CHECK(o[0] == sum, "simd_sum tid %d: %g != %g", t, o[0], sum);
      CHECK(o[1] == float(sg * 32 + 31), "simd_max tid %d", t);
      CHECK(o[2] == float(sg * 32 + (lane ^ 5)), "simd_shuffle_xor tid %d", t);
      CHECK(o[3] == float(lane + 3 < 32 ? t + 3 : t), "simd_shuffle_down tid %d", t);
      CHECK(o[4] == float(127 * 128 / 2 + g * 1000), "barrier + threadgroup memory tid %d", t);
    }
}

static void expect_error(const char* kernel, const char* needle) {
  std::vector<float> x(64);
  std::string e = launch1(kernel, 1, 64, {x.data()});
  CHECK(e.find(needle) != std::string::npos, "%s: expected an error with '%s', got '%s'", kernel,
        needle, e.c_str());
  if (!e.empty()) std::printf("  %s reported: %s\n", kernel, e.c_str());
}

// ---- attention kernels vs float64 -------------------------------------------------------------
namespace js = jax_sdpa;

struct Problem {
  int B, Hq, Hk, Lq, Lk, D, Dv;
  bool causal, sinks, lengths;
  const char* kernel;  // "full", "decode" or null
  int splits;
  int segments = 0;    // 0: none; 1: sorted runs (lengths 1.. included); 2: unsorted ids
  double cap = 0.0;    // logits_soft_cap (0: off)
  int page_size = 0;   // > 0: K/V paged (forward only), pages shuffled, one page out of range
  int kv_layout = 0;   // paged: 0 = [P, Hk, S, D], 1 = [P, S, Hk, D]
};

// Segment ids of one row: sorted runs of random lengths (1 included) or random small ids.
static std::vector<int32_t> make_segments(int n, int kind, std::mt19937& rng) {
  std::vector<int32_t> ids(n);
  if (kind == 1) {
    int id = 3, left = 0;
    for (int x = 0; x < n; ++x) {
      if (left == 0) {
        id += 1 + int(rng() % 2);  // ids need not be contiguous
        left = 1 + int(rng() % 9);
      }
      ids[x] = id;
      --left;
    }
  } else {
    for (int x = 0; x < n; ++x) ids[x] = int(rng() % 4) - 1;
  }
  return ids;
}

static void test_attention(const Problem& pr, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  auto fill = [&](std::vector<float>& v, size_t n) {
    v.resize(n);
    for (auto& x : v) x = nd(rng) * 1.5f;
  };
  std::vector<float> q, k, v, sinks, dout;
  fill(q, size_t(pr.B) * pr.Hq * pr.Lq * pr.D);
  fill(k, size_t(pr.B) * pr.Hk * pr.Lk * pr.D);
  fill(v, size_t(pr.B) * pr.Hk * pr.Lk * pr.Dv);
  fill(sinks, size_t(pr.Hq));
  fill(dout, size_t(pr.B) * pr.Hq * pr.Lq * pr.Dv);
  std::vector<int32_t> qlen(pr.B), kvlen(pr.B);
  for (int b = 0; b < pr.B; ++b) {
    qlen[b] = pr.lengths ? (pr.Lq * (b + 1)) / (pr.B + 1) + (b == 0) : pr.Lq;
    kvlen[b] = pr.lengths ? (pr.Lk * (b + 2)) / (pr.B + 2) : pr.Lk;
  }
  std::vector<int32_t> qseg, kvseg;
  if (pr.segments) {
    for (int b = 0; b < pr.B; ++b) {
      auto a = make_segments(pr.Lq, pr.segments, rng);
      qseg.insert(qseg.end(), a.begin(), a.end());
      if (pr.Lq == pr.Lk) {
        kvseg.insert(kvseg.end(), a.begin(), a.end());
      } else {
        auto c = make_segments(pr.Lk, pr.segments, rng);
        kvseg.insert(kvseg.end(), c.begin(), c.end());
      }
    }
    if (pr.Lq > 2) qseg[1] = 1000;  // a query whose segment has no key: nothing to attend
  }
  js::SdpaParams p;
  p.batch = pr.B;
  p.heads_q = pr.Hq;
  p.heads_kv = pr.Hk;
  p.len_q = pr.Lq;
  p.len_kv = pr.Lk;
  p.head_dim = pr.D;
  p.head_dim_v = pr.Dv;
  auto strides = [](int64_t h, int64_t l, int64_t d, int64_t s[3]) {
    s[0] = h * l * d;
    s[1] = l * d;
    s[2] = d;
  };
  strides(pr.Hq, pr.Lq, pr.D, p.q_stride);
  strides(pr.Hk, pr.Lk, pr.D, p.k_stride);
  strides(pr.Hk, pr.Lk, pr.Dv, p.v_stride);
  strides(pr.Hq, pr.Lq, pr.Dv, p.o_stride);
  p.scale = 1.0 / std::sqrt(double(pr.D));
  p.window_right = pr.causal ? 0 : -1;
  p.bottom_right = true;
  p.sinks = pr.sinks ? sinks.data() : nullptr;
  p.sinks_batch_stride = 0;
  p.q_lengths = pr.lengths ? qlen.data() : nullptr;
  p.kv_lengths = pr.lengths ? kvlen.data() : nullptr;
  p.q_segment_ids = pr.segments ? qseg.data() : nullptr;
  p.kv_segment_ids = pr.segments ? kvseg.data() : nullptr;
  p.logits_soft_cap = pr.cap;

  // Paged: the pool holds every row's pages in a shuffled order plus spare pages of NaN (never
  // visible); row 0's second page index is out of range (its keys are invisible), and indices
  // past a row's length are garbage (never read).
  const int S = pr.page_size;
  const int pps = S > 0 ? (pr.Lk + S - 1) / S : 0;
  std::vector<int32_t> table;
  std::vector<float> kpool, vpool;
  std::vector<char> key_ok(size_t(pr.B) * pr.Lk, 1);
  if (S > 0 && pr.Lk % S != 0) {
    std::printf("FAIL paged problem needs Lk %% page_size == 0\n");
    ++g_failures;
    return;
  }
  if (S > 0) {
    const int P = pr.B * pps + 3;
    std::vector<int32_t> perm(P);
    for (int x = 0; x < P; ++x) perm[x] = x;
    std::shuffle(perm.begin(), perm.end(), rng);
    table.resize(size_t(pr.B) * pps);
    for (int x = 0; x < pr.B * pps; ++x) table[x] = perm[x];
    kpool.assign(size_t(P) * pr.Hk * S * pr.D, NAN);
    vpool.assign(size_t(P) * pr.Hk * S * pr.Dv, NAN);
    auto pool_off = [&](int page, int h, int slot, int d) -> size_t {
      return pr.kv_layout == 0 ? ((size_t(page) * pr.Hk + h) * S + slot) * d
                               : ((size_t(page) * S + slot) * pr.Hk + h) * d;
    };
    for (int b = 0; b < pr.B; ++b)
      for (int h = 0; h < pr.Hk; ++h)
        for (int j = 0; j < pr.Lk; ++j) {
          const int page = table[size_t(b) * pps + j / S];
          const size_t src = (size_t(b) * pr.Hk + h) * pr.Lk + j;
          for (int c = 0; c < pr.D; ++c) kpool[pool_off(page, h, j % S, pr.D) + c] = k[src * pr.D + c];
          for (int c = 0; c < pr.Dv; ++c) vpool[pool_off(page, h, j % S, pr.Dv) + c] = v[src * pr.Dv + c];
        }
    if (pps > 1) {
      table[1] = P + 5;  // out of range: row 0's keys S .. 2S-1 are invisible
      for (int j = S; j < 2 * S; ++j) key_ok[j] = 0;
    }
    for (int b = 0; b < pr.B; ++b)  // pages wholly past the row's length: garbage indices
      for (int lp = (kvlen[b] + S - 1) / S; lp < pps; ++lp) table[size_t(b) * pps + lp] = -7 - lp;
    p.page_indices = table.data();
    p.pages_per_seq = pps;
    p.page_size = S;
    p.num_pages = P;
    const int64_t st0 = int64_t(pr.Hk) * S, st1 = pr.kv_layout == 0 ? S : 1,
                  st2 = pr.kv_layout == 0 ? 1 : pr.Hk;
    p.k_stride[0] = st0 * pr.D, p.k_stride[1] = st1 * pr.D, p.k_stride[2] = st2 * pr.D;
    p.v_stride[0] = st0 * pr.Dv, p.v_stride[1] = st1 * pr.Dv, p.v_stride[2] = st2 * pr.Dv;
  }

  // float64 reference: out, lse, P, and tanh of the capped scores
  const int G = pr.Hq / pr.Hk;
  std::vector<double> ro(dout.size()), rl(size_t(pr.B) * pr.Hq * pr.Lq),
      P(size_t(pr.B) * pr.Hq * pr.Lq * pr.Lk), TC(P.size());
  int empty_rows = 0;
  for (int b = 0; b < pr.B; ++b)
    for (int h = 0; h < pr.Hq; ++h)
      for (int i = 0; i < pr.Lq; ++i) {
        const int hk = h / G, off = kvlen[b] - qlen[b];
        const size_t row = (size_t(b) * pr.Hq + h) * pr.Lq + i;
        std::vector<double> s(pr.Lk, -INFINITY);
        double mx = pr.sinks ? sinks[h] : -INFINITY;
        for (int j = 0; j < pr.Lk; ++j) {
          if (i >= qlen[b] || j >= kvlen[b] || (pr.causal && j > i + off)) continue;
          if (pr.segments && qseg[size_t(b) * pr.Lq + i] != kvseg[size_t(b) * pr.Lk + j]) continue;
          if (!key_ok[size_t(b) * pr.Lk + j]) continue;
          double d = 0;
          for (int c = 0; c < pr.D; ++c)
            d += double(q[row * pr.D + c]) * k[((size_t(b) * pr.Hk + hk) * pr.Lk + j) * pr.D + c];
          s[j] = d * p.scale;
          if (pr.cap > 0) {
            TC[row * pr.Lk + j] = std::tanh(s[j] / pr.cap);
            s[j] = pr.cap * TC[row * pr.Lk + j];
          }
          mx = std::max(mx, s[j]);
        }
        double tot = (pr.sinks && std::isfinite(mx)) ? std::exp(sinks[h] - mx) : 0.0;
        for (int j = 0; j < pr.Lk; ++j)
          if (std::isfinite(s[j])) tot += std::exp(s[j] - mx);
        const bool live = i < qlen[b] && tot > 0;
        empty_rows += i < qlen[b] && !live;
        rl[row] = live ? mx + std::log(tot) : -INFINITY;
        for (int j = 0; j < pr.Lk; ++j) {
          const double pj = live && std::isfinite(s[j]) ? std::exp(s[j] - rl[row]) : 0.0;
          P[row * pr.Lk + j] = pj;
          for (int c = 0; c < pr.Dv; ++c)
            if (pj != 0)
              ro[row * pr.Dv + c] += pj * v[((size_t(b) * pr.Hk + hk) * pr.Lk + j) * pr.Dv + c];
        }
      }

  if (pr.kernel) setenv("JAX_SDPA_METAL_KERNEL", pr.kernel, 1);
  if (pr.splits) setenv("JAX_SDPA_METAL_SPLITS", std::to_string(pr.splits).c_str(), 1);
  std::vector<float> out(ro.size(), NAN), lse(rl.size(), NAN);
  js::SdpaFwdBuffers fio{q.data(), S > 0 ? kpool.data() : k.data(),
                         S > 0 ? vpool.data() : v.data(), out.data(), lse.data()};
  js::metal::Plan plan;
  std::string e = js::metal::plan_forward(p, fio, &plan);
  if (e.empty()) e = js::metal::runner()->run(plan);
  const std::string kernel_ran = plan.launches.empty() ? "none" : plan.launches[0].kernel;
  unsetenv("JAX_SDPA_METAL_KERNEL");
  unsetenv("JAX_SDPA_METAL_SPLITS");
  CHECK(e.empty(), "forward: %s", e.c_str());
  double eo = 0, el = 0;
  for (size_t x = 0; x < ro.size(); ++x) eo = std::max(eo, std::abs(out[x] - ro[x]));
  for (size_t x = 0; x < rl.size(); ++x)
    el = std::max(el, std::isfinite(rl[x]) ? std::abs(lse[x] - rl[x])
                                            : (lse[x] == rl[x] ? 0.0 : INFINITY));
  if (std::isnan(eo)) eo = INFINITY;

  double eb = 0;
  if (S == 0) {  // backward from the reference out/lse (paged K/V is forward-only)
    std::vector<float> outf(ro.begin(), ro.end()), lsef(rl.begin(), rl.end());
    std::vector<float> dq(q.size(), NAN), dk(k.size(), NAN), dv(v.size(), NAN);
    js::SdpaBwdBuffers bio{q.data(), k.data(), v.data(), outf.data(), lsef.data(), dout.data(),
                           dq.data(), dk.data(), dv.data()};
    js::metal::Plan bplan;
    e = js::metal::plan_backward(p, bio, &bplan);
    if (e.empty()) e = js::metal::runner()->run(bplan);
    CHECK(e.empty(), "backward: %s", e.c_str());
    std::vector<double> rq(q.size()), rk(k.size()), rv(v.size());
    for (int b = 0; b < pr.B; ++b)
      for (int h = 0; h < pr.Hq; ++h)
        for (int i = 0; i < pr.Lq; ++i) {
          const int hk = h / G;
          const size_t row = (size_t(b) * pr.Hq + h) * pr.Lq + i;
          double delta = 0;
          for (int c = 0; c < pr.Dv; ++c) delta += double(dout[row * pr.Dv + c]) * outf[row * pr.Dv + c];
          for (int j = 0; j < pr.Lk; ++j) {
            const double pj = P[row * pr.Lk + j];
            if (pj == 0) continue;
            const size_t kr = (size_t(b) * pr.Hk + hk) * pr.Lk + j;
            double dp = 0;
            for (int c = 0; c < pr.Dv; ++c) dp += double(dout[row * pr.Dv + c]) * v[kr * pr.Dv + c];
            double ds = pj * (dp - delta);
            if (pr.cap > 0) ds *= 1.0 - TC[row * pr.Lk + j] * TC[row * pr.Lk + j];
            for (int c = 0; c < pr.D; ++c) {
              rq[row * pr.D + c] += p.scale * ds * k[kr * pr.D + c];
              rk[kr * pr.D + c] += p.scale * ds * q[row * pr.D + c];
            }
            for (int c = 0; c < pr.Dv; ++c) rv[kr * pr.Dv + c] += pj * dout[row * pr.Dv + c];
          }
        }
    for (size_t x = 0; x < rq.size(); ++x) eb = std::max(eb, std::abs(dq[x] - rq[x]));
    for (size_t x = 0; x < rk.size(); ++x) eb = std::max(eb, std::abs(dk[x] - rk[x]));
    for (size_t x = 0; x < rv.size(); ++x) eb = std::max(eb, std::abs(dv[x] - rv[x]));
    for (float x : dq) eb = std::isnan(x) ? INFINITY : eb;
    for (float x : dk) eb = std::isnan(x) ? INFINITY : eb;
    for (float x : dv) eb = std::isnan(x) ? INFINITY : eb;
  }
  const bool ok = eo < 1e-4 && el < 1e-4 && eb < 1e-3;  // NaN fails every comparison
  CHECK(ok, "attention B=%d Hq=%d Hk=%d Lq=%d Lk=%d D=%d Dv=%d: out %g lse %g bwd %g", pr.B,
        pr.Hq, pr.Hk, pr.Lq, pr.Lk, pr.D, pr.Dv, eo, el, eb);
  std::printf("%s attention B=%d Hq=%d Hk=%d Lq=%d Lk=%d D=%d Dv=%d causal=%d sinks=%d lengths=%d "
              "segments=%d cap=%g page=%d/%d %s splits=%d: out %.1e lse %.1e bwd %.1e "
              "(%d empty rows)\n",
              ok ? "ok  " : "FAIL", pr.B, pr.Hq, pr.Hk, pr.Lq, pr.Lk, pr.D, pr.Dv, pr.causal,
              pr.sinks, pr.lengths, pr.segments, pr.cap, pr.page_size, pr.kv_layout,
              kernel_ran.c_str(), pr.splits, eo, el, eb, empty_rows);
}

static void test_bfloat() {
  // Round to nearest even at the halfway points; NaN and infinities survive.
  const float in[] = {1.00390625f, 1.01171875f, -2.5f, 3.0e38f, 1.0e-40f, INFINITY};
  const float want[] = {1.0f, 1.015625f, -2.5f, 3.0040553e38f, 9.1835496e-41f, INFINITY};  // ml_dtypes
  for (int i = 0; i < 6; ++i) {
    const float got = float(bfloat(in[i]));
    CHECK(got == want[i] || std::abs(got - want[i]) <= 1e-6f * std::abs(want[i]),
          "bfloat(%g) = %g, want %g", in[i], got, want[i]);
  }
  CHECK(std::isnan(float(bfloat(NAN))), "bfloat(NaN) is not NaN");
  CHECK(float(half(1.0009765625f)) == 1.0009765625f && float(half(65520.0f)) == INFINITY,
        "half conversions");
}

int main() {
  test_bfloat();
  test_layout();
  test_simd();
  expect_error("t_div_barrier", "divergent threadgroup_barrier");
  expect_error("t_div_barrier2", "divergent threadgroup_barrier");
  expect_error("t_div_simd", "divergent simd op");
  expect_error("t_deadlock", "deadlock");
  expect_error("t_tg_too_big", "threadgroup memory");
  {
    std::vector<float> x(64, 0.0f);
    std::string e = launch1("t_tg_poison", 1, 64, {x.data()});
    CHECK(e.empty() && x[0] == 1.0f && std::isnan(x[40]),
          "unwritten threadgroup memory should read as NaN (%s)", e.c_str());
  }
  std::mt19937 rng(1234);
  const Problem problems[] = {
      {2, 4, 2, 13, 21, 64, 64, true, false, true, nullptr, 0},
      {1, 2, 1, 37, 29, 80, 80, false, true, false, nullptr, 0},
      {1, 2, 2, 9, 40, 96, 64, true, true, true, nullptr, 0},
      {1, 1, 1, 33, 17, 128, 128, true, false, false, nullptr, 0},
      {1, 2, 1, 5, 9, 256, 256, false, false, false, nullptr, 0},
      {1, 1, 1, 3, 11, 512, 512, true, true, false, "full", 0},
      {2, 8, 2, 1, 70, 64, 64, false, true, true, nullptr, 0},
      {1, 4, 1, 3, 53, 128, 96, true, false, true, "decode", 5},
      {1, 2, 1, 1, 45, 512, 512, false, true, false, nullptr, 3},
      {1, 2, 1, 2, 19, 256, 256, true, false, false, "decode", 0},
      // segment ids (sorted runs, unsorted ids), soft-capping, both together
      {2, 4, 2, 37, 37, 64, 64, true, false, true, nullptr, 0, 1},
      {1, 2, 1, 29, 41, 80, 64, false, true, false, "full", 0, 2},
      {2, 2, 1, 3, 53, 64, 64, false, true, true, nullptr, 0, 1},
      {1, 4, 2, 5, 45, 128, 128, true, false, false, "decode", 3, 2},
      {1, 2, 2, 21, 34, 64, 96, true, true, true, nullptr, 0, 0, 2.5},
      {1, 4, 1, 2, 40, 128, 128, false, false, false, nullptr, 4, 0, 1.0},
      {2, 2, 1, 33, 33, 64, 64, true, false, true, nullptr, 0, 1, 3.0},
      {1, 2, 1, 1, 30, 256, 256, false, true, false, nullptr, 0, 1, 5.0},
      // paged K/V (both layouts, decode and tiled, with segments-free calls only)
      {2, 4, 2, 1, 64, 64, 64, true, true, true, nullptr, 0, 0, 0.0, 8, 0},
      {2, 4, 2, 3, 48, 128, 64, true, false, true, nullptr, 3, 0, 0.0, 16, 1},
      {2, 2, 1, 17, 64, 64, 64, true, true, true, nullptr, 0, 0, 2.0, 16, 0},
      {1, 4, 4, 9, 96, 64, 64, false, false, true, "full", 0, 0, 0.0, 32, 1},
      {2, 8, 2, 4, 40, 64, 64, true, true, true, "decode", 2, 0, 4.0, 8, 1},
  };
  for (const Problem& pr : problems) test_attention(pr, rng);
  if (g_failures) {
    std::printf("%d check(s) FAILED\n", g_failures);
    return 1;
  }
  std::printf("all emulator self-tests passed\n");
  return 0;
}

// Standalone check + timing of the fast fp32 flash backward (cuda/flash_bwd_tc*.{h,cuh,cu}).
//
// Build and run from the repository root (H200, nvcc 13.0):
//   nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -I. benchmarks/flash_bwd_tc_selftest.cu cuda/flash_bwd_tc_f32.cu -o /tmp/flash_bwd_tc_selftest && /tmp/flash_bwd_tc_selftest
// Options: --no-bench (checks only), --no-check (timing only).
//
// Checks: dq/dk/dv vs a float64 CPU reference (out and lse also from the reference, as in
// benchmarks/gpu_flash_check.py) for GQA/MQA, causal top-left/bottom-right, windows, odd
// lengths, q/kv lengths (incl. 0), seq_major, bool/additive masks with empty rows, sinks,
// D 8..128 with Dv != D; both TF32 (tol 4e-3) and 3xTF32 "highest" (tol 2e-5), relative
// to max(1, max|ref|); outputs poisoned with NaN first. Unservable shapes (D=40/Dv=136,
// D=136, fp16) must return cudaErrorNotSupported.
// Timing: SD3 B2 H38 L4250 D64 fp32 (out/lse from the existing generic forward), fast
// backward (TF32, highest) vs the generic draft backward, median of 10 cudaEvent timings,
// TFLOP/s = 2.5 * 4*B*H*L^2*D / t; plus fwd+bwd at 3.5x, and the fast-vs-generic
// difference of the gradients at that size.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/flash_attention_bwd.cuh"  // generic forward + draft backward (baseline, SD3 out/lse)
#include "cuda/flash_bwd_tc.h"

using namespace jax_sdpa;
using namespace jax_sdpa::cuda_flash;

#define CK(...)                                                                 \
  do {                                                                          \
    const cudaError_t e_ = (__VA_ARGS__);                                       \
    if (e_ != cudaSuccess) {                                                    \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_),       \
                  __FILE__, __LINE__, #__VA_ARGS__);                            \
      std::exit(2);                                                             \
    }                                                                           \
  } while (0)

struct Case {
  std::string name;
  int B, Hq, Hk, Lq, Lk, D, Dv;
  int64_t wl = -1, wr = -1;
  bool br = false, seq_major = false;
  int mask = 0;  // 0 none, 1 bool [1, Hq, Lq, Lk] (rows i % 7 == 3 empty), 2 additive f32 [B, 1, Lq, Lk]
  std::vector<int> qlens, kvlens;
  bool sinks = false;
};

static int64_t idx4(int b, int h, int i, int c, int H, int L, int Dd, bool sm) {
  return sm ? ((int64_t(b) * L + i) * H + h) * Dd + c : ((int64_t(b) * H + h) * L + i) * Dd + c;
}

static void set_strides(int64_t (&s)[3], int H, int L, int Dd, bool sm) {
  if (sm) {
    s[0] = int64_t(L) * H * Dd;
    s[1] = Dd;
    s[2] = int64_t(H) * Dd;
  } else {
    s[0] = int64_t(H) * L * Dd;
    s[1] = int64_t(L) * Dd;
    s[2] = Dd;
  }
}

template <typename T>
static T* dev_copy(const std::vector<T>& h) {
  T* d = nullptr;
  CK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)));
  if (!h.empty()) CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

static double max_rel_err(const std::vector<float>& got, const std::vector<double>& ref) {
  double mx = 1.0, err = 0.0;
  for (double r : ref) mx = std::max(mx, std::fabs(r));
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::fabs(double(got[i]) - ref[i]);
    if (!(e <= err)) err = std::isnan(e) ? INFINITY : std::max(err, e);
  }
  return err / mx;
}

static bool run_case(const Case& c, std::mt19937& rng) {
  const int B = c.B, Hq = c.Hq, Hk = c.Hk, Lq = c.Lq, Lk = c.Lk, D = c.D, Dv = c.Dv;
  const int G = Hq / Hk;
  const bool sm = c.seq_major;
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  std::vector<float> q(size_t(B) * Hq * Lq * D), k(size_t(B) * Hk * Lk * D),
      v(size_t(B) * Hk * Lk * Dv), dout(size_t(B) * Hq * Lq * Dv);
  for (auto& x : q) x = nd(rng);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  for (auto& x : dout) x = nd(rng);
  std::vector<uint8_t> bmask;
  std::vector<float> amask;
  if (c.mask == 1) {
    bmask.resize(size_t(Hq) * Lq * Lk);
    for (int h = 0; h < Hq; ++h)
      for (int i = 0; i < Lq; ++i)
        for (int j = 0; j < Lk; ++j)
          bmask[(size_t(h) * Lq + i) * Lk + j] = (i % 7 != 3) && ud(rng) > 0.2f;
  } else if (c.mask == 2) {
    amask.resize(size_t(B) * Lq * Lk);
    for (auto& x : amask) x = ud(rng) < 0.1f ? -INFINITY : 2.f * ud(rng) - 1.f;
  }
  std::vector<float> sinks;
  if (c.sinks)
    for (int h = 0; h < Hq; ++h) sinks.push_back(nd(rng));
  const double scale = 1.0 / std::sqrt(double(D));

  // ---- float64 reference ----
  std::vector<float> out(dout.size()), lse(size_t(B) * Hq * Lq);
  std::vector<double> rdq(q.size(), 0.0), rdk(k.size(), 0.0), rdv(v.size(), 0.0);
  std::vector<double> s(Lk), p(Lk);
  std::vector<char> vis(Lk);
  for (int b = 0; b < B; ++b) {
    const int qlen = c.qlens.empty() ? Lq : std::clamp(c.qlens[b], 0, Lq);
    const int kvlen = c.kvlens.empty() ? Lk : std::clamp(c.kvlens[b], 0, Lk);
    const int64_t off = c.br ? kvlen - qlen : 0;
    for (int h = 0; h < Hq; ++h) {
      const int hk = h / G;
      for (int i = 0; i < Lq; ++i) {
        double mx = -INFINITY;
        for (int j = 0; j < Lk; ++j) {
          bool ok = i < qlen && j < kvlen;
          const int64_t d = int64_t(j) - (i + off);
          if (c.wl >= 0 && d < -c.wl) ok = false;
          if (c.wr >= 0 && d > c.wr) ok = false;
          double m = 0.0;
          if (c.mask == 1 && !bmask[(size_t(h) * Lq + i) * Lk + j]) ok = false;
          if (c.mask == 2) {
            m = amask[(size_t(b) * Lq + i) * Lk + j];
            if (m == -INFINITY) ok = false;
          }
          vis[j] = ok;
          if (!ok) continue;
          double dot = 0.0;
          for (int x = 0; x < D; ++x)
            dot += double(q[idx4(b, h, i, x, Hq, Lq, D, sm)]) * k[idx4(b, hk, j, x, Hk, Lk, D, sm)];
          s[j] = dot * scale + m;
          mx = std::max(mx, s[j]);
        }
        const bool has_sink = c.sinks && i < qlen;
        if (has_sink) mx = std::max(mx, double(sinks[h]));
        double l = -INFINITY;
        if (mx != -INFINITY) {
          double sum = has_sink ? std::exp(double(sinks[h]) - mx) : 0.0;
          for (int j = 0; j < Lk; ++j)
            if (vis[j]) sum += std::exp(s[j] - mx);
          l = sum > 0 ? mx + std::log(sum) : -INFINITY;
        }
        if (i >= qlen) l = -INFINITY;
        lse[(size_t(b) * Hq + h) * Lq + i] = float(l);
        for (int j = 0; j < Lk; ++j) p[j] = (vis[j] && l != -INFINITY) ? std::exp(s[j] - l) : 0.0;
        std::vector<double> o(Dv, 0.0);
        for (int j = 0; j < Lk; ++j)
          if (p[j] != 0.0)
            for (int x = 0; x < Dv; ++x) o[x] += p[j] * v[idx4(b, hk, j, x, Hk, Lk, Dv, sm)];
        double delta = 0.0;
        for (int x = 0; x < Dv; ++x) {
          const float of = float(o[x]);
          out[idx4(b, h, i, x, Hq, Lq, Dv, sm)] = of;
          delta += double(of) * dout[idx4(b, h, i, x, Hq, Lq, Dv, sm)];
        }
        for (int j = 0; j < Lk; ++j) {
          if (p[j] == 0.0) continue;
          double dp = 0.0;
          for (int x = 0; x < Dv; ++x)
            dp += double(dout[idx4(b, h, i, x, Hq, Lq, Dv, sm)]) * v[idx4(b, hk, j, x, Hk, Lk, Dv, sm)];
          const double ds = p[j] * (dp - delta);
          for (int x = 0; x < Dv; ++x)
            rdv[idx4(b, hk, j, x, Hk, Lk, Dv, sm)] += p[j] * dout[idx4(b, h, i, x, Hq, Lq, Dv, sm)];
          for (int x = 0; x < D; ++x) {
            rdq[idx4(b, h, i, x, Hq, Lq, D, sm)] += scale * ds * k[idx4(b, hk, j, x, Hk, Lk, D, sm)];
            rdk[idx4(b, hk, j, x, Hk, Lk, D, sm)] += scale * ds * q[idx4(b, h, i, x, Hq, Lq, D, sm)];
          }
        }
      }
    }
  }

  // ---- GPU ----
  SdpaParams P;
  P.batch = B;
  P.heads_q = Hq;
  P.heads_kv = Hk;
  P.len_q = Lq;
  P.len_kv = Lk;
  P.head_dim = D;
  P.head_dim_v = Dv;
  P.dtype = DType::kF32;
  P.seq_major = sm;
  set_strides(P.q_stride, Hq, Lq, D, sm);
  set_strides(P.k_stride, Hk, Lk, D, sm);
  set_strides(P.v_stride, Hk, Lk, Dv, sm);
  set_strides(P.o_stride, Hq, Lq, Dv, sm);
  P.scale = scale;
  P.window_left = c.wl;
  P.window_right = c.wr;
  P.bottom_right = c.br;
  float* d_q = dev_copy(q);
  float* d_k = dev_copy(k);
  float* d_v = dev_copy(v);
  float* d_out = dev_copy(out);
  float* d_dout = dev_copy(dout);
  float* d_lse = dev_copy(lse);
  uint8_t* d_bm = nullptr;
  float* d_am = nullptr;
  float* d_sinks = nullptr;
  int32_t *d_ql = nullptr, *d_kl = nullptr;
  if (c.mask == 1) {
    d_bm = dev_copy(bmask);
    P.mask_kind = MaskKind::kBool;
    P.mask = d_bm;
    P.mask_stride[0] = 0;
    P.mask_stride[1] = int64_t(Lq) * Lk;
    P.mask_stride[2] = Lk;
    P.mask_stride[3] = 1;
  } else if (c.mask == 2) {
    d_am = dev_copy(amask);
    P.mask_kind = MaskKind::kAdditive;
    P.mask_dtype = DType::kF32;
    P.mask = d_am;
    P.mask_stride[0] = int64_t(Lq) * Lk;
    P.mask_stride[1] = 0;
    P.mask_stride[2] = Lk;
    P.mask_stride[3] = 1;
  }
  if (c.sinks) {
    d_sinks = dev_copy(sinks);
    P.sinks = d_sinks;
    P.sinks_batch_stride = 0;
  }
  if (!c.qlens.empty()) {
    d_ql = dev_copy(std::vector<int32_t>(c.qlens.begin(), c.qlens.end()));
    P.q_lengths = d_ql;
  }
  if (!c.kvlens.empty()) {
    d_kl = dev_copy(std::vector<int32_t>(c.kvlens.begin(), c.kvlens.end()));
    P.kv_lengths = d_kl;
  }
  float *d_dq, *d_dk, *d_dv, *d_delta;
  CK(cudaMalloc(&d_dq, q.size() * 4));
  CK(cudaMalloc(&d_dk, k.size() * 4));
  CK(cudaMalloc(&d_dv, v.size() * 4));
  CK(cudaMalloc(&d_delta, std::max<size_t>(lse.size(), 1) * 4));
  SdpaBwdBuffers buf;
  buf.q = d_q;
  buf.k = d_k;
  buf.v = d_v;
  buf.out = d_out;
  buf.lse = d_lse;
  buf.dout = d_dout;
  buf.dq = d_dq;
  buf.dk = d_dk;
  buf.dv = d_dv;
  bool ok_all = true;
  for (int mode = 0; mode < 2; ++mode) {
    CK(cudaMemset(d_dq, 0xFF, q.size() * 4));
    CK(cudaMemset(d_dk, 0xFF, k.size() * 4));
    CK(cudaMemset(d_dv, 0xFF, v.size() * 4));
    const Fp32Mode fm = mode == 0 ? Fp32Mode::kTf32 : Fp32Mode::kHighest;
    const cudaError_t e = launch_backward_f32_fast(P, buf, fm, d_delta, 0);
    if (e != cudaSuccess) {
      std::printf("FAIL %-40s %s: launch returned %s\n", c.name.c_str(), mode ? "highest" : "tf32",
                  cudaGetErrorString(e));
      ok_all = false;
      continue;
    }
    CK(cudaDeviceSynchronize());
    std::vector<float> gdq(q.size()), gdk(k.size()), gdv(v.size());
    CK(cudaMemcpy(gdq.data(), d_dq, q.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gdk.data(), d_dk, k.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gdv.data(), d_dv, v.size() * 4, cudaMemcpyDeviceToHost));
    const double tol = mode == 0 ? 4e-3 : 2e-5;
    const double eq = max_rel_err(gdq, rdq), ek = max_rel_err(gdk, rdk), ev = max_rel_err(gdv, rdv);
    const bool ok = eq <= tol && ek <= tol && ev <= tol;
    std::printf("%s %-40s %-7s dq %.2e dk %.2e dv %.2e (tol %.0e)\n", ok ? "ok  " : "FAIL",
                c.name.c_str(), mode ? "highest" : "tf32", eq, ek, ev, tol);
    ok_all = ok_all && ok;
  }
  for (void* ptr : {(void*)d_q, (void*)d_k, (void*)d_v, (void*)d_out, (void*)d_dout, (void*)d_lse,
                    (void*)d_bm, (void*)d_am, (void*)d_sinks, (void*)d_ql, (void*)d_kl,
                    (void*)d_dq, (void*)d_dk, (void*)d_dv, (void*)d_delta})
    if (ptr) CK(cudaFree(ptr));
  return ok_all;
}

static bool check_refused(int D, int Dv, DType dt) {
  SdpaParams P;
  P.batch = 1;
  P.heads_q = P.heads_kv = 1;
  P.len_q = P.len_kv = 16;
  P.head_dim = D;
  P.head_dim_v = Dv;
  P.dtype = dt;
  set_strides(P.q_stride, 1, 16, D, false);
  set_strides(P.k_stride, 1, 16, D, false);
  set_strides(P.v_stride, 1, 16, Dv, false);
  set_strides(P.o_stride, 1, 16, Dv, false);
  SdpaBwdBuffers buf;  // null pointers: must be refused before touching anything
  const cudaError_t e = launch_backward_f32_fast(P, buf, Fp32Mode::kTf32, nullptr, 0);
  const bool ok = e == cudaErrorNotSupported && cudaGetLastError() == cudaSuccess;
  std::printf("%s refuses D=%d Dv=%d %s: %s\n", ok ? "ok  " : "FAIL", D, Dv, dtype_name(dt),
              cudaGetErrorString(e));
  return ok;
}

__global__ void fill_kernel(float* x, size_t n, uint32_t seed, float amp) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    x[i] = amp * (float(h) * (2.f / 4294967296.f) - 1.f);
  }
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename F>
static float time_ms(F&& f, int reps = 10) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) CK(f());
  CK(cudaDeviceSynchronize());
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    CK(f());
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return median(ts);
}

static double max_rel_diff_dev(const float* a, const float* b, size_t n) {
  std::vector<float> x(n), y(n);
  CK(cudaMemcpy(x.data(), a, n * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(y.data(), b, n * 4, cudaMemcpyDeviceToHost));
  double mx = 1.0, err = 0.0;
  for (size_t i = 0; i < n; ++i) mx = std::max(mx, std::fabs(double(y[i])));
  for (size_t i = 0; i < n; ++i) {
    const double e = std::fabs(double(x[i]) - y[i]);
    if (!(e <= err)) err = std::isnan(e) ? INFINITY : std::max(err, e);
  }
  return err / mx;
}

static void bench_sd3(bool causal) {
  const int B = 2, H = 38, L = 4250, D = 64;
  SdpaParams P;
  P.batch = B;
  P.heads_q = P.heads_kv = H;
  P.len_q = P.len_kv = L;
  P.head_dim = P.head_dim_v = D;
  P.dtype = DType::kF32;
  set_strides(P.q_stride, H, L, D, false);
  set_strides(P.k_stride, H, L, D, false);
  set_strides(P.v_stride, H, L, D, false);
  set_strides(P.o_stride, H, L, D, false);
  P.scale = 1.0 / std::sqrt(double(D));
  if (causal) {
    P.window_right = 0;
    P.bottom_right = true;
  }
  const size_t n = size_t(B) * H * L * D, nr = size_t(B) * H * L;
  float *q, *k, *v, *o, *dout, *lse, *delta, *dq, *dk, *dv, *dq2, *dk2, *dv2;
  for (float** p : {&q, &k, &v, &o, &dout, &dq, &dk, &dv, &dq2, &dk2, &dv2}) CK(cudaMalloc(p, n * 4));
  CK(cudaMalloc(&lse, nr * 4));
  CK(cudaMalloc(&delta, nr * 4));
  fill_kernel<<<1024, 256>>>(q, n, 1u, 1.7f);
  fill_kernel<<<1024, 256>>>(k, n, 2u, 1.7f);
  fill_kernel<<<1024, 256>>>(v, n, 3u, 1.7f);
  fill_kernel<<<1024, 256>>>(dout, n, 4u, 1.7f);
  CK(cudaGetLastError());
  SdpaFwdBuffers fb;
  fb.q = q;
  fb.k = k;
  fb.v = v;
  fb.out = o;
  fb.lse = lse;
  SdpaBwdBuffers bb;
  bb.q = q;
  bb.k = k;
  bb.v = v;
  bb.out = o;
  bb.lse = lse;
  bb.dout = dout;
  bb.dq = dq;
  bb.dk = dk;
  bb.dv = dv;
  SdpaBwdBuffers bb2 = bb;
  bb2.dq = dq2;
  bb2.dk = dk2;
  bb2.dv = dv2;
  const double unit = 4.0 * B * H * double(L) * L * D * (causal ? 0.5 : 1.0);
  const float t_fwd = time_ms([&] { return launch_fwd_t<float, 1, 64>(P, fb, 0); });
  const float t_fast = time_ms([&] { return launch_backward_f32_fast(P, bb, Fp32Mode::kTf32, delta, 0); });
  const float t_fast_hi =
      time_ms([&] { return launch_backward_f32_fast(P, bb2, Fp32Mode::kHighest, delta, 0); });
  const float t_gen = time_ms([&] { return launch_bwd_t<float, 1>(P, bb2, delta, 0); }, 3);
  std::printf("SD3 B2 H38 L4250 D64 fp32%s:\n", causal ? " causal (bottom-right)" : "");
  std::printf("  generic forward (tf32)      %8.3f ms  %6.1f TFLOP/s\n", t_fwd, unit / t_fwd * 1e-9);
  std::printf("  fast backward tf32          %8.3f ms  %6.1f TFLOP/s (2.5x)  fwd+bwd %6.1f TFLOP/s (3.5x)\n",
              t_fast, 2.5 * unit / t_fast * 1e-9, 3.5 * unit / (t_fwd + t_fast) * 1e-9);
  std::printf("  fast backward highest       %8.3f ms  %6.1f TFLOP/s (2.5x)\n", t_fast_hi,
              2.5 * unit / t_fast_hi * 1e-9);
  std::printf("  generic backward tf32       %8.3f ms  %6.1f TFLOP/s (2.5x)\n", t_gen,
              2.5 * unit / t_gen * 1e-9);
  // Same inputs: fast tf32 (dq, dk, dv) vs generic tf32 (dq2, ...), relative to max(1, |generic|).
  CK(launch_backward_f32_fast(P, bb, Fp32Mode::kTf32, delta, 0));
  CK(launch_bwd_t<float, 1>(P, bb2, delta, 0));
  CK(cudaDeviceSynchronize());
  std::printf("  fast vs generic (tf32): dq %.2e dk %.2e dv %.2e\n", max_rel_diff_dev(dq, dq2, n),
              max_rel_diff_dev(dk, dk2, n), max_rel_diff_dev(dv, dv2, n));
  for (float* p : {q, k, v, o, dout, dq, dk, dv, dq2, dk2, dv2, lse, delta}) CK(cudaFree(p));
}

int main(int argc, char** argv) {
  bool check = true, bench = true;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--no-bench")) bench = false;
    if (!std::strcmp(argv[i], "--no-check")) check = false;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d), opt-in smem per block %zu bytes\n", prop.name, prop.major,
              prop.minor, prop.sharedMemPerBlockOptin);
  bool ok = true;
  if (check) {
    std::mt19937 rng(1234);
    std::vector<Case> cases;
    cases.push_back({"basic D64", 1, 2, 2, 128, 128, 64, 64});
    {
      Case c{"gqa causal-br Lq130 Lk333 D64", 2, 4, 2, 130, 333, 64, 64};
      c.wr = 0;
      c.br = true;
      cases.push_back(c);
    }
    {
      Case c{"mqa causal-tl Lq130 Lk333 D128", 2, 4, 1, 130, 333, 128, 128};
      c.wr = 0;
      cases.push_back(c);
    }
    {
      Case c{"window seq_major lens D128/Dv64", 2, 3, 1, 200, 150, 128, 64};
      c.wl = 37;
      c.wr = 5;
      c.br = true;
      c.seq_major = true;
      c.qlens = {200, 77};
      c.kvlens = {150, 41};
      cases.push_back(c);
    }
    {
      Case c{"bool mask (empty rows) + sinks D64/Dv32", 2, 2, 1, 97, 260, 64, 32};
      c.mask = 1;
      c.sinks = true;
      cases.push_back(c);
    }
    {
      Case c{"additive mask -inf D32/Dv72", 1, 2, 2, 70, 129, 32, 72};
      c.mask = 2;
      cases.push_back(c);
    }
    cases.push_back({"tiny Lq1 Lk7 D8", 1, 1, 1, 1, 7, 8, 8});
    {
      Case c{"lengths 0 D64", 2, 2, 2, 64, 64, 64, 64};
      c.qlens = {0, 64};
      c.kvlens = {64, 0};
      cases.push_back(c);
    }
    {
      Case c{"Lq>Lk causal-br Lq300 Lk100 D64 seq_major", 1, 2, 2, 300, 100, 64, 64};
      c.wr = 0;
      c.br = true;
      c.seq_major = true;
      cases.push_back(c);
    }
    {
      Case c{"gqa causal-br L520 D128 sinks", 1, 4, 2, 520, 520, 128, 128};
      c.wr = 0;
      c.br = true;
      c.sinks = true;
      cases.push_back(c);
    }
    {
      Case c{"full tiles L384 D64 G3 window", 1, 3, 1, 384, 384, 64, 64};
      c.wl = 200;
      c.wr = 100;
      cases.push_back(c);
    }
    {
      Case c{"D96/Dv128 odd Lq257 Lk255", 2, 2, 2, 257, 255, 96, 128};
      cases.push_back(c);
    }
    for (const Case& c : cases) ok = run_case(c, rng) && ok;
    ok = check_refused(40, 136, DType::kF32) && ok;
    ok = check_refused(136, 64, DType::kF32) && ok;
    ok = check_refused(64, 64, DType::kF16) && ok;
    std::printf("%s\n", ok ? "ALL CHECKS PASSED" : "SOME CHECKS FAILED");
  }
  if (bench) {
    bench_sd3(false);
    bench_sd3(true);
  }
  return ok ? 0 : 1;
}

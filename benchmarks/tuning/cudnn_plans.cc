// Every execution plan cuDNN offers for one SDPA graph, each timed on its own: whether the
// heuristic's first choice (what jax_sdpa's cuDNN path runs) is the fastest, and what the
// forward's softmax stats cost. A tuning tool, not part of the package: a tuning build
// (-DJAX_SDPA_TUNING=ON, cuda/CMakeLists.txt) builds it as build/<wheel tag>/cuda/cudnn_plans,
// and `bash benchmarks/tuning/run.sh cudnn_plans` runs it on the D128 training rows.
//
//   cudnn_plans B H L D causal(0|1) [reps]       -> one JSON line per (direction, stats, plan)
//
// Layout [B, L, H, D] (the jax.nn entry's), bf16, scale 1/sqrt(D), causal top-left.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <cudnn_frontend.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

namespace fe = cudnn_frontend;

#define CHECK_CUDA(x)                                                              \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kScale, kDO, kDQ, kDK, kDV };

struct Shape {
  int64_t b, h, l, d;
  bool causal;
  std::vector<int64_t> dims() const { return {b, h, l, d}; }
  std::vector<int64_t> strides() const { return {l * h * d, d, h * d, 1}; }  // [B, L, H, D]
};

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& g, const char* name,
                                                    Uid uid, const Shape& s) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(
      s.dims()).set_stride(s.strides()));
}

std::shared_ptr<fe::graph::Tensor_attributes> scale_tensor(fe::graph::Graph& g) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name("scale")
                      .set_uid(kScale)
                      .set_dim({1, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_is_pass_by_value(true)
                      .set_data_type(fe::DataType_t::FLOAT));
}

std::shared_ptr<fe::graph::Graph> new_graph() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

std::shared_ptr<fe::graph::Graph> forward(const Shape& s, bool stats) {
  auto g = new_graph();
  auto q = input(*g, "Q", kQ, s), k = input(*g, "K", kK, s), v = input(*g, "V", kV, s);
  auto a = fe::graph::SDPA_attributes().set_name("fwd").set_generate_stats(stats).set_attn_scale(
      scale_tensor(*g));
  if (s.causal)
    a.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
  auto [o, st] = g->sdpa(q, k, v, a);
  o->set_output(true).set_uid(kO).set_dim(s.dims()).set_stride(s.strides());
  if (stats)
    st->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim(
        {s.b, s.h, s.l, 1}).set_stride({s.h * s.l, s.l, 1, 1});
  return g;
}

std::shared_ptr<fe::graph::Graph> backward(const Shape& s) {
  auto g = new_graph();
  auto q = input(*g, "Q", kQ, s), k = input(*g, "K", kK, s), v = input(*g, "V", kV, s);
  auto o = input(*g, "O", kO, s), d_o = input(*g, "dO", kDO, s);
  auto st = g->tensor(fe::graph::Tensor_attributes()
                          .set_name("stats")
                          .set_uid(kStats)
                          .set_dim({s.b, s.h, s.l, 1})
                          .set_stride({s.h * s.l, s.l, 1, 1})
                          .set_data_type(fe::DataType_t::FLOAT));
  auto a = fe::graph::SDPA_backward_attributes().set_name("bwd").set_attn_scale(scale_tensor(*g));
  if (s.causal)
    a.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, st, a);
  for (auto [t, uid] : {std::pair{dq, kDQ}, {dk, kDK}, {dv, kDV}})
    t->set_output(true).set_uid(uid).set_dim(s.dims()).set_stride(s.strides());
  return g;
}

void* device_random(size_t n, std::mt19937& rng, float sd) {
  std::normal_distribution<float> dist(0.f, sd);
  std::vector<__nv_bfloat16> h(n);
  for (auto& x : h) x = __float2bfloat16(dist(rng));
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, n * 2));
  CHECK_CUDA(cudaMemcpy(p, h.data(), n * 2, cudaMemcpyHostToDevice));
  return p;
}

// Builds every plan heuristics A and B offer, then times each; prints one JSON line a plan.
void time_plans(cudnnHandle_t handle, fe::graph::Graph& g, const char* what, const Shape& s,
                std::unordered_map<int64_t, void*>& pack, double flop, int reps) {
  auto report_fail = [&](const char* stage, fe::error_t e) {
    std::printf("{\"what\": \"%s\", \"error\": \"%s: %s\"}\n", what, stage,
                e.get_message().c_str());
  };
  if (auto e = g.validate(); !e.is_good()) return report_fail("validate", e);
  if (auto e = g.build_operation_graph(handle); !e.is_good()) return report_fail("op graph", e);
  if (auto e = g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::B});
      !e.is_good())
    return report_fail("plans", e);
  if (auto e = g.check_support(handle); !e.is_good()) return report_fail("support", e);
  if (auto e = g.build_plans(handle, fe::BuildPlanPolicy_t::ALL); !e.is_good())
    return report_fail("build", e);
  const int64_t count = g.get_execution_plan_count();
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int64_t i = 0; i < count; ++i) {
    std::string name;
    (void)g.get_plan_name_at_index(i, name);
    int64_t ws = 0;
    if (auto e = g.get_workspace_size_plan_at_index(i, ws); !e.is_good()) continue;
    void* workspace = nullptr;
    if (ws > 0) CHECK_CUDA(cudaMalloc(&workspace, ws));
    bool ok = true;
    for (int w = 0; w < 2 && ok; ++w)
      ok = g.execute_plan_at_index(handle, pack, workspace, i).is_good();
    float ms = 0.f;
    if (ok) {
      CHECK_CUDA(cudaEventRecord(start));
      for (int r = 0; r < reps; ++r) (void)g.execute_plan_at_index(handle, pack, workspace, i);
      CHECK_CUDA(cudaEventRecord(stop));
      CHECK_CUDA(cudaEventSynchronize(stop));
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      ms /= reps;
    }
    std::printf(
        "{\"what\": \"%s\", \"B\": %ld, \"H\": %ld, \"L\": %ld, \"D\": %ld, \"causal\": %d, "
        "\"plan\": %ld, \"name\": \"%s\", \"workspace\": %ld, \"ok\": %d, \"ms\": %.4f, "
        "\"TFLOP/s\": %.1f}\n",
        what, (long)s.b, (long)s.h, (long)s.l, (long)s.d, (int)s.causal, (long)i, name.c_str(),
        (long)ws, (int)ok, ms, ok ? flop / (ms * 1e-3) / 1e12 : 0.0);
    std::fflush(stdout);
    if (workspace) CHECK_CUDA(cudaFree(workspace));
  }
}

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s B H L D causal [reps]\n", argv[0]);
    return 2;
  }
  Shape s{std::atol(argv[1]), std::atol(argv[2]), std::atol(argv[3]), std::atol(argv[4]),
          std::atoi(argv[5]) != 0};
  const int reps = argc > 6 ? std::atoi(argv[6]) : 20;
  cudnnHandle_t handle;
  if (cudnnCreate(&handle) != CUDNN_STATUS_SUCCESS) return 1;
  std::mt19937 rng(0);
  const size_t n = static_cast<size_t>(s.b * s.h * s.l * s.d);
  void *q = device_random(n, rng, 1.f), *k = device_random(n, rng, 1.f),
       *v = device_random(n, rng, 1.f), *d_o = device_random(n, rng, 1.f);
  void *o, *dq, *dk, *dv, *stats;
  for (void** p : {&o, &dq, &dk, &dv}) CHECK_CUDA(cudaMalloc(p, n * 2));
  CHECK_CUDA(cudaMalloc(&stats, s.b * s.h * s.l * sizeof(float)));
  float scale = 1.f / std::sqrt(static_cast<float>(s.d));
  const double flop = 4.0 * s.b * s.h * s.l * s.l * s.d * (s.causal ? 0.5 : 1.0);
  std::printf("{\"cudnn\": %zu, \"frontend\": %d}\n", cudnnGetVersion(), CUDNN_FRONTEND_VERSION);
  for (bool with_stats : {true, false}) {
    auto g = forward(s, with_stats);
    std::unordered_map<int64_t, void*> pack = {{kQ, q}, {kK, k}, {kV, v}, {kScale, &scale},
                                               {kO, o}};
    if (with_stats) pack[kStats] = stats;
    time_plans(handle, *g, with_stats ? "fwd+stats" : "fwd", s, pack, flop, reps);
  }
  auto g = backward(s);
  std::unordered_map<int64_t, void*> pack = {{kQ, q},   {kK, k},     {kV, v},    {kO, o},
                                             {kDO, d_o}, {kStats, stats}, {kScale, &scale},
                                             {kDQ, dq}, {kDK, dk},   {kDV, dv}};
  time_plans(handle, *g, "bwd", s, pack, 2.5 * flop, reps);
  return 0;
}

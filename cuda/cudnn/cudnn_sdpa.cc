// cuDNN SDPA graphs (cudnn-frontend) for the jax_sdpa kernel contract.
//
// One graph per (device, direction, dtype, shapes, strides, mask/bias form,
// window, lengths, sinks), built on first use and kept in a thread-safe LRU.
// Per call: a cache lookup, scratch from the caller's Scratch (the FFI targets' workspace
// result, sized by scratch_bytes at lowering), cudnnSetStream + execute under the device's
// lock, and (only where rows can be empty or padded) one small fix-up kernel. No host
// synchronization; stream work only, so XLA may capture it into a CUDA graph.
//
// How the contract maps onto cuDNN:
// - layouts are strides of the [B, H, L, D] views cuDNN wants: no transposes;
// - window_right -> diagonal_band_right_bound, window_left -> left_bound =
//   window_left + 1 (cuDNN keeps keys with col + left_bound > row), alignment
//   TOP_LEFT / BOTTOM_RIGHT; with lengths cuDNN aligns on the real lengths,
//   as the contract does;
// - q/kv lengths -> padding mask with seq_len tensors (clamped copies);
// - bool masks and broadcast or other-dtype additive masks become a dense bias
//   [mB, mH, Lq, Lk] in the io dtype (bool false -> -inf); b/h broadcast stays;
// - logits_soft_cap -> cuDNN's score modifier (a flexible graph): c * tanh(s / c) on the
//   scaled scores, then the band (cuDNN takes no built-in mask beside a modifier, so the
//   modifier applies it with the frontend's own mask builder), then the bias: cap before
//   the additive mask, as the contract orders them. Not with q/kv lengths (see
//   unsupported_reason);
// - sinks -> SINK_TOKEN [sB, Hq, 1, 1] (cuDNN adds exp(sink) to the softmax sum
//   unscaled, as the contract wants); the backward needs no sinks because the
//   stats already include them;
// - rows with nothing to attend and padded query rows are set to out = 0,
//   lse = -inf after the forward; the backward gets stats with -inf replaced by
//   FLT_MAX (P = 0 there) and zeroes gradient rows past the lengths.
#include "cuda/cudnn/cudnn_sdpa.h"

#include <cudnn.h>
#include <cudnn_frontend.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "ffi/tuning_knobs.h"
#include "cuda/cudnn/cudnn_kernels.h"

namespace jax_sdpa::cudnn {
namespace fe = cudnn_frontend;

namespace {

// Tensor uids in the variant pack.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kBias, kSeqQ, kSeqKv, kSink, kDO, kDQ, kDK, kDV
};

int env_int(const char* name, int fallback) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return fallback;
  char* end = nullptr;
  long v = std::strtol(s, &end, 10);
  return (end != s && v >= 0) ? static_cast<int>(v) : fallback;
}

// JAX_SDPA_CUDNN_RAW=1 (debugging only) skips the contract fix-ups, to see what
// cuDNN itself writes for padded or empty rows.
bool raw_mode() {
  static const bool raw = tuning_knob("JAX_SDPA_CUDNN_RAW") != nullptr &&
                         env_int("JAX_SDPA_CUDNN_RAW", 0) != 0;
  return raw;
}

std::string shape_str(const SdpaParams& p) {
  std::ostringstream s;
  s << "B=" << p.batch << " Hq=" << p.heads_q << " Hk=" << p.heads_kv << " Lq=" << p.len_q
    << " Lk=" << p.len_kv << " D=" << p.head_dim << " Dv=" << p.head_dim_v << " "
    << dtype_name(p.dtype) << (p.seq_major ? " [B,L,H,D]" : " [B,H,L,D]");
  return s.str();
}

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Error(Status::kInternal, std::string("jax_sdpa cuDNN: ") + what + ": " +
                                              cudaGetErrorString(e));
}

// ---- what a call asks of cuDNN, canonicalized ---------------------------------

struct Spec {
  bool backward = false;
  int device = 0;
  int64_t left_bound = -1;   // cuDNN's (window_left + 1); -1: none
  int64_t right_bound = -1;  // -1: none
  bool bottom_right = false;
  bool padding = false;      // seq_len tensors + padding mask
  bool bias = false;
  bool bias_direct = false;  // the mask buffer itself is the bias (no conversion)
  int64_t bias_b = 1, bias_h = 1;
  bool sinks = false;
  int64_t sinks_b = 1;
  bool fix_rows = false;     // rows may be padded or have no visible key
  bool stats = true;         // the forward writes its softmax stats (lse)
  double soft_cap = 0.0;     // > 0: the scores are soft-capped by a score modifier

  std::vector<int64_t> key(const SdpaParams& p) const {
    int64_t cap_bits = 0;
    std::memcpy(&cap_bits, &soft_cap, sizeof cap_bits);
    std::vector<int64_t> k = {backward, device, static_cast<int64_t>(p.dtype), p.batch,
                              p.heads_q, p.heads_kv, p.len_q, p.len_kv, p.head_dim,
                              p.head_dim_v, left_bound, right_bound, bottom_right, padding,
                              bias, bias_b, bias_h, sinks, sinks_b, stats, cap_bits};
    for (const int64_t* s : {p.q_stride, p.k_stride, p.v_stride, p.o_stride})
      k.insert(k.end(), s, s + 3);
    return k;
  }
};

// Does the band exclude any key? A bound at or beyond Lq + Lk never does (it is dropped).
bool band_bounded(const SdpaParams& p) {
  const int64_t reach = p.len_q + p.len_kv;
  return (p.window_left >= 0 && p.window_left < reach) ||
         (p.window_right >= 0 && p.window_right < reach);
}

// Can some query row see no key, with the static lengths (no q/kv lengths)?
bool band_can_be_empty(const SdpaParams& p) {
  if (p.len_kv == 0) return true;
  const int64_t offset = diagonal_offset(p.bottom_right, p.len_q, p.len_kv);
  for (int64_t i : {int64_t{0}, p.len_q - 1}) {  // the band's ends move monotonically with i
    KeyRange r = band_keys(i, offset, p.window_left, p.window_right, p.len_kv);
    if (r.last <= r.first) return true;
  }
  return false;
}

}  // namespace

bool bottom_right_aligned(const SdpaParams& p, bool has_lengths) {
  // Alignment only matters for a band, and not when Lq == Lk without lengths (then both
  // alignments are the same diagonal; TOP_LEFT is the one cuDNN combines with everything,
  // bias included).
  return band_bounded(p) && p.bottom_right && (has_lengths || p.len_q != p.len_kv);
}

std::string unsupported_reason(const SdpaParams& p, bool has_lengths, bool per_batch_sinks) {
  // The score modifier's padding mask (the frontend's, on the seq_len tensors) gave wrong
  // outputs with kv lengths on the H200 (cuDNN 9.19, B3 Lq64 Lk190 causal: max relative
  // error 0.88): soft-capped calls with lengths are left to the other implementations.
  if (p.logits_soft_cap > 0 && has_lengths)
    return "our cuDNN graphs don't combine logits_soft_cap with q/kv lengths";
  // cuDNN's SINK_TOKEN is one logit per head: a [B, Hq, 1, 1] tensor built and ran on
  // cuDNN 9.19 but gave wrong outputs (H200 test).
  if (per_batch_sinks && p.batch > 1)
    return "cuDNN takes one sink logit per head; per-batch sinks [B, Hq] are not supported";
  return "";
}

namespace {

Spec make_spec(const SdpaParams& p, int device, bool backward, bool lse_wanted = true) {
  Spec s;
  s.backward = backward;
  s.device = device;
  const bool lengths = p.q_lengths != nullptr || p.kv_lengths != nullptr;
  // A bound at or beyond Lq + Lk never excludes a key: drop it.
  const int64_t reach = p.len_q + p.len_kv;
  if (p.window_left >= 0 && p.window_left < reach) s.left_bound = p.window_left + 1;
  if (p.window_right >= 0 && p.window_right < reach) s.right_bound = p.window_right;
  s.bottom_right = bottom_right_aligned(p, lengths);
  s.soft_cap = p.logits_soft_cap > 0 ? p.logits_soft_cap : 0.0;
  // cuDNN's built-in band wants the padding mode for Lq > Lk (and lengths do); a score
  // modifier's band, built from the static lengths, does not (and takes no lengths).
  s.padding = lengths || (s.soft_cap == 0.0 && band_bounded(p) && p.len_q > p.len_kv);
  if (p.mask_kind != MaskKind::kNone) {
    s.bias = true;
    s.bias_b = p.mask_stride[0] == 0 ? 1 : p.batch;
    s.bias_h = p.mask_stride[1] == 0 ? 1 : p.heads_q;
    const bool full_q = p.mask_stride[2] != 0 || p.len_q == 1;
    const bool full_k = p.mask_stride[3] != 0 || p.len_kv == 1;
    s.bias_direct = p.mask_kind == MaskKind::kAdditive && p.mask_dtype == p.dtype && full_q &&
                    full_k;
  }
  if (!backward && p.sinks != nullptr) {
    s.sinks = true;
    s.sinks_b = p.sinks_batch_stride == 0 ? 1 : p.batch;
  }
  s.fix_rows = lengths || p.mask_kind != MaskKind::kNone || band_can_be_empty(p);
  // Stats cost the forward up to 2% (H200 D64, results/h200/cudnn_plans.jsonl); the row
  // fix-up reads them.
  s.stats = backward || lse_wanted || s.fix_rows;
  return s;
}

// ---- graphs ---------------------------------------------------------------------

struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
};

fe::DataType_t fe_type(DType t) {
  switch (t) {
    case DType::kF16: return fe::DataType_t::HALF;
    case DType::kBF16: return fe::DataType_t::BFLOAT16;
    default: return fe::DataType_t::FLOAT;
  }
}

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

TensorPtr bhld_tensor(fe::graph::Graph& g, const char* name, Uid uid, int64_t b, int64_t h,
                      int64_t l, int64_t d, const int64_t stride[3]) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({b, h, l, d})
                      .set_stride({stride[0], stride[1], stride[2], 1}));
}

void set_output_bhld(const TensorPtr& t, Uid uid, int64_t b, int64_t h, int64_t l, int64_t d,
                     const int64_t stride[3]) {
  t->set_output(true).set_uid(uid).set_dim({b, h, l, d}).set_stride(
      {stride[0], stride[1], stride[2], 1});
}

// The inputs shared by the forward and backward graphs.
struct CommonInputs {
  TensorPtr q, k, v, scale, bias, seq_q, seq_kv;
};

CommonInputs add_common_inputs(fe::graph::Graph& g, const SdpaParams& p, const Spec& s) {
  CommonInputs in;
  in.q = bhld_tensor(g, "Q", kQ, p.batch, p.heads_q, p.len_q, p.head_dim, p.q_stride);
  in.k = bhld_tensor(g, "K", kK, p.batch, p.heads_kv, p.len_kv, p.head_dim, p.k_stride);
  in.v = bhld_tensor(g, "V", kV, p.batch, p.heads_kv, p.len_kv, p.head_dim_v, p.v_stride);
  in.scale = g.tensor(fe::graph::Tensor_attributes()
                          .set_name("attn_scale")
                          .set_uid(kScale)
                          .set_dim({1, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_is_pass_by_value(true)
                          .set_data_type(fe::DataType_t::FLOAT));
  if (s.bias) {
    const int64_t lq = p.len_q, lk = p.len_kv;
    in.bias = g.tensor(fe::graph::Tensor_attributes()
                           .set_name("bias")
                           .set_uid(kBias)
                           .set_dim({s.bias_b, s.bias_h, lq, lk})
                           .set_stride({s.bias_h * lq * lk, lq * lk, lk, 1})
                           .set_data_type(fe_type(p.dtype)));
  }
  if (s.padding) {
    auto seq = [&](const char* name, Uid uid) {
      return g.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({p.batch, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_data_type(fe::DataType_t::INT32));
    };
    in.seq_q = seq("seq_len_q", kSeqQ);
    in.seq_kv = seq("seq_len_kv", kSeqKv);
  }
  return in;
}

namespace mods = fe::graph::attn::score_modifiers;

std::optional<int64_t> bound(int64_t b) {
  return b >= 0 ? std::optional<int64_t>(b) : std::nullopt;
}

template <typename Attributes>
void set_masking(Attributes& a, fe::graph::Graph& g, const SdpaParams& p,
                 const CommonInputs& in, const Spec& s) {
  a.set_attn_scale(in.scale);
  if (s.bias) a.set_bias(in.bias);
  const auto alignment =
      s.bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT : fe::DiagonalAlignment_t::TOP_LEFT;
  if (s.soft_cap > 0) {
    auto cap = g.tensor(static_cast<float>(s.soft_cap));
    auto softcap = std::make_shared<mods::Softcap>();  // keeps s / c for the backward's dtanh
    const int64_t lq = p.len_q, lk = p.len_kv;
    a.set_score_mod([=](std::shared_ptr<fe::graph::Graph> sub, TensorPtr score) {
      TensorPtr x = softcap->forward(sub, score, cap);
      if (s.left_bound >= 0 || s.right_bound >= 0)
        x = mods::sliding_window_mask(sub, x, alignment, bound(s.left_bound),
                                      bound(s.right_bound), lq, lk, nullptr, nullptr, nullptr,
                                      nullptr);
      return x;
    });
    if constexpr (std::is_same_v<Attributes, fe::graph::SDPA_backward_attributes>)
      a.set_score_mod_bprop([=](std::shared_ptr<fe::graph::Graph> sub, TensorPtr grad) {
        return softcap->backward(sub, grad, cap);
      });
    return;
  }
  if (s.padding) a.set_padding_mask(true).set_seq_len_q(in.seq_q).set_seq_len_kv(in.seq_kv);
  if (s.left_bound >= 0 || s.right_bound >= 0) {
    a.set_diagonal_alignment(alignment);
    if (s.left_bound >= 0) a.set_diagonal_band_left_bound(static_cast<int>(s.left_bound));
    if (s.right_bound >= 0) a.set_diagonal_band_right_bound(static_cast<int>(s.right_bound));
  }
}

std::shared_ptr<fe::graph::Graph> describe_forward(const SdpaParams& p, const Spec& s) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe_type(p.dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  CommonInputs in = add_common_inputs(*g, p, s);
  auto attrs =
      fe::graph::SDPA_attributes().set_name("jax_sdpa_fwd").set_generate_stats(s.stats);
  set_masking(attrs, *g, p, in, s);
  if (s.sinks) {
    attrs.set_sink_token(g->tensor(fe::graph::Tensor_attributes()
                                       .set_name("sinks")
                                       .set_uid(kSink)
                                       .set_dim({s.sinks_b, p.heads_q, 1, 1})
                                       .set_stride({p.heads_q, 1, 1, 1})
                                       .set_data_type(fe::DataType_t::FLOAT)));
  }
  auto [o, stats] = g->sdpa(in.q, in.k, in.v, attrs);
  set_output_bhld(o, kO, p.batch, p.heads_q, p.len_q, p.head_dim_v, p.o_stride);
  if (s.stats)
    stats->set_output(true)
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim({p.batch, p.heads_q, p.len_q, 1})
        .set_stride({p.heads_q * p.len_q, p.len_q, 1, 1});
  return g;
}

std::shared_ptr<fe::graph::Graph> describe_backward(const SdpaParams& p, const Spec& s) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe_type(p.dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  CommonInputs in = add_common_inputs(*g, p, s);
  auto o = bhld_tensor(*g, "O", kO, p.batch, p.heads_q, p.len_q, p.head_dim_v, p.o_stride);
  auto dout = bhld_tensor(*g, "dO", kDO, p.batch, p.heads_q, p.len_q, p.head_dim_v, p.o_stride);
  auto stats = g->tensor(fe::graph::Tensor_attributes()
                             .set_name("stats")
                             .set_uid(kStats)
                             .set_dim({p.batch, p.heads_q, p.len_q, 1})
                             .set_stride({p.heads_q * p.len_q, p.len_q, 1, 1})
                             .set_data_type(fe::DataType_t::FLOAT));
  auto attrs = fe::graph::SDPA_backward_attributes().set_name("jax_sdpa_bwd");
  set_masking(attrs, *g, p, in, s);
  auto [dq, dk, dv] = g->sdpa_backward(in.q, in.k, in.v, o, dout, stats, attrs);
  set_output_bhld(dq, kDQ, p.batch, p.heads_q, p.len_q, p.head_dim, p.q_stride);
  set_output_bhld(dk, kDK, p.batch, p.heads_kv, p.len_kv, p.head_dim, p.k_stride);
  set_output_bhld(dv, kDV, p.batch, p.heads_kv, p.len_kv, p.head_dim_v, p.v_stride);
  return g;
}

std::string describe_spec(const SdpaParams& p, const Spec& s) {
  std::ostringstream m;
  m << (s.backward ? "backward" : "forward") << " " << shape_str(p);
  if (s.right_bound >= 0 || s.left_bound >= 0)
    m << " window(left=" << p.window_left << ", right=" << p.window_right
      << (s.bottom_right ? ", bottom-right" : ", top-left") << ")";
  if (s.padding) m << " padding-mask";
  if (s.bias) m << " bias[" << s.bias_b << "," << s.bias_h << ",Lq,Lk]";
  if (s.sinks) m << " sinks[" << s.sinks_b << ",Hq]";
  if (!s.backward && !s.stats) m << " no-stats";
  if (s.soft_cap > 0) m << " soft-cap " << s.soft_cap;
  return m.str();
}

// Builds and checks a graph. Rejections by cuDNN's own support checks become
// kUnimplemented with cuDNN's message.
Status build_plan(cudnnHandle_t handle, const SdpaParams& p, const Spec& s,
                  std::shared_ptr<Plan>* out) {
  auto plan = std::make_shared<Plan>();
  plan->graph = s.backward ? describe_backward(p, s) : describe_forward(p, s);
  fe::graph::Graph& g = *plan->graph;
  auto fail = [&](Status::Code code, const char* stage, fe::error_t e) {
    std::ostringstream m;
    m << "jax_sdpa: cuDNN " << runtime_version() << " can't serve this attention call ("
      << describe_spec(p, s) << "): " << stage << ": " << e.get_message();
    return Status::Error(code, m.str());
  };
  if (auto e = g.validate(); !e.is_good())
    return fail(Status::kUnimplemented, "graph validation", e);
  if (auto e = g.build_operation_graph(handle); !e.is_good())
    return fail(Status::kUnimplemented, "operation graph", e);
  if (auto e = g.create_execution_plans({fe::HeurMode_t::A}); !e.is_good())
    return fail(Status::kUnimplemented, "execution plans", e);
  if (auto e = g.check_support(handle); !e.is_good())
    return fail(Status::kUnimplemented, "support check", e);
  if (auto e = g.build_plans(handle); !e.is_good())
    return fail(Status::kInternal, "plan build", e);
  int64_t ws = 0;
  if (auto e = g.get_workspace_size(ws); !e.is_good())
    return fail(Status::kInternal, "workspace size", e);
  plan->workspace = ws;
  *out = std::move(plan);
  return Status::Ok();
}

// ---- per-device handles and the graph cache --------------------------------------

// While XLA captures a call into a CUDA graph, the capturing thread may not make calls that
// could synchronize (cudnnCreate, loading a plan's kernels). A plan missing from the cache at
// capture (a device other than the one the call was lowered on) is built in relaxed mode:
// none of that work is stream work, so nothing of it enters the graph.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

struct DeviceState {
  std::mutex mu;  // serializes cudnnSetStream + execute (and builds) on the handle
  cudnnHandle_t handle = nullptr;
};

class GraphCache {
 public:
  using Key = std::vector<int64_t>;

  explicit GraphCache(size_t capacity) : capacity_(capacity) {}

  std::shared_ptr<Plan> find(const Key& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);  // most recently used first
    return it->second->second;
  }

  void insert(const Key& key, std::shared_ptr<Plan> plan) {
    std::lock_guard<std::mutex> lock(mu_);
    if (capacity_ == 0) return;
    auto it = index_.find(key);
    if (it != index_.end()) {
      it->second->second = std::move(plan);
      order_.splice(order_.begin(), order_, it->second);
      return;
    }
    order_.emplace_front(key, std::move(plan));
    index_[key] = order_.begin();
    while (order_.size() > capacity_) {  // plans in use stay alive via shared_ptr
      index_.erase(order_.back().first);
      order_.pop_back();
    }
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return order_.size();
  }
  size_t capacity() const { return capacity_; }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    index_.clear();
    order_.clear();
  }

 private:
  std::mutex mu_;
  size_t capacity_;
  std::list<std::pair<Key, std::shared_ptr<Plan>>> order_;
  std::map<Key, std::list<std::pair<Key, std::shared_ptr<Plan>>>::iterator> index_;
};

GraphCache& graph_cache() {
  static GraphCache* cache = new GraphCache(env_int("JAX_SDPA_CUDNN_CACHE_SIZE", 256));
  return *cache;  // leaked on purpose: no teardown-order issues at exit
}

Status device_state(int device, DeviceState** out) {
  static std::mutex mu;
  static auto* states = new std::map<int, std::unique_ptr<DeviceState>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& st = (*states)[device];
  if (!st) {
    RelaxedCapture relaxed;
    auto fresh = std::make_unique<DeviceState>();
    cudnnStatus_t rc = cudnnCreate(&fresh->handle);  // on the current device
    if (rc != CUDNN_STATUS_SUCCESS)
      return Status::Error(Status::kInternal, std::string("jax_sdpa: cudnnCreate failed: ") +
                                                  cudnnGetErrorString(rc));
    st = std::move(fresh);
  }
  *out = st.get();
  return Status::Ok();
}

// The cached plan for this call, building it (under the device lock) on a miss.
Status get_plan(const SdpaParams& p, const Spec& s, DeviceState* dev,
                std::shared_ptr<Plan>* plan) {
  const GraphCache::Key key = s.key(p);
  if ((*plan = graph_cache().find(key))) return Status::Ok();
  std::lock_guard<std::mutex> lock(dev->mu);
  if ((*plan = graph_cache().find(key))) return Status::Ok();  // built meanwhile
  RelaxedCapture relaxed;  // the build loads kernels, which a capturing thread may not
  Status st = build_plan(dev->handle, p, s, plan);
  if (!st.ok()) return st;
  graph_cache().insert(key, *plan);
  return Status::Ok();
}

Status allocate(Scratch& scratch, size_t bytes, void** ptr, const char* what) {
  *ptr = nullptr;
  if (bytes == 0) return Status::Ok();
  // XLA's FFI allocator accepts alignments up to 16; its BFC allocator hands out
  // 256-byte aligned blocks anyway, which is what cuDNN wants.
  *ptr = scratch.allocate(bytes, 16);
  if (*ptr == nullptr)
    return Status::Error(Status::kResourceExhausted,
                         std::string("jax_sdpa cuDNN: could not allocate ") +
                             std::to_string(bytes) + " bytes of scratch for the " + what);
  return Status::Ok();
}

size_t element_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// ---- scratch: the bytes of each piece a call takes -------------------------------
// sdpa_forward / sdpa_backward allocate these; scratch_bytes adds them up for the
// workspace a command-buffer compatible call is handed.

size_t lengths_bytes(const SdpaParams& p, const Spec& s) {
  return s.padding ? 2 * p.batch * sizeof(int32_t) : 0;
}

size_t converted_bias_bytes(const SdpaParams& p, const Spec& s) {
  if (!s.bias || s.bias_direct) return 0;
  return static_cast<size_t>(s.bias_b * s.bias_h * p.len_q * p.len_kv) * element_bytes(p.dtype);
}

// An input's copy with its rows past a length zeroed (zeroed_past_length); 0: the input
// itself serves.
size_t zeroed_copy_bytes(const SdpaParams& p, bool len_is_q, int64_t heads, int64_t len,
                         int64_t dim, const int64_t stride[3]) {
  if ((len_is_q ? p.q_lengths : p.kv_lengths) == nullptr || raw_mode()) return 0;
  const int64_t n = cudnn_kernels::strided_extent(p.batch, heads, len, dim, stride);
  return n > 0 ? static_cast<size_t>(n) * element_bytes(p.dtype) : 0;
}

// The stats of a forward that returns no lse, where the row fix-up reads them.
size_t forward_stats_bytes(const SdpaParams& p, const Spec& s, bool lse_wanted) {
  return s.stats && !lse_wanted ? p.batch * p.heads_q * p.len_q * sizeof(float) : 0;
}

size_t backward_stats_bytes(const SdpaParams& p, const Spec& s) {
  return s.fix_rows && !raw_mode() ? p.batch * p.heads_q * p.len_q * sizeof(float) : 0;
}

// Clamped lengths and the bias, shared by forward and backward.
struct Extras {
  int32_t* seq_q = nullptr;
  int32_t* seq_kv = nullptr;
  const void* bias = nullptr;
};

Status prepare_extras(const SdpaParams& p, const Spec& s, cudaStream_t stream, Scratch& scratch,
                      Extras* x) {
  if (s.padding) {
    void* mem = nullptr;
    if (Status st = allocate(scratch, lengths_bytes(p, s), &mem, "sequence lengths");
        !st.ok())
      return st;
    x->seq_q = static_cast<int32_t*>(mem);
    x->seq_kv = x->seq_q + p.batch;
    if (Status st = cuda_status(
            cudnn_kernels::prepare_lengths(p.q_lengths, p.kv_lengths, p.batch, p.len_q,
                                           p.len_kv, x->seq_q, x->seq_kv, stream),
            "length clamp kernel");
        !st.ok())
      return st;
  }
  if (s.bias) {
    if (s.bias_direct) {
      x->bias = p.mask;
    } else {
      void* mem = nullptr;
      if (Status st = allocate(scratch, converted_bias_bytes(p, s), &mem, "mask as a bias");
          !st.ok())
        return st;
      if (Status st = cuda_status(
              cudnn_kernels::mask_to_bias(p, s.bias_b, s.bias_h, mem, p.dtype, stream),
              "mask conversion kernel");
          !st.ok())
        return st;
      x->bias = mem;
    }
  }
  return Status::Ok();
}

// An input whose rows past a length (q lengths: len_is_q; else kv lengths) cuDNN must see
// zeroed (cudnn_kernels::copy_zeroing_rows_past_length says why): a scratch copy, or the
// input itself where there are no such lengths.
Status zeroed_past_length(const SdpaParams& p, bool len_is_q, const void* x, int64_t heads,
                          int64_t len, int64_t dim, const int64_t stride[3],
                          cudaStream_t stream, Scratch& scratch, const char* what,
                          const void** out) {
  *out = x;
  const size_t bytes = zeroed_copy_bytes(p, len_is_q, heads, len, dim, stride);
  if (bytes == 0) return Status::Ok();
  void* mem = nullptr;
  if (Status st = allocate(scratch, bytes, &mem, what); !st.ok()) return st;
  if (Status st = cuda_status(cudnn_kernels::copy_zeroing_rows_past_length(
                                  p, len_is_q, x, mem, heads, len, dim, stride, stream),
                              "zeroing copy kernel");
      !st.ok())
    return st;
  *out = mem;
  return Status::Ok();
}

Status execute(DeviceState* dev, const Plan& plan, cudaStream_t stream,
               std::unordered_map<int64_t, void*>& pack, Scratch& scratch) {
  void* workspace = nullptr;
  if (Status st = allocate(scratch, plan.workspace, &workspace, "cuDNN workspace"); !st.ok())
    return st;
  std::lock_guard<std::mutex> lock(dev->mu);
  cudnnStatus_t rc = cudnnSetStream(dev->handle, stream);
  if (rc != CUDNN_STATUS_SUCCESS)
    return Status::Error(Status::kInternal, std::string("jax_sdpa: cudnnSetStream failed: ") +
                                                cudnnGetErrorString(rc));
  auto e = plan.graph->execute(dev->handle, pack, workspace);
  if (!e.is_good())
    return Status::Error(Status::kInternal,
                         "jax_sdpa: cuDNN SDPA execution failed: " + e.get_message());
  return Status::Ok();
}

Status current_device(int* device) {
  return cuda_status(cudaGetDevice(device), "cudaGetDevice");
}

Status check_dtype(const SdpaParams& p) {
  if (p.dtype == DType::kF32)
    return Status::Error(Status::kUnimplemented,
                         "jax_sdpa: cuDNN SDPA needs float16 or bfloat16 inputs, got float32 (" +
                             shape_str(p) + ")");
  return Status::Ok();
}

// unsupported_reason as the handler's error. The backward graph takes no sinks (their
// gradient is computed in JAX), so per-batch sinks are refused in the forward only.
Status check_features(const SdpaParams& p, bool backward) {
  const bool per_batch_sinks = !backward && p.sinks != nullptr && p.sinks_batch_stride != 0;
  const std::string why =
      unsupported_reason(p, p.q_lengths != nullptr || p.kv_lengths != nullptr, per_batch_sinks);
  if (why.empty()) return Status::Ok();
  return Status::Error(Status::kUnimplemented, "jax_sdpa: " + why + " (" + shape_str(p) + ")");
}

template <typename F>
Status guarded(F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    return Status::Error(Status::kInternal, std::string("jax_sdpa cuDNN: ") + e.what());
  }
}

}  // namespace

Status sdpa_forward(const SdpaParams& p, const SdpaFwdBuffers& b, cudaStream_t stream,
                    Scratch& scratch) {
  const bool lse_wanted = b.lse != nullptr;
  return guarded([&]() -> Status {
    if (p.batch * p.heads_q * p.len_q == 0) return Status::Ok();
    if (p.len_kv == 0)  // no keys anywhere: every row is empty
      return cuda_status(cudnn_kernels::fix_forward_rows(p, b.out, b.lse, stream),
                         "row fix-up kernel");
    if (Status st = check_dtype(p); !st.ok()) return st;
    if (Status st = check_features(p, /*backward=*/false); !st.ok()) return st;
    int device = 0;
    if (Status st = current_device(&device); !st.ok()) return st;
    DeviceState* dev = nullptr;
    if (Status st = device_state(device, &dev); !st.ok()) return st;
    const Spec s = make_spec(p, device, /*backward=*/false, lse_wanted);
    std::shared_ptr<Plan> plan;
    if (Status st = get_plan(p, s, dev, &plan); !st.ok()) return st;

    Extras x;
    if (Status st = prepare_extras(p, s, stream, scratch, &x); !st.ok()) return st;
    // A key past the kv length gets P = 0, which cuDNN still multiplies by its value.
    const void* v = nullptr;
    if (Status st = zeroed_past_length(p, false, b.v, p.heads_kv, p.len_kv, p.head_dim_v,
                                       p.v_stride, stream, scratch, "values past the kv lengths",
                                       &v);
        !st.ok())
      return st;
    float scale = static_cast<float>(p.scale);
    std::unordered_map<int64_t, void*> pack = {
        {kQ, const_cast<void*>(b.q)}, {kK, const_cast<void*>(b.k)},
        {kV, const_cast<void*>(v)},   {kScale, &scale},
        {kO, b.out}};
    // No lse to return: the stats the row fix-up reads go to scratch.
    float* stats = b.lse;
    if (s.stats && stats == nullptr) {
      void* mem = nullptr;
      if (Status st = allocate(scratch, forward_stats_bytes(p, s, lse_wanted), &mem,
                               "softmax stats");
          !st.ok())
        return st;
      stats = static_cast<float*>(mem);
    }
    if (s.stats) pack[kStats] = stats;
    if (s.bias) pack[kBias] = const_cast<void*>(x.bias);
    if (s.padding) {
      pack[kSeqQ] = x.seq_q;
      pack[kSeqKv] = x.seq_kv;
    }
    if (s.sinks) pack[kSink] = const_cast<float*>(p.sinks);
    if (Status st = execute(dev, *plan, stream, pack, scratch); !st.ok()) return st;
    if (s.fix_rows && !raw_mode())
      return cuda_status(cudnn_kernels::fix_forward_rows(p, b.out, stats, stream),
                         "row fix-up kernel");
    return Status::Ok();
  });
}

Status sdpa_backward(const SdpaParams& p, const SdpaBwdBuffers& b, cudaStream_t stream,
                     Scratch& scratch) {
  return guarded([&]() -> Status {
    const size_t es = element_bytes(p.dtype);
    if (p.batch * p.heads_q * p.len_q == 0 || p.len_kv == 0) {
      // Nothing attends: every gradient is zero (the buffers are dense).
      const size_t nq = p.batch * p.heads_q * p.len_q * p.head_dim * es;
      const size_t nk = p.batch * p.heads_kv * p.len_kv * p.head_dim * es;
      const size_t nv = p.batch * p.heads_kv * p.len_kv * p.head_dim_v * es;
      if (nq) if (Status st = cuda_status(cudaMemsetAsync(b.dq, 0, nq, stream), "memset"); !st.ok()) return st;
      if (nk) if (Status st = cuda_status(cudaMemsetAsync(b.dk, 0, nk, stream), "memset"); !st.ok()) return st;
      if (nv) if (Status st = cuda_status(cudaMemsetAsync(b.dv, 0, nv, stream), "memset"); !st.ok()) return st;
      return Status::Ok();
    }
    if (Status st = check_dtype(p); !st.ok()) return st;
    if (Status st = check_features(p, /*backward=*/true); !st.ok()) return st;
    int device = 0;
    if (Status st = current_device(&device); !st.ok()) return st;
    DeviceState* dev = nullptr;
    if (Status st = device_state(device, &dev); !st.ok()) return st;
    const Spec s = make_spec(p, device, /*backward=*/true);
    std::shared_ptr<Plan> plan;
    if (Status st = get_plan(p, s, dev, &plan); !st.ok()) return st;

    Extras x;
    if (Status st = prepare_extras(p, s, stream, scratch, &x); !st.ok()) return st;
    const float* stats = b.lse;
    if (s.fix_rows && !raw_mode()) {
      const int64_t n = p.batch * p.heads_q * p.len_q;
      void* mem = nullptr;
      if (Status st = allocate(scratch, backward_stats_bytes(p, s), &mem, "backward stats");
          !st.ok())
        return st;
      if (Status st = cuda_status(
              cudnn_kernels::stats_for_backward(b.lse, n, static_cast<float*>(mem), stream),
              "stats kernel");
          !st.ok())
        return st;
      stats = static_cast<const float*>(mem);
    }
    // Rows past the lengths meet P = 0 in products cuDNN still computes (dS K, dS^T Q,
    // P^T dO, dO V^T): they go in zeroed.
    const void *q = nullptr, *k = nullptr, *v = nullptr, *dout = nullptr;
    if (Status st = zeroed_past_length(p, true, b.q, p.heads_q, p.len_q, p.head_dim, p.q_stride,
                                       stream, scratch, "queries past the q lengths", &q);
        !st.ok())
      return st;
    if (Status st = zeroed_past_length(p, true, b.dout, p.heads_q, p.len_q, p.head_dim_v,
                                       p.o_stride, stream, scratch,
                                       "output gradients past the q lengths", &dout);
        !st.ok())
      return st;
    if (Status st = zeroed_past_length(p, false, b.k, p.heads_kv, p.len_kv, p.head_dim,
                                       p.k_stride, stream, scratch, "keys past the kv lengths",
                                       &k);
        !st.ok())
      return st;
    if (Status st = zeroed_past_length(p, false, b.v, p.heads_kv, p.len_kv, p.head_dim_v,
                                       p.v_stride, stream, scratch, "values past the kv lengths",
                                       &v);
        !st.ok())
      return st;
    float scale = static_cast<float>(p.scale);
    std::unordered_map<int64_t, void*> pack = {
        {kQ, const_cast<void*>(q)},        {kK, const_cast<void*>(k)},
        {kV, const_cast<void*>(v)},        {kO, const_cast<void*>(b.out)},
        {kDO, const_cast<void*>(dout)},    {kStats, const_cast<float*>(stats)},
        {kScale, &scale},                  {kDQ, b.dq},
        {kDK, b.dk},                       {kDV, b.dv}};
    if (s.bias) pack[kBias] = const_cast<void*>(x.bias);
    if (s.padding) {
      pack[kSeqQ] = x.seq_q;
      pack[kSeqKv] = x.seq_kv;
    }
    if (Status st = execute(dev, *plan, stream, pack, scratch); !st.ok()) return st;
    if (raw_mode()) return Status::Ok();
    // Gradient rows past the valid lengths are zero by contract.
    if (Status st = cuda_status(
            cudnn_kernels::zero_rows_past_length(p, true, b.dq, p.heads_q, p.len_q, p.head_dim,
                                                 p.q_stride, stream),
            "zero kernel");
        !st.ok())
      return st;
    if (Status st = cuda_status(
            cudnn_kernels::zero_rows_past_length(p, false, b.dk, p.heads_kv, p.len_kv,
                                                 p.head_dim, p.k_stride, stream),
            "zero kernel");
        !st.ok())
      return st;
    return cuda_status(cudnn_kernels::zero_rows_past_length(p, false, b.dv, p.heads_kv, p.len_kv,
                                                            p.head_dim_v, p.v_stride, stream),
                       "zero kernel");
  });
}

Status scratch_bytes(const SdpaParams& p, bool backward, bool lse_wanted, int64_t* bytes) {
  return guarded([&]() -> Status {
    *bytes = 0;
    // The calls that return before any graph runs (sdpa_forward / sdpa_backward) take none.
    if (p.batch * p.heads_q * p.len_q == 0 || p.len_kv == 0) return Status::Ok();
    if (Status st = check_dtype(p); !st.ok()) return st;
    if (Status st = check_features(p, backward); !st.ok()) return st;
    int device = 0;
    if (Status st = current_device(&device); !st.ok()) return st;
    DeviceState* dev = nullptr;
    if (Status st = device_state(device, &dev); !st.ok()) return st;
    const Spec s = make_spec(p, device, backward, lse_wanted);
    std::shared_ptr<Plan> plan;
    if (Status st = get_plan(p, s, dev, &plan); !st.ok()) return st;
    std::vector<size_t> pieces = {lengths_bytes(p, s), converted_bias_bytes(p, s),
                                  static_cast<size_t>(plan->workspace)};
    if (!backward) pieces.push_back(forward_stats_bytes(p, s, lse_wanted));
    if (backward) {
      pieces.push_back(backward_stats_bytes(p, s));
      pieces.push_back(zeroed_copy_bytes(p, true, p.heads_q, p.len_q, p.head_dim, p.q_stride));
      pieces.push_back(
          zeroed_copy_bytes(p, true, p.heads_q, p.len_q, p.head_dim_v, p.o_stride));
      pieces.push_back(
          zeroed_copy_bytes(p, false, p.heads_kv, p.len_kv, p.head_dim, p.k_stride));
    }
    pieces.push_back(zeroed_copy_bytes(p, false, p.heads_kv, p.len_kv, p.head_dim_v, p.v_stride));
    size_t total = kScratchAlignment;  // slack to align the buffer's start
    for (size_t b : pieces)
      total += (b + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
    *bytes = static_cast<int64_t>(total);
    return Status::Ok();
  });
}

long runtime_version() {
  try {
    return static_cast<long>(cudnnGetVersion());
  } catch (...) {
    return -1;
  }
}
long compiled_version() { return CUDNN_VERSION; }
long frontend_version() { return CUDNN_FRONTEND_VERSION; }
long graph_cache_size() { return static_cast<long>(graph_cache().size()); }
long graph_cache_capacity() { return static_cast<long>(graph_cache().capacity()); }
void clear_graph_cache() { graph_cache().clear(); }

}  // namespace jax_sdpa::cudnn

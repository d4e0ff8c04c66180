// Calls the C++ CPU kernels' XLA FFI handlers (runtime/kernels/cpu/*.cc) directly, the way
// XLA:CPU does, with a thread pool of its own behind the FFI ThreadPool API, so that the
// kernels and their work sharing (cpu_parallel.h: run_phase, the Chain of dependent phases,
// the helpers that linger and take the next call's work through Handoff::slot) run under
// ThreadSanitizer and AddressSanitizer + UBSan without Python or XLA in the process.
// Built and run by scripts/sanitize_kernels.sh (tests/kernels/test_sanitizers.py).
//
// Several caller threads (XLA can run two executables' custom calls at once) share one pool
// and one Handoff. Each caller runs every target once on its own thread (num_threads = 1, no
// pool) for a baseline, then, per iteration, a burst of short calls back to back (1-row
// products, a small decode: the helpers linger after each and take the next call's work
// from the slot) and a few long ones (many rows, the layer tail's four chained phases,
// attention with a shared prefix), with 2..threads workers. Every result is compared with
// the baseline: bit for bit for the products and the KV write (each output is computed by
// one item, whatever the thread count), to 1e-5 for attention (the split of a sequence's
// blocks into ranges follows the thread count). At the end a lingering helper must have
// taken work through the slot at least once (PAGEDJAX_LINGER_US=0 turns that check off).
//
// Usage: ffi_driver [iterations=20] [callers=2] [threads=3]. Exit status 0 when every call
// succeeded and matched; 1 otherwise (the sanitizers exit non-zero on their own reports).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "cpu_parallel.h"  // (pagedjax::handoff(): the helpers' slot and its counter)

extern "C" {
XLA_FFI_Error* PagedjaxInt8Linear(XLA_FFI_CallFrame*);
XLA_FFI_Error* PagedjaxInt8LinearG32(XLA_FFI_CallFrame*);
XLA_FFI_Error* PagedjaxF32Linear(XLA_FFI_CallFrame*);
XLA_FFI_Error* PagedjaxF32LayerTail(XLA_FFI_CallFrame*);
XLA_FFI_Error* PagedjaxDecodeAttention(XLA_FFI_CallFrame*);
XLA_FFI_Error* PagedjaxDecodeAttentionInt8(XLA_FFI_CallFrame*);
XLA_FFI_Error* PagedjaxKvWrite(XLA_FFI_CallFrame*);
XLA_FFI_Error* PagedjaxWqLinear(XLA_FFI_CallFrame*);
XLA_FFI_Error* PagedjaxWqLayerTail(XLA_FFI_CallFrame*);
XLA_FFI_Error* PagedjaxExpertProducts(XLA_FFI_CallFrame*);
const char* PagedjaxAttentionPath();
const char* PagedjaxF32LinearPath();
const char* PagedjaxInt8LinearPath();
}

namespace {

// --- the part of the XLA runtime the handlers use: errors and the intra-op thread pool ------

struct FakeError {
  XLA_FFI_Error_Code code;
  std::string message;
};

XLA_FFI_Error* ErrorCreate(XLA_FFI_Error_Create_Args* a) {
  return reinterpret_cast<XLA_FFI_Error*>(new FakeError{a->errc, a->message ? a->message : ""});
}
void ErrorGetMessage(XLA_FFI_Error_GetMessage_Args* a) {
  a->message = reinterpret_cast<FakeError*>(a->error)->message.c_str();
}
void ErrorDestroy(XLA_FFI_Error_Destroy_Args* a) { delete reinterpret_cast<FakeError*>(a->error); }

// A fixed set of workers taking tasks in order, as XLA's intra-op pool; tasks still queued
// at the end run before the workers exit (each owns the memory its handler allocated).
class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 0; i < n; ++i) workers_.emplace_back([this] { Loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }
  void Schedule(XLA_FFI_Task* task, void* data) {
    {
      std::lock_guard<std::mutex> l(mu_);
      tasks_.emplace_back(task, data);
    }
    cv_.notify_one();
  }
  int64_t size() const { return static_cast<int64_t>(workers_.size()); }

 private:
  void Loop() {
    for (;;) {
      std::pair<XLA_FFI_Task*, void*> t;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        t = tasks_.front();
        tasks_.pop_front();
      }
      t.first(t.second);
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<XLA_FFI_Task*, void*>> tasks_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

XLA_FFI_Error* ThreadPoolSchedule(XLA_FFI_ThreadPool_Schedule_Args* a) {
  reinterpret_cast<Pool*>(a->ctx)->Schedule(a->task, a->data);
  return nullptr;
}
XLA_FFI_Error* ThreadPoolNumThreads(XLA_FFI_ThreadPool_NumThreads_Args* a) {
  *a->num_threads = reinterpret_cast<Pool*>(a->ctx)->size();
  return nullptr;
}

XLA_FFI_Api MakeApi() {
  XLA_FFI_Api api{};
  api.struct_size = XLA_FFI_Api_STRUCT_SIZE;
  api.api_version = XLA_FFI_Api_Version{XLA_FFI_Api_Version_STRUCT_SIZE, nullptr, XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR};
  api.XLA_FFI_Error_Create = ErrorCreate;
  api.XLA_FFI_Error_GetMessage = ErrorGetMessage;
  api.XLA_FFI_Error_Destroy = ErrorDestroy;
  api.XLA_FFI_ThreadPool_Schedule = ThreadPoolSchedule;
  api.XLA_FFI_ThreadPool_NumThreads = ThreadPoolNumThreads;
  return api;
}

const XLA_FFI_Api kApi = MakeApi();

// --- call frames --------------------------------------------------------------------------

struct Array {
  XLA_FFI_DataType dtype;
  std::vector<int64_t> dims;
  std::vector<uint8_t> bytes;

  static size_t elem(XLA_FFI_DataType t) {
    return t == XLA_FFI_DataType_S8 || t == XLA_FFI_DataType_U8 ? 1 : t == XLA_FFI_DataType_F16 ? 2 : 4;
  }
  Array(XLA_FFI_DataType t, std::vector<int64_t> d) : dtype(t), dims(std::move(d)) {
    int64_t n = 1;
    for (int64_t x : dims) n *= x;
    bytes.assign(static_cast<size_t>(n) * elem(t), 0);
  }
  template <class T>
  T* as() { return reinterpret_cast<T*>(bytes.data()); }
  int64_t count() const { return static_cast<int64_t>(bytes.size() / elem(dtype)); }
};

using Rng = std::mt19937_64;

Array F32(Rng& rng, std::vector<int64_t> dims, float scale = 1.0f) {
  Array a(XLA_FFI_DataType_F32, std::move(dims));
  std::normal_distribution<float> n(0.0f, scale);
  for (int64_t i = 0; i < a.count(); ++i) a.as<float>()[i] = n(rng);
  return a;
}
Array Positive(Rng& rng, std::vector<int64_t> dims, float lo, float hi) {
  Array a(XLA_FFI_DataType_F32, std::move(dims));
  std::uniform_real_distribution<float> u(lo, hi);
  for (int64_t i = 0; i < a.count(); ++i) a.as<float>()[i] = u(rng);
  return a;
}
// Uniform floats in [lo, hi) as float16 bits (truncated; magnitudes below float16's normal
// range flush to zero).
Array F16(Rng& rng, std::vector<int64_t> dims, float lo, float hi) {
  Array a(XLA_FFI_DataType_F16, std::move(dims));
  std::uniform_real_distribution<float> u(lo, hi);
  for (int64_t i = 0; i < a.count(); ++i) {
    const float f = u(rng);
    uint32_t b;
    std::memcpy(&b, &f, sizeof b);
    const int32_t e = static_cast<int32_t>((b >> 23) & 0xff) - 112;
    a.as<uint16_t>()[i] = static_cast<uint16_t>(((b >> 16) & 0x8000u) |
                                                (e <= 0 ? 0u : (static_cast<uint32_t>(e) << 10) | ((b >> 13) & 0x3ffu)));
  }
  return a;
}
Array S8(Rng& rng, std::vector<int64_t> dims) {
  Array a(XLA_FFI_DataType_S8, std::move(dims));
  std::uniform_int_distribution<int> u(-127, 127);
  for (int64_t i = 0; i < a.count(); ++i) a.as<int8_t>()[i] = static_cast<int8_t>(u(rng));
  return a;
}
Array U8(Rng& rng, std::vector<int64_t> dims) {
  Array a(XLA_FFI_DataType_U8, std::move(dims));
  std::uniform_int_distribution<int> u(0, 255);
  for (int64_t i = 0; i < a.count(); ++i) a.as<uint8_t>()[i] = static_cast<uint8_t>(u(rng));
  return a;
}
Array S32(std::vector<int64_t> dims, std::vector<int32_t> values = {}) {
  Array a(XLA_FFI_DataType_S32, std::move(dims));
  std::copy(values.begin(), values.end(), a.as<int32_t>());
  return a;
}
Array Empty(XLA_FFI_DataType t = XLA_FFI_DataType_F32) { return Array(t, {0}); }

struct Attr {
  std::string name;
  XLA_FFI_DataType dtype;
  int64_t i = 0;
  float f = 0.0f;
};

// One kernel call: the handler, its operands and attributes (num_threads is set per call).
struct Case {
  std::string name;
  XLA_FFI_Handler* handler;
  std::vector<Array> args, rets;
  std::vector<Attr> attrs;
  bool exact = true;  // results equal bit for bit at any thread count
  bool short_call = false;
  std::vector<std::vector<uint8_t>> baseline;
};

std::string Run(Case& c, Pool* pool, int64_t threads) {
  std::vector<XLA_FFI_Buffer> bufs;
  bufs.reserve(c.args.size() + c.rets.size());
  auto buffer = [&](Array& a) {
    bufs.push_back(XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, a.dtype, a.bytes.data(),
                                  static_cast<int64_t>(a.dims.size()), a.dims.data()});
    return static_cast<void*>(&bufs.back());
  };
  std::vector<XLA_FFI_ArgType> arg_types(c.args.size(), XLA_FFI_ArgType_BUFFER);
  std::vector<XLA_FFI_RetType> ret_types(c.rets.size(), XLA_FFI_RetType_BUFFER);
  std::vector<void*> args, rets;
  for (auto& a : c.args) args.push_back(buffer(a));
  for (auto& r : c.rets) rets.push_back(buffer(r));
  // attributes go sorted by name (the handlers look them up by their index in that order)
  std::vector<Attr> attrs = c.attrs;
  for (auto& a : attrs)
    if (a.name == "num_threads") a.i = threads;
  std::sort(attrs.begin(), attrs.end(), [](const Attr& a, const Attr& b) { return a.name < b.name; });
  std::vector<XLA_FFI_ByteSpan> names;
  std::vector<XLA_FFI_Scalar> scalars;
  names.reserve(attrs.size());
  scalars.reserve(attrs.size());
  std::vector<XLA_FFI_ByteSpan*> name_ptrs;
  std::vector<XLA_FFI_AttrType> attr_types(attrs.size(), XLA_FFI_AttrType_SCALAR);
  std::vector<void*> attr_ptrs;
  for (auto& a : attrs) {
    names.push_back(XLA_FFI_ByteSpan{a.name.data(), a.name.size()});
    name_ptrs.push_back(&names.back());
    scalars.push_back(XLA_FFI_Scalar{a.dtype, a.dtype == XLA_FFI_DataType_F32 ? static_cast<void*>(&a.f)
                                                                               : static_cast<void*>(&a.i)});
    attr_ptrs.push_back(&scalars.back());
  }
  XLA_FFI_CallFrame frame{};
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.api = &kApi;
  frame.ctx = reinterpret_cast<XLA_FFI_ExecutionContext*>(pool);
  frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
  frame.args = XLA_FFI_Args{XLA_FFI_Args_STRUCT_SIZE, nullptr, static_cast<int64_t>(args.size()), arg_types.data(),
                            args.data()};
  frame.rets = XLA_FFI_Rets{XLA_FFI_Rets_STRUCT_SIZE, nullptr, static_cast<int64_t>(rets.size()), ret_types.data(),
                            rets.data()};
  frame.attrs = XLA_FFI_Attrs{XLA_FFI_Attrs_STRUCT_SIZE, nullptr, static_cast<int64_t>(attrs.size()),
                              attr_types.data(), name_ptrs.data(), attr_ptrs.data()};
  if (XLA_FFI_Error* err = c.handler(&frame)) {
    std::string msg = reinterpret_cast<FakeError*>(err)->message;
    delete reinterpret_cast<FakeError*>(err);
    return c.name + ": " + (msg.empty() ? "error" : msg);
  }
  return "";
}

// "" when c's results equal its baseline (bit for bit, or to 1e-5 relative to the largest).
std::string Compare(Case& c) {
  for (size_t r = 0; r < c.rets.size(); ++r) {
    const auto& got = c.rets[r].bytes;
    const auto& want = c.baseline[r];
    if (c.exact) {
      if (got != want) return c.name + ": result " + std::to_string(r) + " differs from the 1-thread baseline";
      continue;
    }
    const float* g = reinterpret_cast<const float*>(got.data());
    const float* w = reinterpret_cast<const float*>(want.data());
    const size_t n = got.size() / 4;
    float scale = 1e-30f, err = 0.0f;
    for (size_t i = 0; i < n; ++i) scale = std::max(scale, std::fabs(w[i]));
    for (size_t i = 0; i < n; ++i) err = std::max(err, std::fabs(g[i] - w[i]));
    if (!(err <= 1e-5f * scale))
      return c.name + ": result " + std::to_string(r) + " off the baseline by " + std::to_string(err);
  }
  return "";
}

Attr Threads() { return {"num_threads", XLA_FFI_DataType_S64}; }
Attr I64(const char* name, int64_t v) { return {name, XLA_FFI_DataType_S64, v}; }
Attr F32Attr(const char* name, float v) { return {name, XLA_FFI_DataType_F32, 0, v}; }

// --- the calls ------------------------------------------------------------------------------

Case Int8Linear(Rng& rng, int64_t M, int64_t K, int64_t N, bool smooth) {
  const int64_t Kp = (K + 3) / 4 * 4, S = (N + 63) / 64;
  Case c{"int8_linear " + std::to_string(M) + "x" + std::to_string(K) + "x" + std::to_string(N),
         PagedjaxInt8Linear, {}, {}, {Threads()}};
  Array comp = S32({N});
  for (int64_t n = 0; n < N; ++n) comp.as<int32_t>()[n] = static_cast<int32_t>(rng() % 20000) - 10000;
  c.args.push_back(F32(rng, {M, K}, 3.0f));
  c.args.push_back(smooth ? Positive(rng, {K}, 0.5f, 1.5f) : Empty());
  c.args.push_back(S8(rng, {S, Kp / 4, 256}));
  c.args.push_back(Positive(rng, {N}, 1e-3f, 1e-2f));
  c.args.push_back(std::move(comp));
  c.rets.emplace_back(XLA_FFI_DataType_F32, std::vector<int64_t>{M, N});
  return c;
}

Case Int8LinearG32(Rng& rng, int64_t M, int64_t K, int64_t N) {
  const int64_t S = (N + 63) / 64, G = K / 32;
  Case c{"int8_linear_g32 " + std::to_string(M) + "x" + std::to_string(K) + "x" + std::to_string(N),
         PagedjaxInt8LinearG32, {}, {}, {Threads()}};
  Array comp = S32({G, N});
  for (int64_t i = 0; i < G * N; ++i) comp.as<int32_t>()[i] = static_cast<int32_t>(rng() % 8000) - 4000;
  c.args.push_back(F32(rng, {M, K}, 3.0f));
  c.args.push_back(S8(rng, {S, K / 4, 256}));
  c.args.push_back(Positive(rng, {G, N}, 1e-3f, 1e-2f));
  c.args.push_back(std::move(comp));
  c.rets.emplace_back(XLA_FFI_DataType_F32, std::vector<int64_t>{M, N});
  return c;
}

// Weight-only quantized: 4-bit (scales and offsets) or 8-bit (scales) values, float rows.
Case WqLinear(Rng& rng, int64_t M, int64_t K, int64_t N, int bits) {
  const int64_t S = N / 16, G = K / 32, n = bits == 4 ? 2 : 1;
  Case c{"wq_linear " + std::to_string(bits) + "-bit " + std::to_string(M) + "x" + std::to_string(K) + "x" +
             std::to_string(N),
         PagedjaxWqLinear, {}, {}, {Threads(), F32Attr("eps", 1e-5f)}};
  c.args.push_back(F32(rng, {M, K}));
  c.args.push_back(U8(rng, {S, G, bits == 4 ? 256 : 512}));
  c.args.push_back(Positive(rng, {S, G, n, 16}, 1e-3f, 1e-2f));
  c.args.push_back(M % 2 ? F32(rng, {M, N}) : Empty());    // residual on odd row counts
  c.args.push_back(M > 1 ? Positive(rng, {K}, 0.5f, 1.5f) : Empty());  // norm from 2 rows
  c.rets.emplace_back(XLA_FFI_DataType_F32, std::vector<int64_t>{M, N});
  return c;
}

// y = [rms_norm](x) @ W [+ residual], or silu(gate) * up with `swiglu` (N columns of gate|up pairs).
Case F32Linear(Rng& rng, int64_t M, int64_t K, int64_t N, bool residual, bool norm, bool swiglu) {
  const int64_t S = N / 16, out = swiglu ? N / 2 : N;
  Case c{"f32_linear " + std::to_string(M) + "x" + std::to_string(K) + "x" + std::to_string(N) +
             (residual ? " +residual" : "") + (norm ? " +norm" : "") + (swiglu ? " swiglu" : ""),
         PagedjaxF32Linear, {}, {}, {Threads(), I64("swiglu", swiglu), F32Attr("eps", 1e-5f)}};
  c.args.push_back(F32(rng, {M, K}));
  c.args.push_back(F32(rng, {S, K, 16}, 0.3f));
  c.args.push_back(residual ? F32(rng, {M, out}) : Empty());
  c.args.push_back(norm ? Positive(rng, {K}, 0.5f, 1.5f) : Empty());
  c.rets.emplace_back(XLA_FFI_DataType_F32, std::vector<int64_t>{M, out});
  return c;
}

// A decoder layer after attention: wo + residual, the MLP, [the next layer's qkv], chained.
Case F32LayerTail(Rng& rng, int64_t M, int64_t d, int64_t A, int64_t I, int64_t Nq) {
  Case c{"f32_layer_tail " + std::to_string(M) + " rows" + (Nq ? " +next qkv" : ""), PagedjaxF32LayerTail,
         {}, {}, {Threads(), F32Attr("eps", 1e-5f)}};
  c.args.push_back(F32(rng, {M, A}));
  c.args.push_back(F32(rng, {M, d}));
  c.args.push_back(F32(rng, {d / 16, A, 16}, 0.2f));
  c.args.push_back(Positive(rng, {d}, 0.5f, 1.5f));
  c.args.push_back(F32(rng, {2 * I / 16, d, 16}, 0.2f));
  c.args.push_back(F32(rng, {d / 16, I, 16}, 0.2f));
  c.args.push_back(Nq ? Positive(rng, {d}, 0.5f, 1.5f) : Empty());
  c.args.push_back(Nq ? F32(rng, {Nq / 16, d, 16}, 0.2f) : Empty());
  c.rets.emplace_back(XLA_FFI_DataType_F32, std::vector<int64_t>{M, d});
  c.rets.emplace_back(XLA_FFI_DataType_F32, std::vector<int64_t>{M, Nq});
  return c;
}

// A Llama-style layer after attention, 4-bit weights (gate|up side by side), with or without
// the next layer's qkv: the products as one chain of phases.
Case WqLayerTail(Rng& rng, int64_t M, int64_t d, int64_t A, int64_t I, int64_t Nq) {
  Case c{"wq_layer_tail " + std::to_string(M) + " rows" + (Nq ? " +next qkv" : ""), PagedjaxWqLayerTail,
         {}, {}, {Threads(), F32Attr("eps", 1e-5f)}};
  auto packed = [&](int64_t K, int64_t N) {
    c.args.push_back(U8(rng, {N / 16, K / 32, 256}));
    c.args.push_back(Positive(rng, {N / 16, K / 32, 2, 16}, 1e-3f, 1e-2f));
  };
  c.args.push_back(F32(rng, {M, A}));
  c.args.push_back(F32(rng, {M, d}));
  packed(A, d);
  c.args.push_back(Positive(rng, {d}, 0.5f, 1.5f));
  packed(d, 2 * I);
  packed(I, d);
  if (Nq) {
    c.args.push_back(Positive(rng, {d}, 0.5f, 1.5f));
    packed(d, Nq);
  } else {
    c.args.push_back(Empty());
    c.args.push_back(Empty(XLA_FFI_DataType_U8));
    c.args.push_back(Empty());
  }
  c.rets.emplace_back(XLA_FFI_DataType_F32, std::vector<int64_t>{M, d});
  c.rets.emplace_back(XLA_FFI_DataType_F32, std::vector<int64_t>{M, Nq});
  return c;
}

// Paged attention over random pages: `lens` context lengths (decode: one query per sequence;
// prefill: `chunk` query tokens ending at each sequence's length), the first `members`
// sequences sharing `shared_blocks` leading blocks (cascade), float32 or int8 pages.
Case Attention(Rng& rng, std::vector<int32_t> lens, int64_t H, int64_t G, int64_t D, int members,
               int64_t shared_blocks, bool prefill, bool int8, int32_t window = 0) {
  constexpr int64_t BS = 16;
  const int64_t S = static_cast<int64_t>(lens.size());
  int64_t MB = 1;
  for (int32_t l : lens) MB = std::max<int64_t>(MB, (l + BS - 1) / BS);
  const int64_t NB = S * MB + shared_blocks + 2;
  std::vector<int32_t> perm(NB);
  for (int64_t i = 0; i < NB; ++i) perm[i] = static_cast<int32_t>(i);
  std::shuffle(perm.begin(), perm.end(), rng);
  Array tables = S32({S, MB}), shared = S32({MB}), suffix = S32({S}), shared_len = S32({1});
  int64_t next = 0;
  for (int64_t b = 0; b < shared_blocks; ++b) shared.as<int32_t>()[b] = perm[next++];
  for (int64_t s = 0; s < S; ++s) {
    const bool member = s < members && shared_blocks > 0;
    for (int64_t b = 0; b < MB; ++b)
      tables.as<int32_t>()[s * MB + b] = member && b < shared_blocks ? shared.as<int32_t>()[b] : perm[next++ % NB];
    suffix.as<int32_t>()[s] = member ? static_cast<int32_t>(shared_blocks * BS) : 0;
  }
  shared_len.as<int32_t>()[0] = static_cast<int32_t>(shared_blocks * BS);
  std::vector<int32_t> seq_of, pos;
  if (prefill) {  // the last 5 tokens of each sequence (after the shared prefix for members)
    for (int64_t s = 0; s < S; ++s)
      for (int32_t p = std::max<int32_t>(lens[s] - 5, suffix.as<int32_t>()[s]); p < lens[s]; ++p) {
        seq_of.push_back(static_cast<int32_t>(s));
        pos.push_back(p);
      }
    seq_of.push_back(0);  // a padding token
    pos.push_back(-1);
  }
  const int64_t T = prefill ? static_cast<int64_t>(pos.size()) : S;
  Case c{std::string(prefill ? "prefill" : "decode") + " attention " + std::to_string(S) + " seqs" +
             (int8 ? " int8" : "") + (shared_blocks ? " +shared" : "") +
             (window ? " window " + std::to_string(window) : ""),
         int8 ? PagedjaxDecodeAttentionInt8 : PagedjaxDecodeAttention, {}, {}, {Threads()}};
  c.exact = false;
  c.args.push_back(F32(rng, {T, H, G, D}, 0.2f));
  if (int8) {
    c.args.push_back(S8(rng, {NB, BS, H, D}));
    c.args.push_back(S8(rng, {NB, BS, H, D}));
    const int64_t kg = D / 8, vg = D % 32 == 0 ? D / 32 : 1;  // the engine's groups: 8 channels for K, 32 for V
    c.args.push_back(F16(rng, {NB, BS, H, kg}, 0.005f, 0.02f));  // scales
    c.args.push_back(F16(rng, {NB, BS, H, vg}, 0.005f, 0.02f));
    c.args.push_back(F16(rng, {NB, BS, H, kg}, -0.5f, 0.5f));  // zeros
    c.args.push_back(F16(rng, {NB, BS, H, vg}, -0.5f, 0.5f));
  } else {
    c.args.push_back(F32(rng, {NB, BS, H, D}));
    c.args.push_back(F32(rng, {NB, BS, H, D}));
  }
  c.args.push_back(prefill ? S32({S}) : S32({S}, lens));
  c.args.push_back(std::move(tables));
  c.args.push_back(std::move(shared));
  c.args.push_back(std::move(shared_len));
  c.args.push_back(std::move(suffix));
  c.args.push_back(prefill ? S32({T}, seq_of) : Empty(XLA_FFI_DataType_S32));
  c.args.push_back(prefill ? S32({T}, pos) : Empty(XLA_FFI_DataType_S32));
  c.args.push_back(S32({1}, {window}));  // 0: full attention
  c.rets.emplace_back(XLA_FFI_DataType_F32, std::vector<int64_t>{T, H, G, D});
  return c;
}

Case KvWrite(Rng& rng) {
  Case c{"kv_write", PagedjaxKvWrite, {}, {}, {}};
  c.args.push_back(F32(rng, {6, 4, 3, 16}));
  c.args.push_back(F32(rng, {6, 4, 3, 16}));
  c.args.push_back(F32(rng, {5, 3, 16}));
  c.args.push_back(F32(rng, {5, 3, 16}));
  c.args.push_back(S32({5}, {3, -1, 23, 24, 0}));  // padding and a slot past the end: dropped
  c.rets.emplace_back(XLA_FFI_DataType_F32, std::vector<int64_t>{6, 4, 3, 16});
  c.rets.emplace_back(XLA_FFI_DataType_F32, std::vector<int64_t>{6, 4, 3, 16});
  return c;
}

// A mixture of experts' grouped product over two stacked layers of packed strips: rows sorted
// by expert (`sizes`, an empty expert among them), N past a whole strip, K past a K block.
Case ExpertProducts(Rng& rng, std::vector<int32_t> sizes, int64_t K, int64_t N, int32_t layer) {
  const int64_t E = static_cast<int64_t>(sizes.size()), S = (N + 63) / 64;
  int64_t M = 0;
  for (int32_t s : sizes) M += s;
  Case c{"expert products " + std::to_string(M) + " rows", PagedjaxExpertProducts, {}, {}, {Threads()}};
  c.args.push_back(F32(rng, {M, K}));
  c.args.push_back(F32(rng, {2, E, S, K, 64}, 0.1f));
  c.args.push_back(S32({1}, {layer}));
  c.args.push_back(S32({E}, sizes));
  c.rets.emplace_back(XLA_FFI_DataType_F32, std::vector<int64_t>{M, N});
  return c;
}

std::vector<Case> Cases(uint64_t seed) {
  Rng rng(seed);
  std::vector<Case> cs;
  auto add_short = [&](Case c) {
    c.short_call = true;
    cs.push_back(std::move(c));
  };
  // short: what a batch-1 decode step calls, tens of times per step
  add_short(F32Linear(rng, 1, 64, 128, false, true, false));
  add_short(F32Linear(rng, 1, 96, 64, true, false, false));
  add_short(F32Linear(rng, 1, 64, 64, false, true, true));
  add_short(F32LayerTail(rng, 1, 64, 48, 64, 96));
  add_short(Int8Linear(rng, 1, 64, 130, true));
  add_short(Int8LinearG32(rng, 2, 64, 70));
  add_short(WqLinear(rng, 1, 96, 64, 4));
  add_short(WqLinear(rng, 1, 64, 48, 8));
  add_short(WqLayerTail(rng, 1, 64, 96, 64, 96));
  add_short(Attention(rng, {40, 70}, 2, 3, 32, 0, 0, false, false));
  add_short(KvWrite(rng));
  add_short(ExpertProducts(rng, {1, 0, 1}, 64, 96, 1));
  // long: many rows, row tails, every phase of the chain, several row panels
  cs.push_back(F32Linear(rng, 40, 256, 192, true, true, false));
  cs.push_back(F32Linear(rng, 13, 1536, 32, false, false, false));
  cs.push_back(F32Linear(rng, 30, 128, 128, false, true, true));
  cs.push_back(F32LayerTail(rng, 20, 64, 64, 96, 80));
  cs.push_back(F32LayerTail(rng, 7, 64, 48, 64, 0));
  cs.push_back(Int8Linear(rng, 33, 128, 200, false));  // (16+ rows: AMX tiles where built with them)
  cs.push_back(Int8Linear(rng, 7, 70, 130, true));
  cs.push_back(Int8LinearG32(rng, 20, 320, 64));
  cs.push_back(Int8Linear(rng, 48, 2816, 64, false));  // (M * K > 2^17: the rows quantized in parallel too)
  cs.push_back(Int8LinearG32(rng, 48, 2816, 64));
  cs.push_back(WqLinear(rng, 5, 320, 96, 4));   // tiles of rows
  cs.push_back(WqLinear(rng, 20, 1536, 80, 4));  // dequantized strips, float tiles
  cs.push_back(WqLinear(rng, 13, 128, 64, 8));
  cs.push_back(WqLayerTail(rng, 9, 64, 64, 96, 160));  // dequantized strips in every phase
  cs.push_back(WqLayerTail(rng, 3, 64, 64, 64, 0));
  cs.push_back(Attention(rng, {70, 52, 33, 61, 49, 80, 40}, 3, 3, 64, 5, 2, false, false));
  cs.push_back(ExpertProducts(rng, {13, 0, 7, 1, 40}, 320, 200, 0));
  cs.push_back(Attention(rng, {70, 52, 33, 61, 49, 80, 40}, 3, 3, 64, 5, 2, false, true));
  cs.push_back(Attention(rng, {300}, 3, 3, 64, 0, 0, false, false));  // one sequence: split ranges
  cs.push_back(Attention(rng, {300, 90}, 1, 4, 256, 0, 0, false, false, 40));  // Gemma 3's shape, sliding
  cs.push_back(Attention(rng, {37, 60, 90}, 2, 4, 16, 0, 0, true, false, 24));
  cs.push_back(Attention(rng, {37, 60, 90}, 2, 4, 16, 2, 1, true, false));
  cs.push_back(Attention(rng, {37, 60, 90}, 2, 4, 16, 2, 1, true, true));
  return cs;
}

std::atomic<int> failures{0};
std::atomic<int64_t> calls{0};

void Fail(const std::string& msg) {
  if (failures.fetch_add(1) < 10) std::fprintf(stderr, "ffi_driver: %s\n", msg.c_str());
}

void Caller(int id, Pool* pool, int iterations, int64_t threads) {
  std::vector<Case> cs = Cases(1234 + id);
  for (auto& c : cs) {  // the baseline: on this thread alone, no pool
    if (std::string e = Run(c, pool, 1); !e.empty()) return Fail(e);
    for (auto& r : c.rets) c.baseline.push_back(r.bytes);
  }
  auto once = [&](Case& c, int64_t t) {
    for (auto& r : c.rets) std::fill(r.bytes.begin(), r.bytes.end(), 0xAB);
    std::string e = Run(c, pool, t);
    if (e.empty()) e = Compare(c);
    if (!e.empty()) Fail(e + " (" + std::to_string(t) + " threads)");
    calls.fetch_add(1, std::memory_order_relaxed);
  };
  for (int it = 0; it < iterations && failures.load() == 0; ++it) {
    const int64_t t = 2 + (it + id) % std::max<int64_t>(1, threads - 1);  // 2..threads workers
    for (int burst = 0; burst < 4; ++burst)  // short calls back to back: the handoff's path
      for (auto& c : cs)
        if (c.short_call) once(c, t);
    for (auto& c : cs)
      if (!c.short_call) once(c, t);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 20;
  const int callers = argc > 2 ? std::atoi(argv[2]) : 2;
  const int64_t threads = argc > 3 ? std::atoll(argv[3]) : 3;
  std::printf("ffi_driver: attention %s, f32 linear %s, int8 linear %s; %d iterations, %d callers, %lld threads\n",
              PagedjaxAttentionPath(), PagedjaxF32LinearPath(), PagedjaxInt8LinearPath(), iterations, callers,
              static_cast<long long>(threads));
  {
    Pool pool(static_cast<int>(threads));
    std::vector<std::thread> ts;
    for (int i = 0; i < callers; ++i) ts.emplace_back(Caller, i, &pool, iterations, threads);
    for (auto& t : ts) t.join();
  }
  const int64_t taken = pagedjax::handoff().taken.load();
  std::printf("ffi_driver: %lld calls, %lld handed to a lingering helper, %d failures\n",
              static_cast<long long>(calls.load()), static_cast<long long>(taken), failures.load());
  const char* linger = std::getenv("PAGEDJAX_LINGER_US");
  if (failures.load() == 0 && taken == 0 && !(linger && std::atoll(linger) <= 0)) {
    std::fprintf(stderr, "ffi_driver: no call was handed to a lingering helper: the handoff path did not run\n");
    return 1;
  }
  return failures.load() == 0 ? 0 : 1;
}

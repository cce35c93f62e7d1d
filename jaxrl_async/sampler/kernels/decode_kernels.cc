// Decode-step kernels for the sampler on XLA:CPU (XLA FFI custom calls; built by cpu_kernels.py).
//
// DecodeAttention: q [B, G, R, K], key/value caches [B, G, S, K] (head-major, as the engine stores them),
//   n_valid [B]: out[b, g, r] = softmax_s(q . k[b, g, s] * scale) . v[b, g, s] over s < n_valid[b] only.
//   XLA:CPU runs the equivalent batched matrix-vector einsums on one thread over the whole row (~10 GB/s).
// Linear: y [M, N] = x [M, D] . w^T with w packed in panels of 16 rows. XLA:CPU's matrix-vector products
//   stream the weights at ~80% of the read bandwidth and its dots with few rows are far from peak.
//
// Both split their work over one persistent pool whose workers spin between calls: a decode step makes
// ~50 small calls, and waking sleeping threads for each cost more than the split gained (measured).
//
// The library is compiled with -march=native (or the -march that JAXRL_ASYNC_KERNEL_MARCH names), and the
// linear kernel's register blocking follows the instruction set it is compiled for (`kMR`, `kNP` below):
// a blocking sized for AVX-512's 32 vector registers spills on AVX2's 16.
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline void CpuRelax() {  // a spin-wait hint: lets the sibling hyper-thread run, saves power
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Work split into `parts` contiguous pieces; fn(ctx, part) runs one piece.
using PartFn = void (*)(const void* ctx, int part, int parts);

class Pool {
 public:
  explicit Pool(int n) : n_(n) {
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this, i] { Loop(i); });
  }
  int size() const { return n_; }

  // Runs fn on every part, the caller taking part 0. A call that finds the pool busy (XLA may run two
  // custom calls concurrently) runs all parts itself rather than wait.
  void Run(PartFn fn, const void* ctx) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock() || n_ == 1) {
      for (int p = 0; p < n_; ++p) fn(ctx, p, n_);
      return;
    }
    fn_ = fn;
    ctx_ = ctx;
    pending_.store(n_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      gen_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) wake_.notify_all();
    fn(ctx, 0, n_);
    while (pending_.load(std::memory_order_acquire) != 0) CpuRelax();
  }

 private:
  void Loop(int part) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g;
      auto idle_since = std::chrono::steady_clock::now();
      int spins = 0;
      while ((g = gen_.load(std::memory_order_acquire)) == seen) {
        CpuRelax();
        // Spin for a short while after the last job, then sleep: between the kernels of a batch-1 step
        // only small XLA ops run, but XLA's own multi-threaded dots need the core back (spinning 2 ms made
        // a batch-1 step with XLA matmuls 1.6x slower; 50-200 us cost nothing measurable).
        if (++spins % 1024 == 0 &&
            std::chrono::steady_clock::now() - idle_since > kSpin) {
          std::unique_lock<std::mutex> lock(sleep_mu_);
          sleepers_.fetch_add(1);
          wake_.wait(lock, [&] { return gen_.load() != seen; });
          sleepers_.fetch_sub(1);
          idle_since = std::chrono::steady_clock::now();
        }
      }
      seen = g;
      fn_(ctx_, part, n_);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  static constexpr std::chrono::microseconds kSpin{100};
  const int n_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_, sleep_mu_;
  std::condition_variable wake_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0}, sleepers_{0};
  PartFn fn_ = nullptr;
  const void* ctx_ = nullptr;
};

Pool& GetPool(int64_t threads) {
  // One pool per process, sized by the first call; leaked on purpose (workers live as long as the process).
  static Pool* pool = new Pool(static_cast<int>(std::max<int64_t>(1, threads)));
  return *pool;
}

// [lo, hi) of `total` items for one part, rounded to multiples of `align` so inner blocks stay whole.
inline void PartRange(int64_t total, int part, int parts, int64_t align, int64_t* lo, int64_t* hi) {
  const int64_t per = ((total + parts - 1) / parts + align - 1) / align * align;
  *lo = std::min<int64_t>(total, part * per);
  *hi = std::min<int64_t>(total, *lo + per);
}

// ---------------------------------------------------------------------------------------------------------
// Attention.

struct AttentionArgs {
  const float *q, *kc, *vc;
  const int32_t* n_valid;
  float* out;
  int64_t rows, G, R, S, K;
  float scale;
};

void AttendRows(const void* ctx, int part, int parts) {
  const auto& a = *static_cast<const AttentionArgs*>(ctx);
  const int64_t G = a.G, R = a.R, S = a.S, K = a.K;
  int64_t lo, hi;
  PartRange(a.rows, part, parts, 1, &lo, &hi);
  if (lo >= hi) return;
  std::vector<float> scores(R * S);
  for (int64_t bg = lo; bg < hi; ++bg) {
    const int64_t b = bg / G;
    const int64_t n = std::min<int64_t>(std::max<int32_t>(a.n_valid[b], 0), S);
    const float* qb = a.q + bg * R * K;
    const float* kb = a.kc + bg * S * K;
    const float* vb = a.vc + bg * S * K;
    float* ob = a.out + bg * R * K;
    // While this row computes, pull the next row's keys and values toward L2 (one position per position
    // processed): the row is memory bound, and this overlap made 12 layers of batch 32 1.25x faster in a
    // C++ harness (14.1 -> 11.3 ms, 20 -> 25 GB/s). Nearer (L1) or non-temporal hints were slower.
    const bool pf = bg + 1 < hi;
    const float* kn = kb + S * K;
    const float* vn = vb + S * K;
    for (int64_t r = 0; r < R; ++r) {
      const bool pf_r = pf && r == 0;
      const float* qr = qb + r * K;
      float* sr = scores.data() + r * S;
      float m = -FLT_MAX;  // finite: the kernel is built with -ffast-math
      int64_t s = 0;
      for (; s + 4 <= n; s += 4) {  // four positions at once: independent accumulators
        if (pf_r)
          for (int64_t j = 0; j < 4 * K; j += 16) __builtin_prefetch(kn + s * K + j, 0, 1);
        const float* k0 = kb + s * K;
        const float *k1 = k0 + K, *k2 = k1 + K, *k3 = k2 + K;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        for (int64_t k = 0; k < K; ++k) {
          a0 += qr[k] * k0[k];
          a1 += qr[k] * k1[k];
          a2 += qr[k] * k2[k];
          a3 += qr[k] * k3[k];
        }
        sr[s] = a0 * a.scale; sr[s + 1] = a1 * a.scale; sr[s + 2] = a2 * a.scale; sr[s + 3] = a3 * a.scale;
      }
      for (; s < n; ++s) {
        const float* ks = kb + s * K;
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc += qr[k] * ks[k];
        sr[s] = acc * a.scale;
      }
      for (int64_t t = 0; t < n; ++t) m = std::max(m, sr[t]);
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) sr[t] = expf(sr[t] - m);  // libmvec's vector expf with -fopenmp-simd
      float denom = 0.f;
      for (int64_t t = 0; t < n; ++t) denom += sr[t];
      float* orow = ob + r * K;
      for (int64_t k = 0; k < K; ++k) orow[k] = 0.f;
      const float inv = n > 0 ? 1.f / denom : 0.f;  // no valid position: zeros
      for (int64_t s = 0; s < n; ++s) {
        if (pf_r)
          for (int64_t j = 0; j < K; j += 16) __builtin_prefetch(vn + s * K + j, 0, 1);
        const float p = sr[s] * inv;
        const float* vs = vb + s * K;
        for (int64_t k = 0; k < K; ++k) orow[k] += p * vs[k];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Linear over packed weights.

// Registers of the target: how many vector registers, and how many of them one 16-float panel row takes.
#if defined(__AVX512F__)
constexpr int kVecRegs = 32, kRegsPerPanel = 1;
constexpr const char* kIsa = "avx512";
#elif defined(__AVX__)
constexpr int kVecRegs = 16, kRegsPerPanel = 2;
constexpr const char* kIsa = "avx2";
#elif defined(__aarch64__)
constexpr int kVecRegs = 32, kRegsPerPanel = 4;
constexpr const char* kIsa = "neon";
#else
constexpr int kVecRegs = 16, kRegsPerPanel = 4;
constexpr const char* kIsa = "sse";
#endif
// A micro-kernel holds kMR x kNP panel accumulators, kNP panel rows of weights and one broadcast input in
// registers: kMR * kNP * r + kNP * r + 1 <= kVecRegs with r = kRegsPerPanel. Two panels per pass when a
// panel is one register (AVX-512: 14 x 2 = 28 accumulators), one otherwise (AVX2 and NEON: 6 x 1, SSE: 2 x 1).
constexpr int kNP = kRegsPerPanel == 1 ? 2 : 1;
constexpr int kMR = (kVecRegs - 1 - kNP * kRegsPerPanel) / (kNP * kRegsPerPanel);
static_assert(kMR >= 1 && kMR * kNP * kRegsPerPanel + kNP * kRegsPerPanel + 1 <= kVecRegs, "blocking");

// One vector register of floats. A 16-float panel row is kRegsPerPanel of them: a 64-byte vector type on a
// target without 512-bit registers is not kept in registers by the compiler (every multiply-add went through
// the stack: 25x slower than XLA at 32 rows with -march=x86-64-v3), so the kernel never uses wider types.
constexpr int kLanes = 16 / kRegsPerPanel;
typedef float vec __attribute__((vector_size(kLanes * 4)));
typedef float vecu __attribute__((vector_size(kLanes * 4), aligned(4)));  // the same, unaligned

// w is packed in panels of 16 output rows, [P, D, 16] (`cpu_kernels.pack`): for every input position d the
// 16 weights of a panel are one contiguous vector, so a pass over D streams each panel sequentially and the
// inputs are broadcast scalars (no horizontal sums; one weight load feeds MR FMAs).
struct LinearArgs {
  const float *x, *w;
  float* y;
  int64_t M, D, N, P;  // x [M, D], w [P, D, 16], y [M, N = 16 P]
};

// y[m0:m0+MR, 16p:16(p+NP)] in one pass over D. `pf` (or null): the next panels, pulled toward L2 while
// this pass runs (weights come from memory on the first pass over a panel; later passes hit L2).
template <int MR, int NP>
inline void Micro(const LinearArgs& a, int64_t p, int64_t m0, const float* pf) {
  constexpr int R = kRegsPerPanel, NV = NP * R;  // vectors per input row
  const int64_t D = a.D;
  vec acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vec{};
  const float* wp = a.w + p * D * 16;
  const float* x = a.x + m0 * D;
  for (int64_t d = 0; d < D; ++d) {
    vec wv[NV];
    for (int j = 0; j < NP; ++j)
      for (int r = 0; r < R; ++r) wv[j * R + r] = *reinterpret_cast<const vec*>(wp + (j * D + d) * 16 + r * kLanes);
    if (pf)  // a panel row is 64 bytes: one cache line
      for (int j = 0; j < NP; ++j) __builtin_prefetch(pf + (j * D + d) * 16, 0, 1);
    for (int i = 0; i < MR; ++i) {
      const float xi = x[i * D + d];
      for (int v = 0; v < NV; ++v) acc[i][v] += xi * wv[v];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP; ++j)
      for (int r = 0; r < R; ++r)
        *reinterpret_cast<vecu*>(a.y + (m0 + i) * a.N + (p + j) * 16 + r * kLanes) = acc[i][j * R + r];
}

// Panels [p, p + NP) against inputs [mlo, mhi), in blocks of kMR inputs, then smaller blocks for the rest.
template <int NP>
inline void Panels(const LinearArgs& a, int64_t p, int64_t mlo, int64_t mhi, int64_t phi) {
  const bool prefetch = mhi - mlo >= 4 && p + 2 * NP <= phi;  // one input: a pure stream, the hardware does it
  const float* pf = prefetch ? a.w + (p + NP) * a.D * 16 : nullptr;
  int64_t m = mlo;
  for (; m + kMR <= mhi; m += kMR, pf = nullptr) Micro<kMR, NP>(a, p, m, pf);
  if constexpr (kMR > 8)
    for (; m + 8 <= mhi; m += 8, pf = nullptr) Micro<8, NP>(a, p, m, pf);
  if constexpr (kMR > 4)
    for (; m + 4 <= mhi; m += 4, pf = nullptr) Micro<4, NP>(a, p, m, pf);
  if constexpr (kMR > 2)
    for (; m + 2 <= mhi; m += 2, pf = nullptr) Micro<2, NP>(a, p, m, pf);
  for (; m < mhi; ++m, pf = nullptr) Micro<1, NP>(a, p, m, pf);
}

void LinearRows(const void* ctx, int part, int parts) {
  const auto& a = *static_cast<const LinearArgs*>(ctx);
  int64_t lo, hi;
  PartRange(a.P, part, parts, 2, &lo, &hi);
  const int64_t kChunk = 96;  // inputs per chunk: a chunk of x stays in L2 while the panels stream past it
  for (int64_t mc = 0; mc < a.M; mc += kChunk) {
    const int64_t mhi = std::min<int64_t>(a.M, mc + kChunk);
    int64_t p = lo;
    if (mhi - mc == 1) {
      // One input row: memory bound; four panel streams in flight (the FMAs take their weights from memory
      // operands, so this needs no more registers than one accumulator per panel row).
      for (; p + 4 <= hi; p += 4) Panels<4>(a, p, mc, mhi, hi);
    }
    for (; p + kNP <= hi; p += kNP) Panels<kNP>(a, p, mc, mhi, hi);
    for (; p < hi; ++p) Panels<1>(a, p, mc, mhi, hi);
  }
}

}  // namespace

static ffi::Error DecodeAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kc, ffi::Buffer<ffi::F32> vc,
                                      ffi::Buffer<ffi::S32> n_valid, ffi::ResultBuffer<ffi::F32> out, float scale,
                                      int64_t threads) {
  auto qd = q.dimensions();   // [B, G, R, K]
  auto kd = kc.dimensions();  // [B, G, S, K]
  if (qd.size() != 4 || kd.size() != 4) return ffi::Error::InvalidArgument("expected rank-4 q and cache");
  const AttentionArgs args{q.typed_data(), kc.typed_data(), vc.typed_data(), n_valid.typed_data(),
                           out->typed_data(), qd[0] * qd[1], qd[1], qd[2], kd[2], qd[3], scale};
  if (args.rows * args.S * args.K < (1 << 14)) {  // tiny calls: one thread
    AttendRows(&args, 0, 1);
  } else {
    GetPool(threads).Run(AttendRows, &args);
  }
  return ffi::Error::Success();
}

static ffi::Error LinearImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y,
                             int64_t threads) {
  auto xd = x.dimensions();  // [M, D]
  auto wd = w.dimensions();  // [P, D, 16]
  auto yd = y->dimensions();  // [M, N]
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != 16 || xd[1] != wd[1] || yd[0] != xd[0] ||
      yd[1] != 16 * wd[0])
    return ffi::Error::InvalidArgument("expected x [M, D], packed w [P, D, 16] and y [M, 16 P]");
  const LinearArgs args{x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], yd[1], wd[0]};
  if (args.M * args.P * args.D * 16 < (1 << 15)) {  // tiny calls: one thread
    LinearRows(&args, 0, 1);
  } else {
    GetPool(threads).Run(LinearRows, &args);
  }
  return ffi::Error::Success();
}

// "<isa> <kMR>x<kNP>": the instruction set and linear blocking this library was compiled for (diagnostics).
extern "C" const char* KernelInfo() {
  static const std::string info = std::string(kIsa) + " " + std::to_string(kMR) + "x" + std::to_string(kNP);
  return info.c_str();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Linear, LinearImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads"));

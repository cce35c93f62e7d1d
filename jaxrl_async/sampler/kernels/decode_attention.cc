// Decode attention for the sampler on XLA:CPU (an XLA FFI custom call; built by cpu_attention.py).
//
// q [B, G, R, K], key/value caches [B, G, S, K] (head-major, as the engine stores them), n_valid [B]:
// out[b, g, r] = softmax_s(q . k[b, g, s] * scale) . v[b, g, s] over s < n_valid[b] only. XLA:CPU runs
// the equivalent batched matrix-vector einsums on one thread over the whole row (measured ~10 GB/s);
// this reads only each slot's valid positions and splits the (slot, head) rows over `threads` threads.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static void attend_rows(const float* q, const float* kc, const float* vc, const int32_t* n_valid, float* out,
                        int64_t G, int64_t R, int64_t S, int64_t K, float scale, int64_t lo, int64_t hi) {
  std::vector<float> scores(R * S);
  for (int64_t bg = lo; bg < hi; ++bg) {
    const int64_t b = bg / G;
    const int64_t n = std::min<int64_t>(std::max<int32_t>(n_valid[b], 0), S);
    const float* qb = q + bg * R * K;
    const float* kb = kc + bg * S * K;
    const float* vb = vc + bg * S * K;
    float* ob = out + bg * R * K;
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = qb + r * K;
      float* sr = scores.data() + r * S;
      float m = -FLT_MAX;  // finite: the kernel is built with -ffast-math
      int64_t s = 0;
      for (; s + 4 <= n; s += 4) {  // four positions at once: independent accumulators
        const float* k0 = kb + s * K;
        const float *k1 = k0 + K, *k2 = k1 + K, *k3 = k2 + K;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        for (int64_t k = 0; k < K; ++k) {
          a0 += qr[k] * k0[k];
          a1 += qr[k] * k1[k];
          a2 += qr[k] * k2[k];
          a3 += qr[k] * k3[k];
        }
        sr[s] = a0 * scale; sr[s + 1] = a1 * scale; sr[s + 2] = a2 * scale; sr[s + 3] = a3 * scale;
      }
      for (; s < n; ++s) {
        const float* ks = kb + s * K;
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc += qr[k] * ks[k];
        sr[s] = acc * scale;
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
        const float p = sr[s] * inv;
        const float* vs = vb + s * K;
        for (int64_t k = 0; k < K; ++k) orow[k] += p * vs[k];
      }
    }
  }
}

static ffi::Error DecodeAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kc, ffi::Buffer<ffi::F32> vc,
                                      ffi::Buffer<ffi::S32> n_valid, ffi::ResultBuffer<ffi::F32> out, float scale,
                                      int64_t threads) {
  auto qd = q.dimensions();  // [B, G, R, K]
  auto kd = kc.dimensions();  // [B, G, S, K]
  if (qd.size() != 4 || kd.size() != 4) return ffi::Error::InvalidArgument("expected rank-4 q and cache");
  const int64_t B = qd[0], G = qd[1], R = qd[2], K = qd[3], S = kd[2];
  const int64_t rows = B * G;
  int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, rows));
  if (rows * S * K < (1 << 16)) nt = 1;  // small calls: a thread costs more than it saves
  const int64_t per = (rows + nt - 1) / nt;
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < nt; ++t) {
    const int64_t lo = t * per, hi = std::min(rows, lo + per);
    if (lo >= hi) break;
    pool.emplace_back(attend_rows, q.typed_data(), kc.typed_data(), vc.typed_data(), n_valid.typed_data(),
                      out->typed_data(), G, R, S, K, scale, lo, hi);
  }
  attend_rows(q.typed_data(), kc.typed_data(), vc.typed_data(), n_valid.typed_data(), out->typed_data(), G, R, S,
              K, scale, 0, std::min(rows, per));
  for (auto& th : pool) th.join();
  return ffi::Error::Success();
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

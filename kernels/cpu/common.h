// What the CPU kernels share: float loads and stores of float32, bfloat16 and float16; the
// activations and their derivatives in float math that GCC vectorizes (no libm calls in the
// loops); and a parallel loop over XLA's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxfuse {

namespace ffi = xla::ffi;

// The math below must inline into the loops for GCC to vectorize them.
#define JAXFUSE_INLINE inline __attribute__((always_inline))

// Storage types ---------------------------------------------------------------------------------

struct bf16 { uint16_t bits; };
using f16 = _Float16;

JAXFUSE_INLINE float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
JAXFUSE_INLINE uint32_t to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

JAXFUSE_INLINE float load(const float* p, int64_t i) { return p[i]; }
JAXFUSE_INLINE float load(const f16* p, int64_t i) { return static_cast<float>(p[i]); }
JAXFUSE_INLINE float load(const bf16* p, int64_t i) { return from_bits(uint32_t{p[i].bits} << 16); }

JAXFUSE_INLINE void store(float* p, int64_t i, float v) { p[i] = v; }
JAXFUSE_INLINE void store(f16* p, int64_t i, float v) { p[i] = static_cast<f16>(v); }
JAXFUSE_INLINE void store(bf16* p, int64_t i, float v) {   // round to nearest even; NaN stays NaN
  uint32_t u = to_bits(v);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  p[i].bits = static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : rounded);
}

// Calls fn.template operator()<T>() with the storage type of dtype; false if it has none.
template <typename Fn>
bool with_storage(ffi::DataType dtype, Fn&& fn) {
  switch (dtype) {
    case ffi::DataType::F32: fn.template operator()<float>(); return true;
    case ffi::DataType::BF16: fn.template operator()<bf16>(); return true;
    case ffi::DataType::F16: fn.template operator()<f16>(); return true;
    default: return false;
  }
}

// Float math -------------------------------------------------------------------------------------

// exp(x) to about 1 ulp for x in [-87, 88] (Cephes' expf: 2**n times a degree-7 polynomial);
// clamped outside, NaN stays NaN.
JAXFUSE_INLINE float exp_f(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * from_bits(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

JAXFUSE_INLINE float sigmoid_f(float x) { return 1.0f / (1.0f + exp_f(-x)); }

// tanh: Cephes' odd polynomial below |x| = 0.625 (no cancellation), 1 - 2 / (e^2|x| + 1) above.
JAXFUSE_INLINE float tanh_f(float x) {
  float ax = x < 0.0f ? -x : x;
  float z = x * x;
  float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z
                  + 1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
  float large = 1.0f - 2.0f / (exp_f(2.0f * ax) + 1.0f);
  large = x < 0.0f ? -large : large;
  return ax < 0.625f ? small : large;
}

// erf to 1.5e-7 absolute (Abramowitz and Stegun 7.1.26).
JAXFUSE_INLINE float erf_f(float x) {
  float ax = x < 0.0f ? -x : x;
  float t = 1.0f / (1.0f + 0.3275911f * ax);
  float p = ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t
             + 0.254829592f) * t;
  float y = 1.0f - p * exp_f(-ax * ax);
  return x < 0.0f ? -y : y;
}

// The activations, in the order of jaxfuse.kernels.activations.ACTIVATIONS (the Python side
// passes the index).
enum class Act : int32_t {
  kRelu = 0, kGelu, kGeluTanh, kSilu, kSigmoid, kTanh, kSquaredRelu, kIdentity, kCount
};

// act(x) and act'(x), each where only one is needed.
template <Act A>
JAXFUSE_INLINE float act_value(float x) {
  if constexpr (A == Act::kRelu) return x < 0.0f ? 0.0f : x;   // NaN stays NaN
  if constexpr (A == Act::kGelu) return 0.5f * x * (1.0f + erf_f(x * 0.70710678118654752f));
  if constexpr (A == Act::kGeluTanh) {
    float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanh_f(u));
  }
  if constexpr (A == Act::kSilu) return x * sigmoid_f(x);
  if constexpr (A == Act::kSigmoid) return sigmoid_f(x);
  if constexpr (A == Act::kTanh) return tanh_f(x);
  if constexpr (A == Act::kSquaredRelu) return x < 0.0f ? 0.0f : x * x;
  if constexpr (A == Act::kIdentity) return x;
}

// act(x) and act'(x) together, sharing what they can.
template <Act A>
JAXFUSE_INLINE void act_value_grad(float x, float& value, float& grad) {
  if constexpr (A == Act::kRelu) { value = x < 0.0f ? 0.0f : x; grad = x > 0.0f ? 1.0f : 0.0f; }
  if constexpr (A == Act::kGelu) {
    float cdf = 0.5f * (1.0f + erf_f(x * 0.70710678118654752f));
    value = x * cdf;
    grad = cdf + x * 0.39894228040143268f * exp_f(-0.5f * x * x);
  }
  if constexpr (A == Act::kGeluTanh) {
    float x2 = x * x;
    float t = tanh_f(0.79788456080286536f * (x + 0.044715f * x2 * x));
    value = 0.5f * x * (1.0f + t);
    grad = 0.5f * (1.0f + t)
           + 0.5f * x * (1.0f - t * t) * 0.79788456080286536f * (1.0f + 0.134145f * x2);
  }
  if constexpr (A == Act::kSilu) {
    float s = sigmoid_f(x);
    value = x * s;
    grad = s * (1.0f + x * (1.0f - s));
  }
  if constexpr (A == Act::kSigmoid) { float s = sigmoid_f(x); value = s; grad = s * (1.0f - s); }
  if constexpr (A == Act::kTanh) { float t = tanh_f(x); value = t; grad = 1.0f - t * t; }
  if constexpr (A == Act::kSquaredRelu) {
    value = x < 0.0f ? 0.0f : x * x;
    grad = x < 0.0f ? 0.0f : 2.0f * x;
  }
  if constexpr (A == Act::kIdentity) { value = x; grad = 1.0f; }
}

// Calls fn.template operator()<A>() for the activation index; false if out of range.
template <typename Fn>
bool with_activation(int32_t index, Fn&& fn) {
  switch (static_cast<Act>(index)) {
    case Act::kRelu: fn.template operator()<Act::kRelu>(); return true;
    case Act::kGelu: fn.template operator()<Act::kGelu>(); return true;
    case Act::kGeluTanh: fn.template operator()<Act::kGeluTanh>(); return true;
    case Act::kSilu: fn.template operator()<Act::kSilu>(); return true;
    case Act::kSigmoid: fn.template operator()<Act::kSigmoid>(); return true;
    case Act::kTanh: fn.template operator()<Act::kTanh>(); return true;
    case Act::kSquaredRelu: fn.template operator()<Act::kSquaredRelu>(); return true;
    case Act::kIdentity: fn.template operator()<Act::kIdentity>(); return true;
    default: return false;
  }
}

// Row sums -------------------------------------------------------------------------------------

// sum(a[j] * b[j]) and sum(a[j]) over a row, in 32 float32 lanes that GCC vectorizes (a plain
// float loop would be one serial chain: GCC may not reassociate float additions).
constexpr int64_t kLanes = 32;

JAXFUSE_INLINE float lanes_total(const float* acc) {
  float total = 0.0f;
  for (int64_t k = 0; k < kLanes; ++k) total += acc[k];
  return total;
}

JAXFUSE_INLINE float row_dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[kLanes] = {};
  int64_t body = n - n % kLanes;
  for (int64_t j = 0; j < body; j += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) acc[k] += a[j + k] * b[j + k];
  for (int64_t j = body; j < n; ++j) acc[j - body] += a[j] * b[j];
  return lanes_total(acc);
}

JAXFUSE_INLINE float row_sum(const float* __restrict a, int64_t n) {
  float acc[kLanes] = {};
  int64_t body = n - n % kLanes;
  for (int64_t j = 0; j < body; j += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) acc[k] += a[j + k];
  for (int64_t j = body; j < n; ++j) acc[j - body] += a[j];
  return lanes_total(acc);
}

// The parallel loop ------------------------------------------------------------------------------

// Elements of a chunk of the parallel loop, at least: below this, splitting costs more than
// it saves.
constexpr int64_t kGrain = 1 << 14;

// The rows of width h that make a chunk of at least kGrain elements (at least one).
inline int64_t row_grain(int64_t h) {
  return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, h));
}

// How many chunks of at least `grain` of [0, n) the pool's threads take (at least 1): a few per
// thread, so that a thread that wakes late still finds work.
constexpr int64_t kChunksPerThread = 4;

inline int64_t chunk_count(ffi::ThreadPool& pool, int64_t n, int64_t grain) {
  int64_t workers = std::max<int64_t>(1, pool.num_threads());
  return std::min<int64_t>(kChunksPerThread * workers,
                           std::max<int64_t>(1, n / std::max<int64_t>(1, grain)));
}

// body(chunk, begin, end) for each of `chunks` equal chunks of [0, n), on the calling thread
// and XLA's intra-op pool. The caller takes chunks too and waits only for chunks already
// started, so a pool whose threads are all busy (or all inside such a loop) cannot deadlock
// it: a task that starts late finds nothing left and returns.
template <typename Body>
void parallel_chunks(ffi::ThreadPool& pool, int64_t n, int64_t chunks, const Body& body) {
  if (chunks <= 1) {
    body(int64_t{0}, int64_t{0}, n);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  int64_t size = (n + chunks - 1) / chunks;
  auto drain = [state, size, n, chunks, fn = &body] {
    for (int64_t c; (c = state->next.fetch_add(1)) < chunks;) {
      (*fn)(c, std::min(n, c * size), std::min(n, (c + 1) * size));
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t helpers = std::min<int64_t>(chunks, std::max<int64_t>(1, pool.num_threads())) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    auto task = drain;
    pool.Schedule(std::move(task));
  }
  drain();
  while (state->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

// body(begin, end) over [0, n) in chunks of at least `grain` (see parallel_chunks).
template <typename Body>
void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t grain, const Body& body) {
  parallel_chunks(pool, n, chunk_count(pool, n, grain),
                  [&body](int64_t, int64_t lo, int64_t hi) { body(lo, hi); });
}

}  // namespace jaxfuse

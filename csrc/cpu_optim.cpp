// Fused CPU optimizer steps over one chunk: Adam/AdamW and SGD in a single pass over memory.
//
// Why this exists: with optimizer state offloaded to the host, the step is memory-bound. torch.optim
// walks the chunk several times (one kernel per operation) and mixed precision needs two extra cast
// passes (grad bf16->fp32 before, master fp32->bf16 after). Here each element is loaded once, updated
// and stored once, with the low-precision grad read and the low-precision parameter copy written in
// the same pass.
//
// The arithmetic mirrors torch.optim's single-tensor code operation by operation (same order, a fused
// multiply-add exactly where ATen's vectorised kernels use one, every other result rounded to fp32), so
// results match torch to the last bit or close to it. The file is built with -ffp-contract=off so that
// the compiler does not fuse anything else.
//
// One binary holds three code paths (scalar, AVX2, AVX-512), picked at run time by CPU support. The
// update itself is written once (`adam_vec`, `sgd_vec`) over a small vector interface `V`; each path
// is that template instantiated inside a `#pragma GCC target` region with its own `V`.

#include <torch/extension.h>

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

// The generic templates take and return vector types by value before they are inlined into a function
// built for that ISA; GCC warns about an ABI that is never used because nothing is left out of line.
#pragma GCC diagnostic ignored "-Wpsabi"

#define CHUNKMEM_INLINE inline __attribute__((always_inline))

namespace chunkmem {
namespace {

// Storage type of a stream: the gradient (kF32, kBF16, kF16) or the low-precision copy (kNone: none).
enum class Dt { kNone, kF32, kBF16, kF16 };

// Elements per OpenMP work item: large enough to amortise scheduling, small enough to balance threads.
constexpr int64_t kBlock = 1 << 15;

// Per-element pointers of one chunk. `state1`/`state2` are exp_avg/exp_avg_sq for Adam; SGD uses only
// `state1`, its momentum buffer (null without momentum). `out` is null when no copy is written. The
// update reads master and states from `from_*` and writes them to `master`, `state1`, `state2`: the same
// buffers in place, or others (an update made ahead of the step into spare buffers: chunkmem/runtime/ahead.py).
struct Streams {
  float* master;
  const void* grad;
  float* state1;
  float* state2;
  void* out;
  const float* from_master;
  const float* from1;
  const float* from2;
};

// Adam scalars, already rounded to fp32 the way ATen rounds a Python float it multiplies a tensor by.
struct AdamArgs {
  float scale_inv, weight_decay, decay, beta2, one_minus_beta2, neg_step_size, bc2_sqrt, eps;
  float lerp_coeff;   // ATen's lerp: weight if weight < 0.5, else weight - 1 (anchored at the end)
  bool lerp_small;
  bool maximize, coupled_wd, decoupled_wd;
};

struct SgdArgs {
  float scale_inv, weight_decay, momentum, one_minus_dampening, neg_lr;
  bool maximize, nesterov, first_step;
};

constexpr size_t elem_size(Dt d) { return d == Dt::kF32 ? 4 : (d == Dt::kNone ? 0 : 2); }

// ---- Portable conversions (the scalar path, and the reference for the vector ones) -----------------

CHUNKMEM_INLINE uint32_t bits_of(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
CHUNKMEM_INLINE float float_of(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

CHUNKMEM_INLINE float bf16_to_float(uint16_t h) { return float_of(uint32_t(h) << 16); }

// Round to nearest even, as c10::BFloat16 does; every NaN becomes the quiet NaN 0x7FC0.
CHUNKMEM_INLINE uint16_t float_to_bf16(float x) {
  if (std::isnan(x)) return 0x7FC0;
  const uint32_t u = bits_of(x);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

CHUNKMEM_INLINE float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0x1F) return float_of(sign | 0x7F800000u | (mant << 13));       // inf, nan
  if (exp != 0) return float_of(sign | ((exp + 112u) << 23) | (mant << 13));  // normal
  const float sub = float(mant) * 0x1p-24f;                                    // zero, subnormal
  return sign ? -sub : sub;
}

// IEEE binary16, round to nearest even (what F16C and c10::Half do).
CHUNKMEM_INLINE uint16_t float_to_f16(float x) {
  const uint32_t u = bits_of(x);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;   // nan
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // rounds past 65504: inf
  if (a < 0x38800000u) {                        // below 2^-14: subnormal, the scaling is exact
    return sign | uint16_t(std::nearbyint(float_of(a) * 0x1p24f));
  }
  const uint32_t r = a - (112u << 23);          // rebias the exponent 127 -> 15
  return sign | uint16_t((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
}

// ---- The update, written once over a vector interface V ------------------------------------------
//
// V provides: kWidth, type F, set1, add, sub, mul, div, fma(a, b, c) = a*b + c rounded once, neg,
// sqrt, nonfinite(F) -> bool (any lane inf or nan), load<Dt>(ptr, i) and store<Dt>(ptr, i, F).
//
// Each update returns g - g for its vector: 0 where the (unscaled) gradient is finite, NaN where it is
// inf or nan. The caller sums these and tests the sum once per block, which costs two instructions a
// vector instead of a compare, a mask extraction and a branch.

template <class V, Dt G, Dt O>
CHUNKMEM_INLINE typename V::F adam_vec(const AdamArgs& a, const Streams& s, int64_t i) {
  using F = typename V::F;
  F g = V::mul(V::template load<G>(s.grad, i), V::set1(a.scale_inv));
  if (a.maximize) g = V::neg(g);
  const F bad = V::sub(g, g);
  F p = V::template load<Dt::kF32>(s.from_master, i);
  if (a.coupled_wd) g = V::fma(p, V::set1(a.weight_decay), g);
  if (a.decoupled_wd) p = V::mul(p, V::set1(a.decay));
  F m = V::template load<Dt::kF32>(s.from1, i);
  m = a.lerp_small ? V::fma(V::set1(a.lerp_coeff), V::sub(g, m), m)
                   : V::fma(V::set1(a.lerp_coeff), V::sub(g, m), g);
  // ATen's addcmul_ computes self + (value * t1) * t2, which its build contracts into one FMA.
  F v = V::mul(V::template load<Dt::kF32>(s.from2, i), V::set1(a.beta2));
  v = V::fma(V::mul(V::set1(a.one_minus_beta2), g), g, v);
  const F denom = V::add(V::div(V::sqrt(v), V::set1(a.bc2_sqrt)), V::set1(a.eps));
  p = V::add(p, V::div(V::mul(V::set1(a.neg_step_size), m), denom));
  V::template store<Dt::kF32>(s.state1, i, m);
  V::template store<Dt::kF32>(s.state2, i, v);
  V::template store<Dt::kF32>(s.master, i, p);
  if constexpr (O != Dt::kNone) V::template store<O>(s.out, i, p);
  return bad;
}

template <class V, Dt G, Dt O>
CHUNKMEM_INLINE typename V::F sgd_vec(const SgdArgs& a, const Streams& s, int64_t i) {
  using F = typename V::F;
  F g = V::mul(V::template load<G>(s.grad, i), V::set1(a.scale_inv));
  if (a.maximize) g = V::neg(g);
  const F bad = V::sub(g, g);
  F p = V::template load<Dt::kF32>(s.from_master, i);
  if (a.weight_decay != 0.0f) g = V::fma(p, V::set1(a.weight_decay), g);
  if (s.state1 != nullptr) {
    F buf = g;  // torch clones the gradient into a fresh buffer on the first step: no dampening
    if (!a.first_step) {
      buf = V::mul(V::template load<Dt::kF32>(s.from1, i), V::set1(a.momentum));
      buf = V::fma(g, V::set1(a.one_minus_dampening), buf);
    }
    V::template store<Dt::kF32>(s.state1, i, buf);
    g = a.nesterov ? V::fma(buf, V::set1(a.momentum), g) : buf;
  }
  p = V::fma(g, V::set1(a.neg_lr), p);
  V::template store<Dt::kF32>(s.master, i, p);
  if constexpr (O != Dt::kNone) V::template store<O>(s.out, i, p);
  return bad;
}

// Points every stream of `s` at element `begin`.
template <Dt G, Dt O>
CHUNKMEM_INLINE Streams offset(const Streams& s, int64_t begin) {
  auto shift = [begin](auto* p, size_t size) { return p ? (char*)p + begin * int64_t(size) : nullptr; };
  return {(float*)shift(s.master, 4), shift(s.grad, elem_size(G)), (float*)shift(s.state1, 4),
          (float*)shift(s.state2, 4), shift(s.out, elem_size(O)), (const float*)shift(s.from_master, 4),
          (const float*)shift(s.from1, 4), (const float*)shift(s.from2, 4)};
}

// Software prefetch distance, in elements. With the update's arithmetic between one vector's loads and
// the next, the hardware prefetcher alone leaves the five streams too little in flight: bf16 64M went
// from 1.05-1.12x to 1.01x of benchmarks/adam_floor.cpp on a 2-core EPYC (AVX2; interleaved runs of the
// two builds), where the floor itself gained nothing from the same prefetches.
constexpr int64_t kAhead = 768;

// Asks for the cache lines of element `i` of every stream of `s` (one line holds 16 fp32 elements).
template <Dt G, Dt O>
CHUNKMEM_INLINE void prefetch(const Streams& s, int64_t i) {
  __builtin_prefetch(s.master + i, 1);
  if (s.from_master != s.master) __builtin_prefetch(s.from_master + i, 0);
  __builtin_prefetch(static_cast<const char*>(s.grad) + i * int64_t(elem_size(G)), 0);
  if (s.state1) __builtin_prefetch(s.state1 + i, 1);
  if (s.state2) __builtin_prefetch(s.state2 + i, 1);
  if (s.from1 != s.state1) __builtin_prefetch(s.from1 + i, 0);
  if (s.from2 != s.state2) __builtin_prefetch(s.from2 + i, 0);
  if constexpr (O != Dt::kNone) __builtin_prefetch(static_cast<char*>(s.out) + i * int64_t(elem_size(O)), 1);
}

// Runs `body` over elements [0, n): whole vectors in place, then the last n % kWidth elements through
// a zero-padded copy, so that the tail takes exactly the same arithmetic as the rest.
template <class V, Dt G, Dt O, class Body>
CHUNKMEM_INLINE bool run_range(const Streams& s, int64_t n, Body body) {
  constexpr int64_t W = V::kWidth;
  const int64_t full = n - n % W;
  typename V::F bad = V::set1(0.0f);
  for (int64_t i = 0; i < full; i += W) {
    if (i % 16 == 0 && i + kAhead < n) prefetch<G, O>(s, i + kAhead);
    bad = V::add(bad, body(s, i));
  }
  const int64_t rest = n - full;
  if (rest == 0) return V::nonfinite(bad);
  alignas(64) float master[W] = {}, state1[W] = {}, state2[W] = {}, grad[W] = {}, out[W] = {};
  const Streams t = offset<G, O>(s, full);
  float* const pad1 = t.state1 ? state1 : nullptr;
  float* const pad2 = t.state2 ? state2 : nullptr;
  const Streams pad{master, grad, pad1, pad2, out, master, pad1, pad2};
  std::memcpy(master, t.from_master, rest * 4);
  std::memcpy(grad, t.grad, rest * elem_size(G));
  if (t.state1) std::memcpy(state1, t.from1, rest * 4);
  if (t.state2) std::memcpy(state2, t.from2, rest * 4);
  bad = V::add(bad, body(pad, 0));  // padded lanes hold zeros: finite
  std::memcpy(t.master, master, rest * 4);
  if (t.state1) std::memcpy(t.state1, state1, rest * 4);
  if (t.state2) std::memcpy(t.state2, state2, rest * 4);
  if (t.out) std::memcpy(t.out, out, rest * elem_size(O));
  return V::nonfinite(bad);
}

using AdamFn = bool (*)(const AdamArgs&, const Streams&, int64_t begin, int64_t n);
using SgdFn = bool (*)(const SgdArgs&, const Streams&, int64_t begin, int64_t n);

// The per-ISA entry points: a block [begin, begin + n) of one chunk.
// The lambdas copy the step scalars: read through a reference, they could alias the float streams the
// loop stores to, so the compiler would reload and re-broadcast every scalar and re-test every flag
// on each vector (about twice the instructions per element; the step is then compute-bound).
#define CHUNKMEM_ENTRY_POINTS                                                                  \
  template <Dt G, Dt O>                                                                        \
  bool adam(const AdamArgs& a, const Streams& s, int64_t begin, int64_t n) {                   \
    return run_range<V, G, O>(offset<G, O>(s, begin), n,                                       \
                              [a](const Streams& t, int64_t i) { return adam_vec<V, G, O>(a, t, i); }); \
  }                                                                                            \
  template <Dt G, Dt O>                                                                        \
  bool sgd(const SgdArgs& a, const Streams& s, int64_t begin, int64_t n) {                     \
    return run_range<V, G, O>(offset<G, O>(s, begin), n,                                       \
                              [a](const Streams& t, int64_t i) { return sgd_vec<V, G, O>(a, t, i); }); \
  }

// ---- Scalar path ------------------------------------------------------------------------------------

namespace scalar {
struct V {
  static constexpr int64_t kWidth = 1;
  using F = float;
  static F set1(float x) { return x; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }
  static F neg(F a) { return -a; }
  static F sqrt(F a) { return std::sqrt(a); }
  static bool nonfinite(F a) { return !std::isfinite(a); }
  template <Dt D> static F load(const void* p, int64_t i) {
    if constexpr (D == Dt::kF32) return static_cast<const float*>(p)[i];
    if constexpr (D == Dt::kBF16) return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    if constexpr (D == Dt::kF16) return f16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
  template <Dt D> static void store(void* p, int64_t i, F x) {
    if constexpr (D == Dt::kF32) static_cast<float*>(p)[i] = x;
    if constexpr (D == Dt::kBF16) static_cast<uint16_t*>(p)[i] = float_to_bf16(x);
    if constexpr (D == Dt::kF16) static_cast<uint16_t*>(p)[i] = float_to_f16(x);
  }
};
CHUNKMEM_ENTRY_POINTS
}  // namespace scalar

// ---- AVX2 path (with FMA and F16C, which every AVX2 CPU has) ------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
struct V {
  static constexpr int64_t kWidth = 8;
  using F = __m256;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F neg(F a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static bool nonfinite(F a) {  // a - a is NaN exactly for inf and nan
    const F d = _mm256_sub_ps(a, a);
    return _mm256_movemask_ps(_mm256_cmp_ps(d, d, _CMP_UNORD_Q)) != 0;
  }
  static __m256i bf16_bits(F x) {  // float_to_bf16 on 8 lanes, results in the low half of each lane
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  }
  template <Dt D> static F load(const void* p, int64_t i) {
    if constexpr (D == Dt::kF32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (D == Dt::kBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    if constexpr (D == Dt::kF16) return _mm256_cvtph_ps(h);
  }
  template <Dt D> static void store(void* p, int64_t i, F x) {
    if constexpr (D == Dt::kF32) { _mm256_storeu_ps(static_cast<float*>(p) + i, x); return; }
    __m128i h;
    if constexpr (D == Dt::kBF16) {
      const __m256i b = bf16_bits(x);
      h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    }
    if constexpr (D == Dt::kF16) h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), h);
  }
};
CHUNKMEM_ENTRY_POINTS
}  // namespace avx2
#pragma GCC pop_options

// ---- AVX-512 path (AVX-512F only: conversions narrow with vpmovdw, no 16-bit lane arithmetic) ---------

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized (its _mm512_undefined_* placeholders).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace avx512 {
struct V {
  static constexpr int64_t kWidth = 16;
  using F = __m512;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F neg(F a) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
  }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static bool nonfinite(F a) {
    const F d = _mm512_sub_ps(a, a);
    return _mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q) != 0;
  }
  template <Dt D> static F load(const void* p, int64_t i) {
    if constexpr (D == Dt::kF32) return _mm512_loadu_ps(static_cast<const float*>(p) + i);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (D == Dt::kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    if constexpr (D == Dt::kF16) return _mm512_cvtph_ps(h);
  }
  template <Dt D> static void store(void* p, int64_t i, F x) {
    if constexpr (D == Dt::kF32) { _mm512_storeu_ps(static_cast<float*>(p) + i, x); return; }
    __m256i h;
    if constexpr (D == Dt::kBF16) {
      const __m512i u = _mm512_castps_si512(x);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
      r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
      h = _mm512_cvtepi32_epi16(r);
    }
    if constexpr (D == Dt::kF16) h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i), h);
  }
};
CHUNKMEM_ENTRY_POINTS
}  // namespace avx512
#pragma GCC diagnostic pop
#pragma GCC pop_options

// ---- Dispatch -------------------------------------------------------------------------------------------

std::vector<std::string> supported_isas() {
  std::vector<std::string> isas{"scalar"};
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (avx2) isas.push_back("avx2");
  if (avx2 && __builtin_cpu_supports("avx512f")) isas.push_back("avx512");
  return isas;
}

// "auto" is the widest path this CPU runs; a named path the CPU lacks is an error, not a fallback,
// so that a test forcing a path never silently measures another one.
std::string resolve_isa(const std::string& isa) {
  const std::vector<std::string> have = supported_isas();
  if (isa == "auto") return have.back();
  for (const auto& h : have) if (h == isa) return isa;
  std::string list;
  for (const auto& h : have) list += (list.empty() ? "" : ", ") + h;
  TORCH_CHECK(false, "isa='", isa, "' is not available on this CPU (it supports: ", list,
              "); pass isa='auto' or one of those");
}

Dt dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat: return Dt::kF32;
    case torch::kBFloat16: return Dt::kBF16;
    case torch::kHalf: return Dt::kF16;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type(), "; use float32, bfloat16 or float16");
  }
}

// Instantiates `Table::pick<G, O>()` for the 3 x 3 combinations of grad and output dtype.
template <class Table>
auto pick(Dt g, Dt o) {
  auto with_out = [o](auto gtag) {
    constexpr Dt G = decltype(gtag)::value;
    if (o == Dt::kBF16) return Table::template pick<G, Dt::kBF16>();
    if (o == Dt::kF16) return Table::template pick<G, Dt::kF16>();
    return Table::template pick<G, Dt::kNone>();
  };
  if (g == Dt::kBF16) return with_out(std::integral_constant<Dt, Dt::kBF16>{});
  if (g == Dt::kF16) return with_out(std::integral_constant<Dt, Dt::kF16>{});
  return with_out(std::integral_constant<Dt, Dt::kF32>{});
}

template <class Fn, template <class> class Of>
Fn kernel_for(const std::string& isa, Dt g, Dt o) {
  if (isa == "avx512") return pick<Of<avx512::V>>(g, o);
  if (isa == "avx2") return pick<Of<avx2::V>>(g, o);
  return pick<Of<scalar::V>>(g, o);
}

template <class V> struct AdamTable;
template <class V> struct SgdTable;
#define CHUNKMEM_TABLES(ns)                                                                        \
  template <> struct AdamTable<ns::V> {                                                            \
    template <Dt G, Dt O> static AdamFn pick() { return &ns::adam<G, O>; }                         \
  };                                                                                               \
  template <> struct SgdTable<ns::V> {                                                             \
    template <Dt G, Dt O> static SgdFn pick() { return &ns::sgd<G, O>; }                           \
  };
CHUNKMEM_TABLES(scalar)
CHUNKMEM_TABLES(avx2)
CHUNKMEM_TABLES(avx512)

// Splits [0, n) into kBlock-sized blocks over `threads` threads (0: torch's thread count); true if any block saw a
// bad grad.
template <class Fn, class Args>
bool parallel_blocks(Fn fn, const Args& args, const Streams& s, int64_t n, int64_t threads) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  if (blocks <= 1) return fn(args, s, 0, n);
  int bad = 0;
  const int team = threads > 0 ? int(threads) : at::get_num_threads();
#pragma omp parallel for schedule(dynamic) reduction(| : bad) num_threads(team)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock;
    bad |= int(fn(args, s, begin, std::min(kBlock, n - begin)));
  }
  return bad != 0;
}

// ---- Python-facing functions (chunkmem/native.py validates first; these checks are a backstop) -----

void check_chunk(const torch::Tensor& t, const char* name, int64_t n, bool fp32) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == 1, name,
              " must be a contiguous 1-D CPU tensor, got shape ", t.sizes(), " on ", t.device());
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements, the master chunk has ", n);
  TORCH_CHECK(!fp32 || t.scalar_type() == torch::kFloat, name, " must be float32, got ", t.scalar_type());
}

Dt out_dtype(const c10::optional<torch::Tensor>& out, int64_t n) {
  if (!out.has_value()) return Dt::kNone;
  check_chunk(*out, "param_out", n, false);
  const Dt d = dtype_of(*out);
  TORCH_CHECK(d != Dt::kF32, "param_out must be bfloat16 or float16; an fp32 copy is the master itself");
  return d;
}

bool adam_step(torch::Tensor master, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
               c10::optional<torch::Tensor> param_out, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool decoupled, int64_t step, double grad_scale_inv, bool maximize,
               const std::string& isa, c10::optional<torch::Tensor> master_to,
               c10::optional<torch::Tensor> exp_avg_to, c10::optional<torch::Tensor> exp_avg_sq_to, int64_t threads) {
  const int64_t n = master.numel();
  check_chunk(master, "master", n, true);
  check_chunk(grad, "grad", n, false);
  check_chunk(exp_avg, "exp_avg", n, true);
  check_chunk(exp_avg_sq, "exp_avg_sq", n, true);
  const bool into = master_to.has_value();
  TORCH_CHECK(exp_avg_to.has_value() == into && exp_avg_sq_to.has_value() == into,
              "master_to, exp_avg_to and exp_avg_sq_to go together: give all three or none");
  if (into) {
    check_chunk(*master_to, "master_to", n, true);
    check_chunk(*exp_avg_to, "exp_avg_to", n, true);
    check_chunk(*exp_avg_sq_to, "exp_avg_sq_to", n, true);
  }
  TORCH_CHECK(step >= 1, "step must be >= 1 (the count after this step), got ", step);
  const Dt o = out_dtype(param_out, n);
  // Step scalars in double, as torch.optim computes them in Python, then rounded once to fp32.
  const double bc1 = 1.0 - std::pow(beta1, double(step));
  const double bc2 = 1.0 - std::pow(beta2, double(step));
  const float weight = float(1.0 - beta1);
  AdamArgs a{};
  a.scale_inv = float(grad_scale_inv);
  a.weight_decay = float(weight_decay);
  a.decay = float(1.0 - lr * weight_decay);
  a.beta2 = float(beta2);
  a.one_minus_beta2 = float(1.0 - beta2);
  a.neg_step_size = float(-(lr / bc1));
  a.bc2_sqrt = float(std::pow(bc2, 0.5));
  a.eps = float(eps);
  a.lerp_small = std::abs(weight) < 0.5f;
  a.lerp_coeff = a.lerp_small ? weight : weight - 1.0f;
  a.maximize = maximize;
  a.coupled_wd = weight_decay != 0.0 && !decoupled;
  a.decoupled_wd = weight_decay != 0.0 && decoupled;
  float* const m = master.data_ptr<float>();
  float* const e1 = exp_avg.data_ptr<float>();
  float* const e2 = exp_avg_sq.data_ptr<float>();
  const Streams s{into ? master_to->data_ptr<float>() : m, grad.data_ptr(),
                  into ? exp_avg_to->data_ptr<float>() : e1, into ? exp_avg_sq_to->data_ptr<float>() : e2,
                  param_out ? param_out->data_ptr() : nullptr, m, e1, e2};
  return parallel_blocks(kernel_for<AdamFn, AdamTable>(resolve_isa(isa), dtype_of(grad), o), a, s, n, threads);
}

bool sgd_step(torch::Tensor master, torch::Tensor grad, c10::optional<torch::Tensor> momentum_buf,
              c10::optional<torch::Tensor> param_out, double lr, double momentum, double dampening,
              double weight_decay, bool nesterov, bool maximize, bool first_step, double grad_scale_inv,
              const std::string& isa) {
  const int64_t n = master.numel();
  check_chunk(master, "master", n, true);
  check_chunk(grad, "grad", n, false);
  TORCH_CHECK(momentum_buf.has_value() == (momentum != 0.0),
              "momentum_buf must be given exactly when momentum != 0 (momentum=", momentum, ")");
  if (momentum_buf) check_chunk(*momentum_buf, "momentum_buf", n, true);
  const Dt o = out_dtype(param_out, n);
  const SgdArgs a{float(grad_scale_inv), float(weight_decay), float(momentum), float(1.0 - dampening),
                  float(-lr), maximize, nesterov, first_step};
  float* const buf = momentum_buf ? momentum_buf->data_ptr<float>() : nullptr;
  const Streams s{master.data_ptr<float>(), grad.data_ptr(), buf, nullptr,
                  param_out ? param_out->data_ptr() : nullptr, master.data_ptr<float>(), buf, nullptr};
  return parallel_blocks(kernel_for<SgdFn, SgdTable>(resolve_isa(isa), dtype_of(grad), o), a, s, n, 0);
}

}  // namespace
}  // namespace chunkmem

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace pybind11::literals;
  m.doc() = "chunkmem's fused CPU optimizer steps (see chunkmem/native.py for the typed wrappers)";
  m.def("adam_step", &chunkmem::adam_step, "Adam/AdamW step over one chunk, in place or into other buffers",
        "master"_a, "grad"_a, "exp_avg"_a, "exp_avg_sq"_a, "param_out"_a, "lr"_a, "beta1"_a, "beta2"_a, "eps"_a,
        "weight_decay"_a, "decoupled"_a, "step"_a, "grad_scale_inv"_a, "maximize"_a, "isa"_a,
        "master_to"_a = pybind11::none(), "exp_avg_to"_a = pybind11::none(), "exp_avg_sq_to"_a = pybind11::none(),
        "threads"_a = 0,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("sgd_step", &chunkmem::sgd_step, "SGD step over one chunk, in place", "master"_a, "grad"_a,
        "momentum_buf"_a, "param_out"_a, "lr"_a, "momentum"_a, "dampening"_a, "weight_decay"_a,
        "nesterov"_a, "maximize"_a, "first_step"_a, "grad_scale_inv"_a, "isa"_a,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("supported_isas", &chunkmem::supported_isas, "Code paths this CPU can run, narrowest first");
}

// The memory-traffic floor of one Adam step over a chunk: Adam's reads and writes, and no arithmetic.
//
// Why this exists: benchmarks/cpu_adam.py judges csrc/cpu_optim.cpp against what its memory traffic
// alone costs. This file moves exactly the bytes one fused Adam step must move, element by element:
// the gradient (4 or 2 bytes) read; master, exp_avg and exp_avg_sq (4 bytes each) read and written
// back; the low-precision parameter copy (2 bytes, or none) written. What is written is what was read
// (the copy gets the low half of the master's register), so nothing is computed, and an empty asm
// statement between the loads and the stores hides that from the compiler, which would otherwise drop
// the stores of unchanged values and the loads nobody uses.
//
// It is written apart from the kernel it judges (no shared code) but built the same way: the flags of
// chunkmem.memory.native.CFLAGS, torch's OpenMP team, 32768-element blocks scheduled dynamically, and
// scalar, AVX2 (8 lanes) and AVX-512 (16 lanes) loops picked at run time, with plain (not streaming)
// stores. A step that does the same work in the same way cannot be faster than this.

#include <torch/extension.h>

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <string>

#pragma GCC diagnostic ignored "-Wpsabi"

namespace {

constexpr int64_t kBlock = 1 << 15;  // elements per OpenMP work item, as the optimizer kernel uses

// Byte pointers of one chunk; `out` is null when no low-precision copy is written.
struct Chunk {
  char* master;
  const char* grad;
  char* exp_avg;
  char* exp_avg_sq;
  char* out;
};

// Elements [begin, end) one at a time, as whole integers: the scalar path, and every path's tail.
template <int64_t G, int64_t O>
void sweep_scalar(const Chunk c, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    uint32_t p, m, v, g = 0;
    std::memcpy(&p, c.master + 4 * i, 4);
    std::memcpy(&m, c.exp_avg + 4 * i, 4);
    std::memcpy(&v, c.exp_avg_sq + 4 * i, 4);
    std::memcpy(&g, c.grad + G * i, G);
    asm volatile("" : "+r"(p), "+r"(m), "+r"(v), "+r"(g));
    std::memcpy(c.master + 4 * i, &p, 4);
    std::memcpy(c.exp_avg + 4 * i, &m, 4);
    std::memcpy(c.exp_avg_sq + 4 * i, &v, 4);
    if constexpr (O != 0) std::memcpy(c.out + O * i, &p, O);
  }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
template <int64_t G, int64_t O>
void sweep_avx2(const Chunk c, int64_t begin, int64_t end) {
  const int64_t full = begin + (end - begin) / 8 * 8;
  for (int64_t i = begin; i < full; i += 8) {
    __m256 p = _mm256_loadu_ps(reinterpret_cast<const float*>(c.master) + i);
    __m256 m = _mm256_loadu_ps(reinterpret_cast<const float*>(c.exp_avg) + i);
    __m256 v = _mm256_loadu_ps(reinterpret_cast<const float*>(c.exp_avg_sq) + i);
    if constexpr (G == 4) {
      __m256 g = _mm256_loadu_ps(reinterpret_cast<const float*>(c.grad) + i);
      asm volatile("" : "+v"(p), "+v"(m), "+v"(v), "+v"(g));
    } else {
      __m128i g = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c.grad + 2 * i));
      asm volatile("" : "+v"(p), "+v"(m), "+v"(v), "+v"(g));
    }
    _mm256_storeu_ps(reinterpret_cast<float*>(c.master) + i, p);
    _mm256_storeu_ps(reinterpret_cast<float*>(c.exp_avg) + i, m);
    _mm256_storeu_ps(reinterpret_cast<float*>(c.exp_avg_sq) + i, v);
    if constexpr (O == 2) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(c.out + 2 * i), _mm256_castsi256_si128(_mm256_castps_si256(p)));
    }
  }
  sweep_scalar<G, O>(c, full, end);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
template <int64_t G, int64_t O>
void sweep_avx512(const Chunk c, int64_t begin, int64_t end) {
  const int64_t full = begin + (end - begin) / 16 * 16;
  for (int64_t i = begin; i < full; i += 16) {
    __m512 p = _mm512_loadu_ps(reinterpret_cast<const float*>(c.master) + i);
    __m512 m = _mm512_loadu_ps(reinterpret_cast<const float*>(c.exp_avg) + i);
    __m512 v = _mm512_loadu_ps(reinterpret_cast<const float*>(c.exp_avg_sq) + i);
    if constexpr (G == 4) {
      __m512 g = _mm512_loadu_ps(reinterpret_cast<const float*>(c.grad) + i);
      asm volatile("" : "+v"(p), "+v"(m), "+v"(v), "+v"(g));
    } else {
      __m256i g = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.grad + 2 * i));
      asm volatile("" : "+v"(p), "+v"(m), "+v"(v), "+v"(g));
    }
    _mm512_storeu_ps(reinterpret_cast<float*>(c.master) + i, p);
    _mm512_storeu_ps(reinterpret_cast<float*>(c.exp_avg) + i, m);
    _mm512_storeu_ps(reinterpret_cast<float*>(c.exp_avg_sq) + i, v);
    if constexpr (O == 2) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c.out + 2 * i), _mm512_castsi512_si256(_mm512_castps_si512(p)));
    }
  }
  sweep_scalar<G, O>(c, full, end);
}
#pragma GCC pop_options

// The chunk is taken by value: through a reference, the byte stores could alias its pointers, which the
// compiler would then reload on every vector.
using Sweep = void (*)(Chunk, int64_t, int64_t);

template <int64_t G, int64_t O>
Sweep sweep_for(const std::string& isa) {
  if (isa == "avx512") return &sweep_avx512<G, O>;
  if (isa == "avx2") return &sweep_avx2<G, O>;
  return &sweep_scalar<G, O>;
}

bool cpu_has(const std::string& isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == "scalar") return true;
  if (isa == "avx2") return avx2;
  if (isa == "avx512") return avx2 && __builtin_cpu_supports("avx512f");
  return false;
}

void check(const torch::Tensor& t, const char* name, int64_t n, int64_t itemsize) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == 1 && t.numel() == n &&
              int64_t(t.element_size()) == itemsize, name, " must be a contiguous 1-D CPU tensor of ", n,
              " elements of ", itemsize, " bytes, got shape ", t.sizes(), " of ", t.scalar_type());
}

// One sweep over the chunk with Adam's traffic. `isa` names the path ("scalar", "avx2", "avx512");
// the caller resolves "auto".
void adam_traffic(torch::Tensor master, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                  c10::optional<torch::Tensor> param_out, const std::string& isa) {
  const int64_t n = master.numel();
  check(master, "master", n, 4);
  check(exp_avg, "exp_avg", n, 4);
  check(exp_avg_sq, "exp_avg_sq", n, 4);
  const int64_t g = grad.element_size(), o = param_out ? param_out->element_size() : 0;
  TORCH_CHECK(g == 4 || g == 2, "grad must have 4- or 2-byte elements, got ", g);
  TORCH_CHECK(o == 0 || o == 2, "param_out must have 2-byte elements, got ", o);
  check(grad, "grad", n, g);
  if (param_out) check(*param_out, "param_out", n, 2);
  TORCH_CHECK(cpu_has(isa), "isa='", isa, "' is not a path this CPU runs");
  const Sweep sweep = g == 4 ? (o ? sweep_for<4, 2>(isa) : sweep_for<4, 0>(isa))
                             : (o ? sweep_for<2, 2>(isa) : sweep_for<2, 0>(isa));
  const Chunk c{static_cast<char*>(master.data_ptr()), static_cast<const char*>(grad.data_ptr()),
                static_cast<char*>(exp_avg.data_ptr()), static_cast<char*>(exp_avg_sq.data_ptr()),
                param_out ? static_cast<char*>(param_out->data_ptr()) : nullptr};
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  if (blocks <= 1) return sweep(c, 0, n);
#pragma omp parallel for schedule(dynamic) num_threads(at::get_num_threads())
  for (int64_t b = 0; b < blocks; ++b) sweep(c, b * kBlock, std::min(n, (b + 1) * kBlock));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace pybind11::literals;
  m.def("adam_traffic", &adam_traffic, "Adam's reads and writes over one chunk, no arithmetic", "master"_a,
        "grad"_a, "exp_avg"_a, "exp_avg_sq"_a, "param_out"_a, "isa"_a,
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

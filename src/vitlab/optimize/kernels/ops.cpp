// vitlab's fp32 CPU kernels, as PyTorch operators: torch.ops.vitlab_kernels.* (HiLo's two attention cores, a
// decoder's causal prompt attention, and a linear layer against a prepacked weight)
//
// Built by torch.utils.cpp_extension (vitlab/optimize/kernels/__init__.py) with -O3 -fopenmp and no -march: the
// kernel bodies (simd.h, hilo_body.h, causal_body.h, gemm_body.h) are compiled twice, once for AVX2 + FMA (what -mavx2 -mfma
// gives) and once for AVX-512 (F, DQ, BW, VL), each in its own namespace under `#pragma GCC target`. Each call
// runs the path its `isa` argument names (512 or 2): the Python side passes ATen's CPU capability
// (torch.backends.cpu.get_cpu_capability(): the CPU's best, or what ATEN_CPU_CAPABILITY asks), so
// ATEN_CPU_CAPABILITY=avx2 runs the AVX2 code on an AVX-512 machine. Work is split with OpenMP on PyTorch's
// own libgomp threads (at::get_num_threads()).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <vector>

#if !defined(__x86_64__) || !defined(__GNUC__)
#error "vitlab's CPU kernels need an x86-64 GCC-compatible compiler"
#endif

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace vitlab_avx2 {
#define VW 8
#define RB 12
#include "simd.h"
#include "hilo_body.h"
#include "causal_body.h"
#include "gemm_body.h"
#undef INLINE
#undef VW
#undef RB
}  // namespace vitlab_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")
namespace vitlab_avx512 {
#define VW 16
#define RB 24
#include "simd.h"
#include "hilo_body.h"
#include "causal_body.h"
#include "gemm_body.h"
#undef INLINE
#undef VW
#undef RB
}  // namespace vitlab_avx512
#pragma GCC pop_options

namespace {

void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.stride(-1) == 1, "vitlab_kernels: ", name,
              " must be an fp32 CPU tensor with a contiguous last dimension");
}

void check_rc(int rc, const char* name) {
  TORCH_CHECK(rc != 1, "vitlab_kernels::", name, ": unsupported shape");
  TORCH_CHECK(rc != 2, "vitlab_kernels::", name, ": out of memory");
}

// softmax(q k^T * scale) v: q (B, H, N, D), k and v (B, H, M, D) with equal strides. Returns (B, H, N, D) laid out
// as (B, N, H, D), as PyTorch's CPU SDPA.
at::Tensor lofi_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, int64_t isa) {
  check(q, "q"), check(k, "k"), check(v, "v");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && k.strides() == v.strides() &&
                  q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "vitlab_kernels::lofi_attention: q (B, H, N, D), k and v (B, H, M, D) with equal strides");
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), M = k.size(2), D = q.size(3);
  at::Tensor out = at::empty({B, N, H, D}, q.options()).transpose(1, 2);
  if (out.numel() == 0) return out;
  TORCH_CHECK(isa == 512 || isa == 2, "vitlab_kernels: isa must be 512 (AVX-512) or 2 (AVX2), got ", isa);
  auto fn = isa == 512 ? vitlab_avx512::lofi_attention : vitlab_avx2::lofi_attention;
  check_rc(fn(q.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr<float>(), v.data_ptr<float>(),
              k.stride(0), k.stride(1), k.stride(2), out.data_ptr<float>(), out.stride(0), out.stride(1),
              out.stride(2), B, H, N, M, D, (float)scale, at::get_num_threads()),
           "lofi_attention");
  return out;
}

// attention inside the window x window windows of qkv (B, H, W, 3 * heads * D) (q, k, v of each head in that
// channel order); returns (B, H, W, heads * D), contiguous
at::Tensor window_attention(const at::Tensor& qkv, int64_t window, int64_t heads, double scale,
                            int64_t isa) {
  check(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 4 && heads > 0 && qkv.size(3) % (3 * heads) == 0,
              "vitlab_kernels::window_attention: qkv (B, H, W, 3 * heads * D)");
  const int64_t B = qkv.size(0), H = qkv.size(1), W = qkv.size(2), D = qkv.size(3) / (3 * heads);
  at::Tensor out = at::empty({B, H, W, heads * D}, qkv.options());
  if (out.numel() == 0) return out;
  TORCH_CHECK(isa == 512 || isa == 2, "vitlab_kernels: isa must be 512 (AVX-512) or 2 (AVX2), got ", isa);
  auto fn = isa == 512 ? vitlab_avx512::hifi_attention : vitlab_avx2::hifi_attention;
  const int64_t hd = heads * D;
  check_rc(fn(qkv.data_ptr<float>(), qkv.stride(0), qkv.stride(1), qkv.stride(2), 0, hd, 2 * hd,
              out.data_ptr<float>(), out.stride(0), out.stride(1), out.stride(2), B, H, W, window, heads, D,
              (float)scale, at::get_num_threads()),
           "window_attention");
  return out;
}

// causal self-attention of a prompt from position 0 (query i sees keys 0 .. i): q (B, Hq, N, D), k and v
// (B, Hkv, N, D), Hq a multiple of Hkv (grouped-query). Returns (B, Hq, N, D) laid out as (B, N, Hq, D), as
// PyTorch's CPU SDPA.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            int64_t isa) {
  check(q, "q"), check(k, "k"), check(v, "v");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2) && q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "vitlab_kernels::causal_attention: q (B, Hq, N, D), k and v (B, Hkv, N, D), Hq a multiple of Hkv");
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  at::Tensor out = at::empty({B, N, H, D}, q.options()).transpose(1, 2);
  if (out.numel() == 0) return out;
  TORCH_CHECK(isa == 512 || isa == 2, "vitlab_kernels: isa must be 512 (AVX-512) or 2 (AVX2), got ", isa);
  auto fn = isa == 512 ? vitlab_avx512::causal_attention : vitlab_avx2::causal_attention;
  check_rc(fn(q.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr<float>(), k.stride(0),
              k.stride(1), k.stride(2), v.data_ptr<float>(), v.stride(0), v.stride(1), v.stride(2),
              out.data_ptr<float>(), out.stride(0), out.stride(1), out.stride(2), B, H, k.size(1), N, D,
              (float)scale, at::get_num_threads()),
           "causal_attention");
  return out;
}

// x (..., K) W^T + bias, W (N, K) prepacked into panels of 2 vector widths of features for the `isa` path
// (packed: (ceil(N / NR), K, NR), gemm_body.h). Returns (..., N), contiguous. With `glu`, W stacks a SwiGLU's gate
// rows over its value rows (2N of them, bias 2N), packed as gemm_body.h's glu says (ceil(N / VW), K, NR), and the
// result is silu(gate) * value, (..., N).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features, int64_t isa, bool glu) {
  check(x, "x"), check(packed, "packed");
  TORCH_CHECK(isa == 512 || isa == 2, "vitlab_kernels: isa must be 512 (AVX-512) or 2 (AVX2), got ", isa);
  TORCH_CHECK(x.dim() >= 1, "vitlab_kernels::packed_linear: x must be (..., K)");
  const int64_t nr = isa == 512 ? vitlab_avx512::NR : vitlab_avx2::NR, width = glu ? nr / 2 : nr;
  const int64_t K = x.size(-1), N = out_features, panels = (N + width - 1) / width;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && K > 0 && N > 0 && packed.size(0) == panels &&
                  packed.size(1) == K && packed.size(2) == nr,
              "vitlab_kernels::packed_linear: packed must be (ceil(N / ", width, "), K, ", nr,
              ") for N = out_features and x (..., K), got ", packed.sizes(), " and ", x.sizes());
  at::Tensor init;  // the bias in the panels' order, padded: panels x NR floats
  if (bias) {
    check(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == (glu ? 2 : 1) * N,
                "vitlab_kernels::packed_linear: bias must be (", (glu ? 2 : 1) * N, ",)");
    if (glu) {  // gate and value features of each panel side by side
      const at::Tensor halves = bias->view({2, N});
      init = at::constant_pad_nd(halves, {0, panels * width - N}).view({2, panels, width}).transpose(0, 1);
      init = init.contiguous();
    } else {
      init = at::constant_pad_nd(*bias, {0, panels * nr - N});
    }
  }
  const at::Tensor rows = x.reshape({-1, K});  // a view where the rows are evenly strided, else a copy
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  if (out.numel() == 0) return out;
  auto fn = isa == 512 ? vitlab_avx512::packed_linear : vitlab_avx2::packed_linear;
  check_rc(fn(rows.data_ptr<float>(), rows.stride(0), packed.data_ptr<float>(),
              bias ? init.data_ptr<float>() : nullptr, out.data_ptr<float>(), rows.size(0), (int)K, (int)N, glu,
              at::get_num_threads()),
           "packed_linear");
  return out;
}

}  // namespace

TORCH_LIBRARY(vitlab_kernels, m) {
  m.def("lofi_attention(Tensor q, Tensor k, Tensor v, float scale, int isa) -> Tensor");
  m.def("window_attention(Tensor qkv, int window, int heads, float scale, int isa) -> Tensor");
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale, int isa) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features, int isa, bool glu=False) -> "
        "Tensor");
}

TORCH_LIBRARY_IMPL(vitlab_kernels, CPU, m) {
  m.impl("lofi_attention", &lofi_attention);
  m.impl("window_attention", &window_attention);
  m.impl("causal_attention", &causal_attention);
  m.impl("packed_linear", &packed_linear);
}

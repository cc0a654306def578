// Python binding of the GEMM ladder: each function fills a preallocated C (so callers can poison it).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <array>

#include "gemm_kernels.h"

namespace {

using Launcher = const char* (*)(const void*, const void*, void*, int, int, int, cudaStream_t);

// A[M,K] @ B[K,N] -> C[M,N], all contiguous 2-D bf16 CUDA tensors; returns {M, N, K}
std::array<int, 3> check_operands(const torch::Tensor& A, const torch::Tensor& B, const torch::Tensor& C) {
  for (const torch::Tensor* t : {&A, &B, &C}) {
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kBFloat16 && t->is_contiguous() && t->dim() == 2,
                "A, B, C must be contiguous 2-D bf16 CUDA tensors");
  }
  const auto M = A.size(0), K = A.size(1), N = B.size(1);
  TORCH_CHECK(B.size(0) == K && C.size(0) == M && C.size(1) == N, "shapes must be A[M,K], B[K,N], C[M,N]");
  return {static_cast<int>(M), static_cast<int>(N), static_cast<int>(K)};
}

template <Launcher launch>
void run(const torch::Tensor& A, const torch::Tensor& B, const torch::Tensor& C) {  // C: written in place
  const auto [M, N, K] = check_operands(A, B, C);
  const c10::cuda::CUDAGuard guard(A.device());
  const char* err = launch(A.data_ptr(), B.data_ptr(), C.data_ptr(), M, N, K, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, err);
}

#ifdef GEMM_WGMMA
// bias: [N] bf16 on A's device
void check_bias(const torch::Tensor& bias, const torch::Tensor& A, const torch::Tensor& B) {
  TORCH_CHECK(bias.is_cuda() && bias.scalar_type() == torch::kBFloat16 && bias.is_contiguous() && bias.dim() == 1 &&
                  bias.size(0) == B.size(1) && bias.device() == A.device(),
              "bias must be a contiguous 1-D bf16 CUDA tensor of B.size(1) elements");
}

// C = GELU_tanh(A @ B + bias), bias: [N] bf16
void run_bias_gelu(const torch::Tensor& A, const torch::Tensor& B, const torch::Tensor& bias, const torch::Tensor& C) {
  check_bias(bias, A, B);
  const auto [M, N, K] = check_operands(A, B, C);
  const c10::cuda::CUDAGuard guard(A.device());
  const char* err = gemm_wgmma_persistent_bias_gelu(A.data_ptr(), B.data_ptr(), bias.data_ptr(), C.data_ptr(), M, N,
                                                    K, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, err);
}

// AUX: [M,N] bf16 like C (the pre-activation)
void check_aux(const torch::Tensor& AUX, const torch::Tensor& A, const torch::Tensor& C) {
  TORCH_CHECK(AUX.is_cuda() && AUX.scalar_type() == torch::kBFloat16 && AUX.is_contiguous() && AUX.dim() == 2 &&
                  AUX.sizes() == C.sizes() && AUX.device() == A.device(),
              "AUX must be a contiguous 2-D bf16 CUDA tensor shaped like C");
}

// C = GELU_tanh(A @ B + bias) and AUX = A @ B + bias, bias: [N] bf16, AUX: [M,N] bf16
void run_bias_gelu_aux(const torch::Tensor& A, const torch::Tensor& B, const torch::Tensor& bias,
                       const torch::Tensor& C, const torch::Tensor& AUX) {
  check_bias(bias, A, B);
  check_aux(AUX, A, C);
  const auto [M, N, K] = check_operands(A, B, C);
  const c10::cuda::CUDAGuard guard(A.device());
  const char* err = gemm_wgmma_persistent_bias_gelu_aux(A.data_ptr(), B.data_ptr(), bias.data_ptr(), C.data_ptr(),
                                                        AUX.data_ptr(), M, N, K, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, err);
}

// C = (A @ B) * GELU_tanh'(AUX), DBIAS += column sums of C (fp32; the caller zeroes it), AUX: [M,N] bf16,
// DBIAS: [N] fp32
void run_dgelu(const torch::Tensor& A, const torch::Tensor& B, const torch::Tensor& AUX, const torch::Tensor& C,
               const torch::Tensor& DBIAS) {
  TORCH_CHECK(DBIAS.is_cuda() && DBIAS.scalar_type() == torch::kFloat32 && DBIAS.is_contiguous() &&
                  DBIAS.dim() == 1 && DBIAS.size(0) == B.size(1) && DBIAS.device() == A.device(),
              "DBIAS must be a contiguous 1-D fp32 CUDA tensor of B.size(1) elements");
  check_aux(AUX, A, C);
  const auto [M, N, K] = check_operands(A, B, C);
  const c10::cuda::CUDAGuard guard(A.device());
  const char* err =
      gemm_wgmma_persistent_dgelu(A.data_ptr(), B.data_ptr(), AUX.data_ptr(), C.data_ptr(),
                                  DBIAS.data_ptr<float>(), M, N, K, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == nullptr, err);
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#ifdef GEMM_WGMMA  // the second, sm_90a-only extension (gemm_wgmma.cu), see mlp.py and benchmarks/gemm/bench.py
  m.def("wgmma", &run<gemm_wgmma>, "wgmma.mma_async + TMA + mbarrier pipeline, 128x256 tile (sm_90a)");
  m.def("wgmma_persistent", &run<gemm_wgmma_persistent>,
        "persistent wgmma + TMA, 128x256 tile, shared-memory + TMA-store epilogue (sm_90a)");
  m.def("wgmma_persistent_bias_gelu", &run_bias_gelu, "wgmma_persistent with bias + GELU(tanh) in the epilogue");
  m.def("wgmma_persistent_bias_gelu_aux", &run_bias_gelu_aux,
        "wgmma_persistent_bias_gelu that also writes AUX = A @ B + bias (the pre-activation)");
  m.def("wgmma_persistent_dgelu", &run_dgelu,
        "wgmma_persistent with GELU(tanh)'s backward (C = A @ B * GELU'(AUX)) and the bias gradient in the epilogue");
#else
  m.def("naive", &run<gemm_naive>, "global-memory GEMM, one thread per output");
  m.def("smem", &run<gemm_smem>, "32x32 shared-memory tiling");
  m.def("regblock", &run<gemm_regblock>, "128x128 tile, 8x8 register blocking, vector loads");
  m.def("wmma", &run<gemm_wmma>, "WMMA tensor cores, 128x128 tile");
  m.def("mma_128x128", &run<gemm_mma_128x128>, "mma.sync + ldmatrix + 4-stage cp.async, 128x128 tile");
  m.def("mma_128x256", &run<gemm_mma_128x256>, "mma.sync + ldmatrix + 4-stage cp.async, 128x256 tile");
#endif
}

// Launchers of the GEMM ladder (benchmarks/gemm/gemm_kernels.cu; gemm_wgmma*.cu here for the wgmma kernels): C[M,N] = A[M,K] @ B[K,N],
// row-major bf16, fp32 accumulation.
// Each returns nullptr on a successful launch, else an error message.
#pragma once
#include <cuda_runtime.h>

#define GEMM_LAUNCHER(name) const char* name(const void* A, const void* B, void* C, int M, int N, int K, cudaStream_t s)
GEMM_LAUNCHER(gemm_naive);
GEMM_LAUNCHER(gemm_smem);
GEMM_LAUNCHER(gemm_regblock);
GEMM_LAUNCHER(gemm_wmma);
GEMM_LAUNCHER(gemm_mma_128x128);
GEMM_LAUNCHER(gemm_mma_128x256);
GEMM_LAUNCHER(gemm_wgmma);  // sm_90a only: its own extension (mlp.py), built on Hopper
GEMM_LAUNCHER(gemm_wgmma_persistent);  // sm_90a only (gemm_wgmma_persistent.cu), same extension
// C = GELU_tanh(A @ B + bias), bias[N] bf16: the MLP up-projection with its epilogue fused (sm_90a only)
const char* gemm_wgmma_persistent_bias_gelu(const void* A, const void* B, const void* bias, void* C, int M, int N,
                                            int K, cudaStream_t s);
// Training's MLP up-projection, fused forward and backward (sm_90a only). Forward: C = GELU_tanh(A @ B + bias) and
// AUX[M,N] = A @ B + bias (bf16, the pre-activation the backward needs).
const char* gemm_wgmma_persistent_bias_gelu_aux(const void* A, const void* B, const void* bias, void* C, void* AUX,
                                                int M, int N, int K, cudaStream_t s);
// Backward: C = (A @ B) * GELU_tanh'(AUX), AUX[M,N] bf16, and DBIAS[N] (fp32, zeroed by the caller) += the column
// sums of C before its rounding to bf16.
const char* gemm_wgmma_persistent_dgelu(const void* A, const void* B, const void* AUX, void* C, float* DBIAS, int M,
                                        int N, int K, cudaStream_t s);
#undef GEMM_LAUNCHER

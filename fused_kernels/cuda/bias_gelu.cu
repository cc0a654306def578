// Fused bias + GELU (GPT-2's tanh form), forward and backward, for fp32 / fp16 / bf16.
//
//   forward:  y  = gelu(x + b)
//   backward: dx = dy * gelu'(x + b)      (db = sum_rows dx is reduced by the caller)
//   gelu(z)  = 0.5 z (1 + tanh(u)),  u = sqrt(2/pi) (z + 0.044715 z^3)
//   gelu'(z) = 0.5 (1 + t) + 0.5 z (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 z^2),  t = tanh(u)
//
// x is a contiguous [M, N] tensor and b a contiguous [N] vector. Each thread moves 16 bytes per
// load/store (4 floats or 8 halves) when N and every pointer allow it, else one element; math is fp32.
// Plain CUDA (no PyTorch headers): bias_gelu.cpp checks tensors and calls the launchers below.
// Built for sm_80 and sm_90 by fused_kernels/cuda/__init__.py (torch.utils.cpp_extension.load).

#include "bias_gelu.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluC = 0.044715f;
constexpr int kThreads = 256;

// tanh(u) in the precision the output dtype needs: the full-precision tanhf for fp32 (the hardware
// tanh.approx has ~2^-11 relative error, far above fp32's, which showed in fp32 dx on a GPU: docs/decisions.md);
// tanh.approx for fp16 / bf16, whose own rounding (2^-11 / 2^-8) is as large, at a fraction of the ALU cost.
// The file is built without --use_fast_math, so plain tanhf is never silently approximated.
template <typename T>
__device__ __forceinline__ float tanh_t(float u) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(u));
  return t;
}
template <>
__device__ __forceinline__ float tanh_t<float>(float u) { return tanhf(u); }

template <typename T>
__device__ __forceinline__ float gelu(float z) {
  return 0.5f * z * (1.f + tanh_t<T>(kSqrt2OverPi * (z + kGeluC * z * z * z)));
}

template <typename T>
__device__ __forceinline__ float gelu_grad(float z) {
  const float z2 = z * z;
  const float t = tanh_t<T>(kSqrt2OverPi * (z + kGeluC * z2 * z));
  return 0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kGeluC * z2);
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// VEC elements moved as one aligned load/store: 16 bytes when VEC = 16 / sizeof(T).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// n_packs = numel / VEC, cols_packs = N / VEC; VEC divides N, so a pack never straddles two rows.
template <typename T, int VEC>
__global__ void bias_gelu_fwd_kernel(const T* __restrict__ x, const T* __restrict__ b, T* __restrict__ y,
                                     int64_t n_packs, int64_t cols_packs) {
  using P = Pack<T, VEC>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_packs; i += stride) {
    const P xp = reinterpret_cast<const P*>(x)[i];
    const P bp = reinterpret_cast<const P*>(b)[i % cols_packs];
    P out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = from_float<T>(gelu<T>(to_float(xp.v[j]) + to_float(bp.v[j])));
    reinterpret_cast<P*>(y)[i] = out;
  }
}

template <typename T, int VEC>
__global__ void bias_gelu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ b,
                                     T* __restrict__ dx, int64_t n_packs, int64_t cols_packs) {
  using P = Pack<T, VEC>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_packs; i += stride) {
    const P dyp = reinterpret_cast<const P*>(dy)[i];
    const P xp = reinterpret_cast<const P*>(x)[i];
    const P bp = reinterpret_cast<const P*>(b)[i % cols_packs];
    P out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      out.v[j] = from_float<T>(to_float(dyp.v[j]) * gelu_grad<T>(to_float(xp.v[j]) + to_float(bp.v[j])));
    }
    reinterpret_cast<P*>(dx)[i] = out;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Grid for a grid-stride loop: enough blocks to fill every SM several times, no more.
cudaError_t num_blocks(int64_t n_packs, int* blocks) {
  int device = 0;
  int sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t wanted = (n_packs + kThreads - 1) / kThreads;
  *blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, static_cast<int64_t>(sms) * 32)));
  return err;
}

template <typename T>
cudaError_t launch_fwd(const void* x, const void* b, void* y, int64_t numel, int64_t cols, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = cols % kVec == 0 && aligned16(x) && aligned16(b) && aligned16(y);
  const int64_t packs = vec ? numel / kVec : numel;
  int blocks = 0;
  if (cudaError_t err = num_blocks(packs, &blocks); err != cudaSuccess) return err;
  const T* xp = static_cast<const T*>(x);
  const T* bp = static_cast<const T*>(b);
  T* yp = static_cast<T*>(y);
  if (vec) {
    bias_gelu_fwd_kernel<T, kVec><<<blocks, kThreads, 0, stream>>>(xp, bp, yp, packs, cols / kVec);
  } else {
    bias_gelu_fwd_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(xp, bp, yp, packs, cols);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_bwd(const void* dy, const void* x, const void* b, void* dx, int64_t numel, int64_t cols,
                       cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = cols % kVec == 0 && aligned16(dy) && aligned16(x) && aligned16(b) && aligned16(dx);
  const int64_t packs = vec ? numel / kVec : numel;
  int blocks = 0;
  if (cudaError_t err = num_blocks(packs, &blocks); err != cudaSuccess) return err;
  const T* dyp = static_cast<const T*>(dy);
  const T* xp = static_cast<const T*>(x);
  const T* bp = static_cast<const T*>(b);
  T* dxp = static_cast<T*>(dx);
  if (vec) {
    bias_gelu_bwd_kernel<T, kVec><<<blocks, kThreads, 0, stream>>>(dyp, xp, bp, dxp, packs, cols / kVec);
  } else {
    bias_gelu_bwd_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(dyp, xp, bp, dxp, packs, cols);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t bias_gelu_forward_launch(const void* x, const void* bias, void* y, int64_t numel, int64_t cols,
                                     BiasGeluDtype dtype, cudaStream_t stream) {
  switch (dtype) {
    case BiasGeluDtype::kFloat32: return launch_fwd<float>(x, bias, y, numel, cols, stream);
    case BiasGeluDtype::kFloat16: return launch_fwd<__half>(x, bias, y, numel, cols, stream);
    case BiasGeluDtype::kBFloat16: return launch_fwd<__nv_bfloat16>(x, bias, y, numel, cols, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t bias_gelu_backward_launch(const void* dy, const void* x, const void* bias, void* dx, int64_t numel,
                                      int64_t cols, BiasGeluDtype dtype, cudaStream_t stream) {
  switch (dtype) {
    case BiasGeluDtype::kFloat32: return launch_bwd<float>(dy, x, bias, dx, numel, cols, stream);
    case BiasGeluDtype::kFloat16: return launch_bwd<__half>(dy, x, bias, dx, numel, cols, stream);
    case BiasGeluDtype::kBFloat16: return launch_bwd<__nv_bfloat16>(dy, x, bias, dx, numel, cols, stream);
  }
  return cudaErrorInvalidValue;
}

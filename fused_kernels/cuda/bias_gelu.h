// Launchers of the fused bias + GELU kernels (bias_gelu.cu), callable from C++ without CUDA headers
// beyond the runtime API. Pointers are to contiguous device memory: x, y, dy, dx [numel], bias [cols].
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

enum class BiasGeluDtype { kFloat32, kFloat16, kBFloat16 };

cudaError_t bias_gelu_forward_launch(const void* x, const void* bias, void* y, int64_t numel, int64_t cols,
                                     BiasGeluDtype dtype, cudaStream_t stream);

cudaError_t bias_gelu_backward_launch(const void* dy, const void* x, const void* bias, void* dx, int64_t numel,
                                      int64_t cols, BiasGeluDtype dtype, cudaStream_t stream);

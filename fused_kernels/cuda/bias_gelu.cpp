// Python binding of the fused bias + GELU CUDA kernels: tensor checks, dtype dispatch and the current
// stream live here; the kernels and their launchers in bias_gelu.cu.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "bias_gelu.h"

namespace {

BiasGeluDtype dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return BiasGeluDtype::kFloat32;
    case at::kHalf: return BiasGeluDtype::kFloat16;
    case at::kBFloat16: return BiasGeluDtype::kBFloat16;
    default: TORCH_CHECK(false, "bias_gelu: dtype must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(x.is_cuda() && bias.is_cuda(), "bias_gelu: x and bias must be CUDA tensors");
  TORCH_CHECK(x.is_contiguous() && bias.is_contiguous(), "bias_gelu: x and bias must be contiguous");
  TORCH_CHECK(x.scalar_type() == bias.scalar_type(), "bias_gelu: x and bias must share a dtype");
  TORCH_CHECK(x.dim() >= 1 && bias.dim() == 1 && x.size(-1) == bias.size(0),
              "bias_gelu: bias must be [N] for x [..., N]");
}

at::Tensor forward(const at::Tensor& x, const at::Tensor& bias) {
  check_inputs(x, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  if (x.numel() == 0) return y;
  C10_CUDA_CHECK(bias_gelu_forward_launch(x.const_data_ptr(), bias.const_data_ptr(), y.mutable_data_ptr(), x.numel(),
                                          bias.numel(), dtype_of(x), c10::cuda::getCurrentCUDAStream()));
  return y;
}

at::Tensor backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& bias) {
  check_inputs(x, bias);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type() && dy.is_contiguous(),
              "bias_gelu: dy must be contiguous, with x's shape and dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  if (x.numel() == 0) return dx;
  C10_CUDA_CHECK(bias_gelu_backward_launch(dy.const_data_ptr(), x.const_data_ptr(), bias.const_data_ptr(),
                                           dx.mutable_data_ptr(), x.numel(), bias.numel(), dtype_of(x),
                                           c10::cuda::getCurrentCUDAStream()));
  return dx;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "y = gelu_tanh(x + bias)");
  m.def("backward", &backward, "dx = dy * gelu_tanh'(x + bias)");
}

// The CUDA kernel of torch.ops.fastpals.solve_weights: one launch of one block per solve, on the Gram's stream.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>

#include "solve_weights_kernel.cuh"

namespace fastpals {

int method_code(const std::string& method);
void check_inputs(const at::Tensor& gram, int code, const c10::optional<at::Tensor>& vec,
                  at::ArrayRef<double> params, const c10::optional<at::Tensor>& state);

at::Tensor solve_weights_cuda(const at::Tensor& gram, const std::string& method,
                              const c10::optional<at::Tensor>& vec, at::ArrayRef<double> params,
                              const c10::optional<at::Tensor>& state) {
  const int code = method_code(method);
  check_inputs(gram, code, vec, params, state);
  const int t = static_cast<int>(gram.size(0));
  c10::cuda::CUDAGuard guard(gram.device());
  auto f64 = gram.options().dtype(at::kDouble);
  at::Tensor g = gram.to(at::kDouble).contiguous();
  at::Tensor v = vec.has_value() ? vec->to(f64).contiguous() : at::zeros({vec_size(code, t)}, f64);
  double p[NUM_PARAMS] = {0.0, 0.0, 0.0};
  for (size_t i = 0; i < params.size(); ++i) p[i] = params[i];
  at::Tensor w = at::empty({t}, f64);
  const int64_t need = kernel_workspace_size(code, t);
  int limit = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, gram.get_device()));
  const int64_t bytes = need * int64_t(sizeof(double));
  const bool shared = bytes <= limit;
  at::Tensor ws = at::empty({shared ? 0 : need}, f64);
  if (shared && bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(solve_weights_kernel<double>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  auto stream = c10::cuda::getCurrentCUDAStream();
  solve_weights_kernel<double><<<1, 32, shared ? bytes : 0, stream>>>(
      code, g.data_ptr<double>(), t, v.data_ptr<double>(), p[0], p[1], p[2], w.data_ptr<double>(),
      shared ? nullptr : ws.data_ptr<double>(), shared, state.has_value() ? state->data_ptr<double>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return w.to(gram.scalar_type());
}

}  // namespace fastpals

TORCH_LIBRARY_IMPL(fastpals, CUDA, m) { m.impl("solve_weights", &fastpals::solve_weights_cuda); }

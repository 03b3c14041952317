// torch.ops.fastpals.solve_weights: the op's schema and its CPU kernel (one call of fastpals::solve_weights per
// solve, in float64). The CUDA kernel of the same op is in solve_weights_cuda.cu; the fake (shape) function is
// registered from Python (fastpals/surgery/compiled.py).
#include <torch/library.h>
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "solvers.h"

namespace fastpals {

int method_code(const std::string& method) {
  static const char* names[NUM_METHODS] = {"imtlg",  "alignedmtl", "upgrad", "dualproj", "gem",
                                           "mgda",   "alpha_fair", "gradvac", "pcgrad",  "cagrad",
                                           "sum",    "mean",       "constant", "random",  "pcd",
                                           "modo",   "sdmgrad",    "krum"};
  for (int i = 0; i < NUM_METHODS; ++i)
    if (method == names[i]) return i;
  TORCH_CHECK(false, "solve_weights: unknown method '", method,
              "'; choose one of imtlg, alignedmtl, upgrad, dualproj, gem, mgda, alpha_fair, gradvac, pcgrad, "
              "cagrad, sum, mean, constant, random, pcd, modo, sdmgrad, krum");
  return -1;
}

void check_inputs(const at::Tensor& gram, int code, const c10::optional<at::Tensor>& vec,
                  at::ArrayRef<double> params, const c10::optional<at::Tensor>& state) {
  TORCH_CHECK(gram.dim() == 2 && gram.size(0) == gram.size(1) && gram.size(0) > 0,
              "solve_weights: gram must be a non-empty square [T, T] matrix, got ", gram.sizes());
  TORCH_CHECK(gram.scalar_type() == at::kFloat || gram.scalar_type() == at::kDouble,
              "solve_weights: gram must be float32 or float64, got ", gram.scalar_type());
  const int t = static_cast<int>(gram.size(0));
  TORCH_CHECK(!vec.has_value() || vec->numel() == vec_size(code, t), "solve_weights: vec must hold ",
              vec_size(code, t), " values for this method, got ", vec.has_value() ? vec->numel() : 0);
  TORCH_CHECK(params.size() <= NUM_PARAMS, "solve_weights: at most ", NUM_PARAMS, " params, got ", params.size());
  if (code == GRADVAC)
    TORCH_CHECK(state.has_value() && state->scalar_type() == at::kDouble && state->is_contiguous() &&
                    state->numel() == int64_t(t) * t && state->device() == gram.device(),
                "solve_weights: gradvac needs state, a contiguous float64 [T, T] tensor on the Gram's device");
  if (code == MODO || code == SDMGRAD)
    TORCH_CHECK(state.has_value() && state->scalar_type() == at::kDouble && state->is_contiguous() &&
                    state->numel() == t && state->device() == gram.device(),
                "solve_weights: modo and sdmgrad need state, a contiguous float64 [T] tensor on the Gram's device");
}

at::Tensor solve_weights_cpu(const at::Tensor& gram, const std::string& method,
                             const c10::optional<at::Tensor>& vec, at::ArrayRef<double> params,
                             const c10::optional<at::Tensor>& state) {
  const int code = method_code(method);
  check_inputs(gram, code, vec, params, state);
  const int t = static_cast<int>(gram.size(0));
  auto f64 = gram.options().dtype(at::kDouble);
  at::Tensor g = gram.to(at::kDouble).contiguous();
  at::Tensor v = vec.has_value() ? vec->to(f64).contiguous() : at::zeros({vec_size(code, t)}, f64);
  double p[NUM_PARAMS] = {0.0, 0.0, 0.0};
  for (size_t i = 0; i < params.size(); ++i) p[i] = params[i];
  at::Tensor w = at::empty({t}, f64);
  at::Tensor ws = at::empty({solve_workspace_size(code, t)}, f64);
  solve_weights<double>(code, g.data_ptr<double>(), t, v.data_ptr<double>(), p, w.data_ptr<double>(),
                        ws.data_ptr<double>(), state.has_value() ? state->data_ptr<double>() : nullptr);
  return w.to(gram.scalar_type());
}

}  // namespace fastpals

TORCH_LIBRARY_FRAGMENT(fastpals, m) {
  m.def("solve_weights(Tensor gram, str method, Tensor? vec, float[] params, Tensor(a!)? state=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastpals, CPU, m) { m.impl("solve_weights", &fastpals::solve_weights_cpu); }

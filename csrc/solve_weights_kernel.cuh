// The CUDA kernel of torch.ops.fastpals.solve_weights, without torch headers (tests/test_compiled_solve.py
// compiles it standalone with nvcc for sm_75, sm_80 and sm_90). One block per solve; thread 0 runs the
// sequential solver of solvers.h on the Gram, its vectors and its workspace, copied into the block's dynamic
// shared memory when `shared` (the launcher checks that they fit), else in the global workspace `ws`.
#pragma once

#include "solvers.h"

namespace fastpals {

template <typename S>
__global__ void solve_weights_kernel(int method, const S* __restrict__ g, int t, const S* __restrict__ vec,
                                     S p0, S p1, S p2, S* __restrict__ w, S* __restrict__ ws, bool shared,
                                     S* __restrict__ state) {
  extern __shared__ unsigned char smem_raw[];
  if (threadIdx.x != 0) return;
  const S params[NUM_PARAMS] = {p0, p1, p2};
  const int64_t work = solve_workspace_size(method, t);
  S* base = shared ? reinterpret_cast<S*>(smem_raw) : ws;
  S* gs = base + work;          // t x t
  S* vs = gs + int64_t(t) * t;  // vec_size(method, t)
  S* out = vs + vec_size(method, t);  // t
  for (int64_t i = 0; i < int64_t(t) * t; ++i) gs[i] = g[i];
  for (int64_t i = 0; i < vec_size(method, t); ++i) vs[i] = vec[i];
  solve_weights<S>(method, gs, t, vs, params, out, base, state);
  for (int i = 0; i < t; ++i) w[i] = out[i];
}

// elements of S the kernel needs in shared memory (or in ws) for one solve
inline int64_t kernel_workspace_size(int method, int t) {
  return solve_workspace_size(method, t) + int64_t(t) * t + vec_size(method, t) + int64_t(t);
}

}  // namespace fastpals

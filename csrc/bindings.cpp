// Python bindings of fastpals._C: validate tensors, then call the launchers in surgery_kernels.cu.
// The caller (fastpals/cuda_ext.py) passes the current CUDA stream as an integer handle and has made the
// buffer's device current; this file needs only torch's CPU-side headers.
#include <torch/extension.h>

#include <cstdint>
#include <tuple>

extern "C" int fastpals_grid_blocks(int64_t P);
extern "C" int fastpals_gram_partial(const void* buf, int dtype, int T, int64_t P, float* partial, int* bad,
                                     int blocks, void* stream);
extern "C" int fastpals_combine(const void* buf, int dtype, int T, int64_t P, const float* w, void* out,
                                int blocks, void* stream);
extern "C" const char* fastpals_error_string(int code);

namespace {

constexpr int64_t kMaxTasks = 16;

int dtype_code(const at::Tensor& t, const char* fn) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default: TORCH_CHECK(false, fn, ": buffer dtype must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return -1;
}

void check_buffer(const at::Tensor& buf, const char* fn) {
  TORCH_CHECK(buf.is_cuda(), fn, ": buffer must be a CUDA tensor, got ", buf.device());
  TORCH_CHECK(buf.dim() == 2, fn, ": buffer must be [T, P], got ", buf.dim(), " dims");
  TORCH_CHECK(buf.is_contiguous(), fn, ": buffer must be contiguous");
  TORCH_CHECK(buf.size(0) >= 1 && buf.size(0) <= kMaxTasks, fn, ": T must be in [1, ", kMaxTasks, "], got ",
              buf.size(0));
}

void check_status(int code, const char* fn) {
  TORCH_CHECK(code == 0, fn, ": CUDA error: ", fastpals_error_string(code));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> gram(const at::Tensor& buf, int64_t stream) {
  check_buffer(buf, "fastpals._C.gram");
  const int code = dtype_code(buf, "fastpals._C.gram");
  const int64_t T = buf.size(0), P = buf.size(1);
  const int64_t pairs = T * (T + 1) / 2;
  const int blocks = fastpals_grid_blocks(P);
  auto partial = at::empty({blocks, pairs}, buf.options().dtype(at::kFloat));
  auto bad = at::empty({blocks}, buf.options().dtype(at::kInt));
  check_status(fastpals_gram_partial(buf.data_ptr(), code, static_cast<int>(T), P, partial.data_ptr<float>(),
                                     bad.data_ptr<int>(), blocks, reinterpret_cast<void*>(stream)),
               "fastpals._C.gram");
  auto upper = partial.sum(0);  // fixed-order reduction of the block partials
  auto idx = at::triu_indices(T, T, 0, buf.options().dtype(at::kLong));
  auto G = at::zeros({T, T}, upper.options());
  G.index_put_({idx[0], idx[1]}, upper);
  G.index_put_({idx[1], idx[0]}, upper);
  return {G, bad.sum().eq(0)};
}

void combine(const at::Tensor& buf, const at::Tensor& weights, at::Tensor& out, int64_t stream) {
  check_buffer(buf, "fastpals._C.combine");
  const int code = dtype_code(buf, "fastpals._C.combine");
  TORCH_CHECK(weights.device() == buf.device(), "fastpals._C.combine: weights on ", weights.device(),
              " but buffer on ", buf.device());
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.dim() == 1 && weights.size(0) == buf.size(0),
              "fastpals._C.combine: weights must be float32 [T]");
  TORCH_CHECK(out.device() == buf.device() && out.is_contiguous() && out.dim() == 1 && out.size(0) == buf.size(1) &&
                  out.scalar_type() == buf.scalar_type(),
              "fastpals._C.combine: out must be a contiguous [P] tensor of the buffer's dtype and device");
  auto w = weights.contiguous();
  const int blocks = fastpals_grid_blocks(buf.size(1));
  check_status(fastpals_combine(buf.data_ptr(), code, static_cast<int>(buf.size(0)), buf.size(1),
                                w.data_ptr<float>(), out.data_ptr(), blocks, reinterpret_cast<void*>(stream)),
               "fastpals._C.combine");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastpals CUDA extension: Gram matrix and weighted combination of per-task gradients";
  m.def("gram", &gram, "(G [T, T] fp32, all_finite) for buf [T, P] (T <= 16)", py::arg("buf"), py::arg("stream"));
  m.def("combine", &combine, "out = weights @ buf", py::arg("buf"), py::arg("weights"), py::arg("out"),
        py::arg("stream"));
}

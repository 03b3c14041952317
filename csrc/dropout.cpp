// torch.ops.fastpals.dropout_mask: inverted dropout with its keep mask read from 16-bit slices of random words,
// plus an optional residual, in one pass over the data (CPU). The arithmetic is the PyTorch ops' of
// fastpals_kernels.dropout.dropout_reference, element by element in the same order and roundings, so its results
// are bit-identical to them.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace fastpals {

// bfloat16 <-> float by bit arithmetic, branch-free so that the loops vectorize: widening is exact, narrowing
// rounds to nearest even (a NaN becomes the quiet NaN 0x7FC0), as c10::BFloat16 does.
inline float widen(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t narrow(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(rounded ^ ((rounded ^ 0x7FC0u) & (0u - nan)));
}

// Element i is kept when slice i of the words (little-endian int16) is at least `threshold`.
// mask_first (forward): y = (x * keep) * scale, each product rounded to the dtype; else (backward: the gradient
// of that forward, as autograd forms it): y = (x * scale) * keep. Then y + residual, rounded to the dtype.
// S: the storage type, load/store: its conversions to and from the math type M.
// The keep flag is computed without a branch (1 - sign bit of slice - threshold) so that the loops vectorize.
template <typename S, typename M, typename Load, typename Store>
void dropout_mask_kernel(const S* __restrict x, const int16_t* __restrict slices, const S* __restrict residual,
                         S* __restrict out, int64_t n, int64_t threshold, double scale, bool mask_first, Load load,
                         Store store) {
  const M s = static_cast<M>(scale);
  const int32_t t = static_cast<int32_t>(threshold);
  auto keep = [&](int64_t i) { return M((static_cast<uint32_t>(int32_t(slices[i]) - t) >> 31) ^ 1u); };
  at::parallel_for(0, n, 1 << 15, [&](int64_t begin, int64_t end) {
    if (mask_first) {
      for (int64_t i = begin; i < end; ++i) out[i] = store(load(store(load(x[i]) * keep(i))) * s);
    } else {
      for (int64_t i = begin; i < end; ++i) out[i] = store(load(store(load(x[i]) * s)) * keep(i));
    }
    if (residual != nullptr)
      for (int64_t i = begin; i < end; ++i) out[i] = store(load(out[i]) + load(residual[i]));
  });
}

at::Tensor dropout_mask_cpu(const at::Tensor& x, const at::Tensor& words, int64_t threshold, double scale,
                            bool mask_first, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(words.scalar_type() == at::kLong && words.is_contiguous() && words.numel() * 4 >= x.numel(),
              "dropout_mask: words must be a contiguous int64 tensor of at least ceil(x.numel() / 4) values");
  TORCH_CHECK(!residual.has_value() || (residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type()),
              "dropout_mask: residual must have x's shape and dtype");
  const at::Tensor input = x.contiguous();
  const at::Tensor res = residual.has_value() ? residual->contiguous() : at::Tensor();
  at::Tensor out = at::empty_like(input, at::MemoryFormat::Contiguous);
  const auto* slices = reinterpret_cast<const int16_t*>(words.data_ptr<int64_t>());
  const int64_t n = input.numel();
  if (input.scalar_type() == at::kBFloat16) {
    const auto* r = res.defined() ? reinterpret_cast<const uint16_t*>(res.data_ptr()) : nullptr;
    dropout_mask_kernel<uint16_t, float>(reinterpret_cast<const uint16_t*>(input.data_ptr()), slices, r,
                                         reinterpret_cast<uint16_t*>(out.data_ptr()), n, threshold, scale,
                                         mask_first, [](uint16_t v) { return widen(v); },
                                         [](float v) { return narrow(v); });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kHalf, input.scalar_type(), "dropout_mask", [&] {
    using M = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    dropout_mask_kernel<scalar_t, M>(input.data_ptr<scalar_t>(), slices,
                                     res.defined() ? res.data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(), n,
                                     threshold, scale, mask_first, [](scalar_t v) { return static_cast<M>(v); },
                                     [](M v) { return static_cast<scalar_t>(v); });
  });
  return out;
}

}  // namespace fastpals

TORCH_LIBRARY_FRAGMENT(fastpals, m) {
  m.def(
      "dropout_mask(Tensor x, Tensor words, int threshold, float scale, bool mask_first, Tensor? residual) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(fastpals, CPU, m) { m.impl("dropout_mask", &fastpals::dropout_mask_cpu); }

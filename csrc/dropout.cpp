// torch.ops.fastpals.dropout_mask: inverted dropout with its keep mask read from 16-bit slices of random words,
// plus an optional residual, in one pass over the data (CPU). The arithmetic is the PyTorch ops' of
// fastpals_kernels.dropout.dropout_reference, element by element in the same order and roundings, so its results
// are bit-identical to them.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <mutex>
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

// Element i is kept when slice i of the words (little-endian int16) is at least `threshold`: 1 - the sign bit of
// slice - threshold, without a branch so that the loops vectorize.
// mask_first (forward): y = (x * keep) * scale, each product rounded to the dtype; else (backward: the gradient
// of that forward, as autograd forms it): y = (x * scale) * keep. Then y + residual, rounded to the dtype.
// S: the storage type; load/store: its conversions to and from the math type M.
template <typename S, typename M, typename Load, typename Store>
inline void dropout_mask_chunk(const S* __restrict x, const int16_t* __restrict slices, const S* __restrict residual,
                               S* __restrict out, int64_t n, int32_t threshold, M scale, bool mask_first, Load load,
                               Store store) {
  auto keep = [&](int64_t i) { return M((static_cast<uint32_t>(int32_t(slices[i]) - threshold) >> 31) ^ 1u); };
  if (mask_first) {
    for (int64_t i = 0; i < n; ++i) out[i] = store(load(store(load(x[i]) * keep(i))) * scale);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = store(load(store(load(x[i]) * scale)) * keep(i));
  }
  if (residual != nullptr)
    for (int64_t i = 0; i < n; ++i) out[i] = store(load(out[i]) + load(residual[i]));
}

// The bfloat16 chunk, compiled for AVX-512 and AVX2 as well (GCC on x86-64), picked at load time for the CPU.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTPALS_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FASTPALS_CPU_CLONES
#endif

FASTPALS_CPU_CLONES void dropout_mask_bf16(
    const uint16_t* x, const int16_t* slices, const uint16_t* residual, uint16_t* out, int64_t n, int32_t threshold,
    float scale, bool mask_first) {
  dropout_mask_chunk<uint16_t, float>(x, slices, residual, out, n, threshold, scale, mask_first,
                                      [](uint16_t v) { return widen(v); }, [](float v) { return narrow(v); });
}

template <typename S, typename Chunk>
void parallel_chunks(int64_t n, Chunk chunk) {
  at::parallel_for(0, n, 1 << 15, [&](int64_t begin, int64_t end) { chunk(begin, end - begin); });
}

// torch's mt19937 (at::mt19937) advanced in bulk: the 32-bit outputs n_0, n_1, ... of the engine's state
// `state` as calling the engine would give them, tempered in vectorisable loops.
void next_state(uint32_t* p) {
  constexpr int N = at::MERSENNE_STATE_N, M = at::MERSENNE_STATE_M;
  auto twist = [](uint32_t u, uint32_t v) {
    return (((u & at::UMASK) | (v & at::LMASK)) >> 1) ^ ((0u - (v & 1u)) & at::MATRIX_A);
  };
  for (int j = 0; j < N - M; ++j) p[j] = p[j + M] ^ twist(p[j], p[j + 1]);
  for (int j = N - M; j < N - 1; ++j) p[j] = p[j + M - N] ^ twist(p[j], p[j + 1]);
  p[N - 1] = p[M - 1] ^ twist(p[N - 1], p[0]);
}

FASTPALS_CPU_CLONES void temper(const uint32_t* __restrict state, uint32_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t y = state[i];
    y ^= (y >> 11);
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    out[i] = y ^ (y >> 18);
  }
}

// `n` int64 words drawn from the default CPU generator exactly as torch.empty(n, dtype=int64).random_(-2**63)
// draws them (each word: the first 32-bit output in its high half, the second in its low half), in bulk.
at::Tensor dropout_words(int64_t n) {
  TORCH_CHECK(n >= 0, "dropout_words: n must be >= 0, got ", n);
  at::Tensor words = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  auto* out = reinterpret_cast<uint32_t*>(words.data_ptr<int64_t>());
  auto* gen = at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  at::mt19937 engine = gen->engine();
  at::mt19937_data_pod d = engine.data();
  for (int64_t done = 0, total = 2 * n; done < total;) {
    if (d.left_ == 1) {  // the engine's next call twists first and then reads element 0
      next_state(d.state_.data());
      d.left_ = at::MERSENNE_STATE_N + 1;
      d.next_ = 0;
    }
    const int64_t take = std::min<int64_t>(total - done, d.left_ - 1);
    temper(d.state_.data() + d.next_, out + done, take);
    d.next_ += static_cast<uint32_t>(take);
    d.left_ -= static_cast<int>(take);
    done += take;
  }
  for (int64_t i = 0; i < n; ++i) std::swap(out[2 * i], out[2 * i + 1]);  // little-endian: low half first
  engine.set_data(d);
  gen->set_engine(engine);
  return words;
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
  const auto t = static_cast<int32_t>(threshold);
  if (input.scalar_type() == at::kBFloat16) {
    const auto* xs = reinterpret_cast<const uint16_t*>(input.data_ptr());
    const auto* rs = res.defined() ? reinterpret_cast<const uint16_t*>(res.data_ptr()) : nullptr;
    auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
    parallel_chunks<uint16_t>(n, [&](int64_t i, int64_t len) {
      dropout_mask_bf16(xs + i, slices + i, rs ? rs + i : nullptr, os + i, len, t, float(scale), mask_first);
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kHalf, input.scalar_type(), "dropout_mask", [&] {
    using M = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* xs = input.data_ptr<scalar_t>();
    const scalar_t* rs = res.defined() ? res.data_ptr<scalar_t>() : nullptr;
    scalar_t* os = out.data_ptr<scalar_t>();
    parallel_chunks<scalar_t>(n, [&](int64_t i, int64_t len) {
      dropout_mask_chunk<scalar_t, M>(xs + i, slices + i, rs ? rs + i : nullptr, os + i, len, t, M(scale), mask_first,
                                      [](scalar_t v) { return static_cast<M>(v); },
                                      [](M v) { return static_cast<scalar_t>(v); });
    });
  });
  return out;
}

}  // namespace fastpals

TORCH_LIBRARY_FRAGMENT(fastpals, m) {
  m.def(
      "dropout_mask(Tensor x, Tensor words, int threshold, float scale, bool mask_first, Tensor? residual) "
      "-> Tensor");
  m.def("dropout_words(int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastpals, CPU, m) { m.impl("dropout_mask", &fastpals::dropout_mask_cpu); }

TORCH_LIBRARY_IMPL(fastpals, CompositeExplicitAutograd, m) { m.impl("dropout_words", &fastpals::dropout_words); }

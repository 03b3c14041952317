// torch.ops.fastpals.packed_attention(_backward): BERT's softmax self-attention over packed rows on the CPU, one
// (sequence, head) at a time with no padding: q, k, v [N, H, Dh] (any row and head strides, unit stride along Dh),
// sequence b being rows cu_seqlens[b] to cu_seqlens[b + 1]. The arithmetic follows
// fastpals_kernels.attention_varlen.packed_attention_reference: scores rounded to the dtype, then fp32 scale and
// softmax, probabilities rounded to the dtype, dropout ((p * keep) * drop_scale, each product rounded), and
// products accumulated in fp32 and rounded once. The keep mask of (sequence b, head h, query i, key j) is the
// 16-bit slice words_layout[b][0] + (h * R + i) * R + j of the random words, R = words_layout[b][1], kept when the
// slice is at least `threshold`. The forward saves each row's softmax max and sum; the backward recomputes the
// probabilities from them.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <tuple>
#include <vector>

namespace fastpals {
namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTPALS_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FASTPALS_CPU_CLONES
#endif
#define FASTPALS_INLINE inline __attribute__((always_inline))

FASTPALS_INLINE float widen(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

FASTPALS_INLINE uint16_t narrow(float f) {  // round to nearest even; NaN -> quiet NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(rounded ^ ((rounded ^ 0x7FC0u) & (0u - nan)));
}

// The dtype's rounding of an fp32 value: bfloat16 (BF16) or none (fp32).
template <bool BF16>
FASTPALS_INLINE float round_to(float x) {
  if constexpr (BF16) return widen(narrow(x)); else return x;
}

// exp(x) for x <= 0 (softmax arguments) in branch-free fp32 arithmetic that vectorizes: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial (truncation below 1e-8), 2^n by the exponent bits;
// below -87.3 the result is 0.
FASTPALS_INLINE float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.3f);
  const float n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23
  const float r = (xc - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < -87.3f ? 0.0f : p * two_n;
}

struct Shape {
  int64_t heads, dim;              // H, Dh
  int64_t q_row, q_head;           // element strides of q, k, v (unit stride along Dh)
  int64_t k_row, k_head;
  int64_t v_row, v_head;
  int32_t threshold;               // keep when the slice >= threshold
  float drop_scale, scale;         // 1 / (1 - p); softmax scale
  bool bf16;
};

// Loops run over blocks of W floats (buffers padded with zeros to a multiple of W) so that they vectorize
// without remainder loops.
constexpr int64_t W = 16;
inline int64_t padded(int64_t n) { return (n + W - 1) / W * W; }

// x[0:L) rows of one head as fp32, into out[i * ld + d] (transpose: out[d * ld + i]); the rest stays zero.
template <typename T>
FASTPALS_INLINE void load_rows(const T* base, int64_t row_stride, int64_t L, int64_t Dh, float* out, int64_t ld,
                      bool transpose) {
  for (int64_t i = 0; i < L; ++i) {
    const T* row = base + i * row_stride;
    for (int64_t d = 0; d < Dh; ++d) {
      float x;
      if constexpr (std::is_same_v<T, uint16_t>) x = widen(row[d]); else x = row[d];
      (transpose ? out[d * ld + i] : out[i * ld + d]) = x;
    }
  }
}

template <typename T>
FASTPALS_INLINE void store_rows(T* base, int64_t row_stride, int64_t L, int64_t Dh, const float* in, int64_t ld) {
  for (int64_t i = 0; i < L; ++i)
    for (int64_t d = 0; d < Dh; ++d) {
      if constexpr (std::is_same_v<T, uint16_t>) base[i * row_stride + d] = narrow(in[i * ld + d]);
      else base[i * row_stride + d] = in[i * ld + d];
    }
}

// out[i * ldo + n] = sum_k a[i * lda + k] * b[k * ldb + n] for i < rows, k < depth, n < width (a multiple of W),
// each W-wide block of a row accumulated in registers.
FASTPALS_INLINE void matmul_rows(const float* __restrict a, int64_t lda, int64_t rows, const float* __restrict b,
                                 int64_t ldb, int64_t depth, float* __restrict out, int64_t ldo, int64_t width) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t n = 0; n < width; n += W) {
      float acc[W] = {};
      for (int64_t k = 0; k < depth; ++k) {
        const float x = a[i * lda + k];
        const float* r = b + k * ldb + n;
        for (int64_t t = 0; t < W; ++t) acc[t] += x * r[t];
      }
      for (int64_t t = 0; t < W; ++t) out[i * ldo + n + t] = acc[t];
    }
}

// out[j * ld + i] = x[i * ld + j] for i, j < n (the rest of out's rows stays as it is)
FASTPALS_INLINE void transpose(const float* __restrict x, int64_t n, int64_t ld, float* __restrict out) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) out[j * ld + i] = x[i * ld + j];
}

FASTPALS_INLINE float sum_of(const float* x, int64_t n) {  // n a multiple of W
  float acc[W] = {};
  for (int64_t b = 0; b < n; b += W)
    for (int64_t t = 0; t < W; ++t) acc[t] += x[b + t];
  float total = 0.0f;
  for (int64_t t = 0; t < W; ++t) total += acc[t];
  return total;
}

FASTPALS_INLINE float max_of(const float* x, int64_t n) {  // n a multiple of W
  float acc[W];
  for (int64_t t = 0; t < W; ++t) acc[t] = -INFINITY;
  for (int64_t b = 0; b < n; b += W)
    for (int64_t t = 0; t < W; ++t) acc[t] = acc[t] > x[b + t] ? acc[t] : x[b + t];
  float m = -INFINITY;
  for (int64_t t = 0; t < W; ++t) m = m > acc[t] ? m : acc[t];
  return m;
}

FASTPALS_INLINE float keep_of(int16_t slice, int32_t threshold) {
  return float((static_cast<uint32_t>(int32_t(slice) - threshold) >> 31) ^ 1u);
}

// Softmax rows in place: p[i][j] = scores (rounded) * scale → probabilities (fp32; zero beyond L), and pd = their
// rounded, dropped-out form. `stats` (each row's max and sum) are computed when `have_stats` is false, else read.
template <bool BF16>
FASTPALS_INLINE void softmax_rows(float* __restrict p, float* __restrict pd, int64_t L, int64_t Lp,
                                  const int16_t* slices, int64_t slice_row, const Shape& s, float* stats,
                                  int64_t stats_stride,
                                  bool have_stats, float* __restrict keep) {
  const float scale = s.scale, drop_scale = s.drop_scale;
  const int32_t threshold = s.threshold;
  for (int64_t i = 0; i < L; ++i) {
    float* r = p + i * Lp;
    float* rd = pd + i * Lp;
    float* st = stats + i * stats_stride;
    for (int64_t j = 0; j < Lp; ++j) r[j] = j < L ? round_to<BF16>(r[j]) * scale : -INFINITY;
    if (!have_stats) {
      const float m = max_of(r, Lp);
      for (int64_t j = 0; j < Lp; ++j) r[j] = exp_nonpositive(r[j] - m);
      const float sum = sum_of(r, Lp);
      st[0] = m;
      st[1] = sum;
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < Lp; ++j) r[j] *= inv;
    } else {
      const float m = st[0], inv = 1.0f / st[1];
      for (int64_t j = 0; j < Lp; ++j) r[j] = exp_nonpositive(r[j] - m) * inv;
    }
    if (slices != nullptr) {
      const int16_t* sl = slices + i * slice_row;
      for (int64_t j = 0; j < L; ++j) keep[j] = keep_of(sl[j], threshold);
      for (int64_t j = 0; j < Lp; ++j)
        rd[j] = round_to<BF16>(round_to<BF16>(round_to<BF16>(r[j]) * keep[j]) * drop_scale);
    } else {
      for (int64_t j = 0; j < Lp; ++j) rd[j] = round_to<BF16>(r[j]);
    }
  }
}

struct Work {  // one (sequence, head)
  int64_t start, length, head, slice_offset, slice_row;
};

// The (sequence, head) pairs, and the number of slices the words must hold (0 without a layout).
std::vector<Work> plan(const at::Tensor& cu_seqlens, int64_t heads, const c10::optional<at::Tensor>& layout,
                       int64_t* slices_needed) {
  const at::Tensor cu = cu_seqlens.to(at::kLong).contiguous();
  const int64_t* c = cu.data_ptr<int64_t>();
  const int64_t batch = cu.numel() - 1;
  TORCH_CHECK(batch >= 0, "packed_attention: cu_seqlens must have B + 1 entries");
  const int64_t* lay = nullptr;
  if (layout.has_value()) {
    TORCH_CHECK(layout->scalar_type() == at::kLong && layout->is_contiguous() &&
                    layout->sizes() == at::IntArrayRef({batch, 2}),
                "packed_attention: words_layout must be a contiguous int64 [B, 2]");
    lay = layout->data_ptr<int64_t>();
  }
  std::vector<Work> work;
  *slices_needed = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t L = c[b + 1] - c[b];
    TORCH_CHECK(L >= 0, "packed_attention: cu_seqlens must not decrease");
    const int64_t base = lay ? lay[2 * b] : 0, row = lay ? lay[2 * b + 1] : L;
    TORCH_CHECK(L == 0 || (base >= 0 && row >= L), "packed_attention: words_layout row ", b, " is out of range");
    for (int64_t h = 0; h < heads; ++h) work.push_back({c[b], L, h, base + h * row * row, row});
    if (lay && L > 0) *slices_needed = std::max(*slices_needed, base + ((heads - 1) * row + L - 1) * row + L);
  }
  // longest first, dealt round-robin to the threads
  std::stable_sort(work.begin(), work.end(), [](const Work& a, const Work& b) { return a.length > b.length; });
  return work;
}

template <typename F>
void for_each_work(const std::vector<Work>& work, F f) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work.size()));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t t = begin; t < end; ++t)
      for (size_t w = t; w < work.size(); w += threads) f(work[w], scratch);
  });
}

Shape make_shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t threshold, double drop_scale,
                 double scale) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
              "packed_attention: q, k, v must be [N, H, Dh] of one shape");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat),
              "packed_attention: q, k, v must be all bfloat16 or all float32");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "packed_attention: q, k, v need unit stride along the head dim");
  return Shape{q.size(1), q.size(2), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               static_cast<int32_t>(threshold), float(drop_scale), float(scale), q.scalar_type() == at::kBFloat16};
}

const int16_t* slices_of(const c10::optional<at::Tensor>& words, int64_t needed) {
  if (!words.has_value()) return nullptr;
  TORCH_CHECK(words->scalar_type() == at::kLong && words->is_contiguous() && words->numel() * 4 >= needed,
              "packed_attention: words must be a contiguous int64 tensor of at least ceil(n / 4) values, n = ",
              needed);
  return reinterpret_cast<const int16_t*>(words->data_ptr<int64_t>());
}

template <typename T>
FASTPALS_INLINE void forward_block(const T* qb, const T* kb, const T* vb, T* ob, const Work& w, const int16_t* slices,
                                   const Shape& s, float* st, std::vector<float>& scratch) {
  const int64_t L = w.length, Lp = padded(L), Dh = s.dim, Dp = padded(Dh), H = s.heads;
  scratch.assign(3 * L * Dp + Dp * Lp + 2 * L * Lp + Lp, 0.0f);
  float *qf = scratch.data(), *kt = qf + L * Dp, *vf = kt + Dp * Lp, *o = vf + L * Dp, *p = o + L * Dp;
  float *pd = p + L * Lp, *keep = pd + L * Lp;
  load_rows(qb, s.q_row, L, Dh, qf, Dp, false);
  load_rows(kb, s.k_row, L, Dh, kt, Lp, true);
  load_rows(vb, s.v_row, L, Dh, vf, Dp, false);
  matmul_rows(qf, Dp, L, kt, Lp, Dh, p, Lp, Lp);  // scores
  softmax_rows<std::is_same_v<T, uint16_t>>(p, pd, L, Lp, slices ? slices + w.slice_offset : nullptr, w.slice_row,
                                             s, st + (w.start * H + w.head) * 2, 2 * H, false, keep);
  matmul_rows(pd, Lp, L, vf, Dp, L, o, Dp, Dp);  // o = pd v
  store_rows(ob, H * Dh, L, Dh, o, Dp);
}

template <typename T>
FASTPALS_INLINE void backward_block(const T* gb, int64_t g_row, const T* qb, const T* kb, const T* vb, T* dqb,
                                    T* dkb, T* dvb, const Work& w, const int16_t* slices, const Shape& s, float* st,
                                    std::vector<float>& scratch) {
  const int64_t L = w.length, Lp = padded(L), Dh = s.dim, Dp = padded(Dh), H = s.heads;
  scratch.assign(6 * L * Dp + 2 * Dp * Lp + 4 * L * Lp + Lp, 0.0f);
  float *qf = scratch.data(), *kf = qf + L * Dp, *gf = kf + L * Dp, *dq = gf + L * Dp, *dk = dq + L * Dp;
  float *dv = dk + L * Dp, *kt = dv + L * Dp, *vt = kt + Dp * Lp, *p = vt + Dp * Lp, *pd = p + L * Lp;
  float *ds = pd + L * Lp, *tr = ds + L * Lp, *keep = tr + L * Lp;
  load_rows(qb, s.q_row, L, Dh, qf, Dp, false);
  load_rows(kb, s.k_row, L, Dh, kf, Dp, false);
  load_rows(kb, s.k_row, L, Dh, kt, Lp, true);
  load_rows(vb, s.v_row, L, Dh, vt, Lp, true);
  load_rows(gb, g_row, L, Dh, gf, Dp, false);
  const int16_t* sl = slices ? slices + w.slice_offset : nullptr;
  matmul_rows(qf, Dp, L, kt, Lp, Dh, p, Lp, Lp);  // the forward's probabilities again
  softmax_rows<std::is_same_v<T, uint16_t>>(p, pd, L, Lp, sl, w.slice_row, s, st + (w.start * H + w.head) * 2, 2 * H,
                                             true, keep);
  transpose(pd, L, Lp, tr);
  matmul_rows(tr, Lp, L, gf, Dp, L, dv, Dp, Dp);  // dV = pd^T dO
  matmul_rows(gf, Dp, L, vt, Lp, Dh, ds, Lp, Lp);  // dO v^T: the gradient of pd
  constexpr bool BF16 = std::is_same_v<T, uint16_t>;
  const float scale = s.scale, drop_scale = s.drop_scale;
  const int32_t threshold = s.threshold;
  for (int64_t i = 0; i < L; ++i) {
    float* g = ds + i * Lp;
    const float* r = p + i * Lp;
    if (sl != nullptr)
      for (int64_t j = 0; j < L; ++j) keep[j] = keep_of(sl[i * w.slice_row + j], threshold);
    for (int64_t j = 0; j < Lp; ++j) {
      float x = round_to<BF16>(g[j]);  // rounded as the matmul rounds it
      if (sl != nullptr) x = round_to<BF16>(round_to<BF16>(x * drop_scale) * keep[j]);
      g[j] = x;
      tr[j] = x * r[j];
    }
    const float dot = sum_of(tr, Lp);
    for (int64_t j = 0; j < Lp; ++j) g[j] = round_to<BF16>(r[j] * (g[j] - dot) * scale);
  }
  matmul_rows(ds, Lp, L, kf, Dp, L, dq, Dp, Dp);  // dQ = dS k
  transpose(ds, L, Lp, tr);
  matmul_rows(tr, Lp, L, qf, Dp, L, dk, Dp, Dp);  // dK = dS^T q
  store_rows(dqb, H * Dh, L, Dh, dq, Dp);
  store_rows(dkb, H * Dh, L, Dh, dk, Dp);
  store_rows(dvb, H * Dh, L, Dh, dv, Dp);
}

// The blocks compiled for AVX-512 and AVX2 as well (GCC on x86-64), picked at load time for the CPU.
#define FASTPALS_BLOCKS(T)                                                                                   \
  FASTPALS_CPU_CLONES void forward_clone(const T* qb, const T* kb, const T* vb, T* ob, const Work& w,                \
                                            const int16_t* slices, const Shape& s, float* st,                         \
                                            std::vector<float>& scratch) {                                            \
    forward_block<T>(qb, kb, vb, ob, w, slices, s, st, scratch);                                                      \
  }                                                                                                                   \
  FASTPALS_CPU_CLONES void backward_clone(const T* gb, int64_t g_row, const T* qb, const T* kb, const T* vb,         \
                                             T* dqb, T* dkb, T* dvb, const Work& w, const int16_t* slices,            \
                                             const Shape& s, float* st, std::vector<float>& scratch) {                \
    backward_block<T>(gb, g_row, qb, kb, vb, dqb, dkb, dvb, w, slices, s, st, scratch);                               \
  }
FASTPALS_BLOCKS(uint16_t)
FASTPALS_BLOCKS(float)

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<Work>& work,
                  const int16_t* slices, const Shape& s, at::Tensor& out, at::Tensor& stats) {
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  float* st = stats.data_ptr<float>();
  for_each_work(work, [&](const Work& w, std::vector<float>& scratch) {
    if (w.length == 0) return;
    forward_clone(qp + w.start * s.q_row + w.head * s.q_head, kp + w.start * s.k_row + w.head * s.k_head,
                     vp + w.start * s.v_row + w.head * s.v_head, op + (w.start * s.heads + w.head) * s.dim, w, slices,
                     s, st, scratch);
  });
}

template <typename T>
void backward_impl(const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::vector<Work>& work, const int16_t* slices, const Shape& s, const at::Tensor& stats,
                   at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const T* gp = reinterpret_cast<const T*>(grad.data_ptr());
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  T* dqp = reinterpret_cast<T*>(dq.data_ptr());
  T* dkp = reinterpret_cast<T*>(dk.data_ptr());
  T* dvp = reinterpret_cast<T*>(dv.data_ptr());
  float* st = const_cast<float*>(stats.data_ptr<float>());
  const int64_t g_row = grad.stride(0), g_head = grad.stride(1);
  for_each_work(work, [&](const Work& w, std::vector<float>& scratch) {
    if (w.length == 0) return;
    const int64_t o = (w.start * s.heads + w.head) * s.dim;
    backward_clone(gp + w.start * g_row + w.head * g_head, g_row, qp + w.start * s.q_row + w.head * s.q_head,
                      kp + w.start * s.k_row + w.head * s.k_head, vp + w.start * s.v_row + w.head * s.v_head, dqp + o,
                      dkp + o, dvp + o, w, slices, s, st, scratch);
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& cu_seqlens,
                                                    const c10::optional<at::Tensor>& words,
                                                    const c10::optional<at::Tensor>& words_layout, int64_t threshold,
                                                    double drop_scale, double scale) {
  const Shape s = make_shape(q, k, v, threshold, drop_scale, scale);
  TORCH_CHECK(words.has_value() == words_layout.has_value(), "packed_attention: words need their words_layout");
  int64_t needed = 0;
  const std::vector<Work> work = plan(cu_seqlens, s.heads, words_layout, &needed);
  const int16_t* slices = slices_of(words, needed);
  at::Tensor out = at::zeros(q.sizes(), q.options());
  at::Tensor stats = at::empty({q.size(0), s.heads, 2}, q.options().dtype(at::kFloat));
  if (s.bf16) forward_impl<uint16_t>(q, k, v, work, slices, s, out, stats);
  else forward_impl<float>(q, k, v, work, slices, s, out, stats);
  return {out, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> packed_attention_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
    const c10::optional<at::Tensor>& words, const c10::optional<at::Tensor>& words_layout, int64_t threshold,
    double drop_scale, double scale, const at::Tensor& stats) {
  const Shape s = make_shape(q, k, v, threshold, drop_scale, scale);
  TORCH_CHECK(grad.sizes() == q.sizes() && grad.scalar_type() == q.scalar_type() && grad.stride(2) == 1,
              "packed_attention_backward: grad must be like q");
  TORCH_CHECK(stats.scalar_type() == at::kFloat && stats.is_contiguous() &&
                  stats.sizes() == at::IntArrayRef({q.size(0), s.heads, 2}),
              "packed_attention_backward: stats must be the forward's");
  TORCH_CHECK(words.has_value() == words_layout.has_value(), "packed_attention: words need their words_layout");
  int64_t needed = 0;
  const std::vector<Work> work = plan(cu_seqlens, s.heads, words_layout, &needed);
  const int16_t* slices = slices_of(words, needed);
  at::Tensor dq = at::zeros(q.sizes(), q.options()), dk = at::zeros(q.sizes(), q.options()),
             dv = at::zeros(q.sizes(), q.options());
  if (s.bf16) backward_impl<uint16_t>(grad, q, k, v, work, slices, s, stats, dq, dk, dv);
  else backward_impl<float>(grad, q, k, v, work, slices, s, stats, dq, dk, dv);
  return {dq, dk, dv};
}

}  // namespace fastpals

TORCH_LIBRARY_FRAGMENT(fastpals, m) {
  m.def(
      "packed_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, Tensor? words, Tensor? words_layout, "
      "int threshold, float drop_scale, float scale) -> (Tensor, Tensor)");
  m.def(
      "packed_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, Tensor? words, "
      "Tensor? words_layout, int threshold, float drop_scale, float scale, Tensor stats) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastpals, CPU, m) {
  m.impl("packed_attention", &fastpals::packed_attention);
  m.impl("packed_attention_backward", &fastpals::packed_attention_backward);
}

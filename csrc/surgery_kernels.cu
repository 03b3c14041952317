// Gram matrix and weighted combination of per-task gradients: the two memory-bound passes of gradient surgery.
//
//   gram:    partial[b][k] = sum over block b's columns p of buf[i][p] * buf[j][p], k = the (i <= j) pair index
//   combine: out[p] = sum_t w[t] * buf[t][p]
//
// buf is fp32, fp16 or bf16, [T, P] row-major and contiguous; arithmetic in fp32. One pass over the buffer each:
// every thread reads the T values of a column once (grid-stride loop) and accumulates the T(T+1)/2 products in
// registers; each block writes its partial sums, reduced afterwards in a fixed order (deterministic, no float
// atomics). Pure CUDA runtime: no torch headers, so this file compiles with nvcc alone; csrc/bindings.cpp
// validates the tensors and calls the extern "C" launchers below.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kMaxTasks = 16;
constexpr int kThreads = 256;

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

template <typename scalar_t, int T>
__global__ void gram_partial_kernel(const scalar_t* __restrict__ buf, int64_t P, float* __restrict__ partial,
                                    int* __restrict__ nonfinite) {
  constexpr int kPairs = T * (T + 1) / 2;
  float acc[kPairs];
#pragma unroll
  for (int k = 0; k < kPairs; ++k) acc[k] = 0.f;
  int bad = 0;
  for (int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; p < P; p += (int64_t)gridDim.x * blockDim.x) {
    float v[T];
#pragma unroll
    for (int t = 0; t < T; ++t) {
      v[t] = to_float(buf[t * P + p]);
      bad += !isfinite(v[t]);
    }
    int k = 0;
#pragma unroll
    for (int i = 0; i < T; ++i)
#pragma unroll
      for (int j = i; j < T; ++j) acc[k++] += v[i] * v[j];
  }
  __shared__ float smem[kThreads];
  __shared__ int sbad[kThreads];
  for (int k = 0; k < kPairs; ++k) {
    smem[threadIdx.x] = acc[k];
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s) smem[threadIdx.x] += smem[threadIdx.x + s];
      __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x * kPairs + k] = smem[0];
    __syncthreads();
  }
  sbad[threadIdx.x] = bad;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sbad[threadIdx.x] += sbad[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) nonfinite[blockIdx.x] = sbad[0];
}

template <typename scalar_t>
__global__ void combine_kernel(const scalar_t* __restrict__ buf, const float* __restrict__ w, int T, int64_t P,
                               scalar_t* __restrict__ out) {
  for (int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; p < P; p += (int64_t)gridDim.x * blockDim.x) {
    float acc = 0.f;
    for (int t = 0; t < T; ++t) acc += w[t] * to_float(buf[t * P + p]);
    out[p] = from_float<scalar_t>(acc);
  }
}

template <typename scalar_t>
cudaError_t gram_dispatch(const void* buf, int T, int64_t P, float* partial, int* bad, int blocks,
                          cudaStream_t stream) {
  const auto* b = static_cast<const scalar_t*>(buf);
  switch (T) {
#define FASTPALS_CASE(N)                                                                \
  case N:                                                                               \
    gram_partial_kernel<scalar_t, N><<<blocks, kThreads, 0, stream>>>(b, P, partial, bad); \
    break;
    FASTPALS_CASE(1) FASTPALS_CASE(2) FASTPALS_CASE(3) FASTPALS_CASE(4) FASTPALS_CASE(5) FASTPALS_CASE(6)
    FASTPALS_CASE(7) FASTPALS_CASE(8) FASTPALS_CASE(9) FASTPALS_CASE(10) FASTPALS_CASE(11) FASTPALS_CASE(12)
    FASTPALS_CASE(13) FASTPALS_CASE(14) FASTPALS_CASE(15) FASTPALS_CASE(16)
#undef FASTPALS_CASE
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

// dtype codes: 0 = float32, 1 = float16, 2 = bfloat16.
extern "C" int fastpals_grid_blocks(int64_t P) {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) sms = 1;
  int64_t need = (P + kThreads - 1) / kThreads;
  int64_t cap = 4LL * sms;
  return static_cast<int>(need < 1 ? 1 : (need < cap ? need : cap));
}

extern "C" int fastpals_gram_partial(const void* buf, int dtype, int T, int64_t P, float* partial, int* bad,
                                     int blocks, void* stream) {
  if (T < 1 || T > kMaxTasks) return static_cast<int>(cudaErrorInvalidValue);
  auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err;
  switch (dtype) {
    case 0: err = gram_dispatch<float>(buf, T, P, partial, bad, blocks, s); break;
    case 1: err = gram_dispatch<__half>(buf, T, P, partial, bad, blocks, s); break;
    case 2: err = gram_dispatch<__nv_bfloat16>(buf, T, P, partial, bad, blocks, s); break;
    default: err = cudaErrorInvalidValue;
  }
  return static_cast<int>(err);
}

extern "C" int fastpals_combine(const void* buf, int dtype, int T, int64_t P, const float* w, void* out,
                                int blocks, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0:
      combine_kernel<float><<<blocks, kThreads, 0, s>>>(static_cast<const float*>(buf), w, T, P,
                                                        static_cast<float*>(out));
      break;
    case 1:
      combine_kernel<__half><<<blocks, kThreads, 0, s>>>(static_cast<const __half*>(buf), w, T, P,
                                                         static_cast<__half*>(out));
      break;
    case 2:
      combine_kernel<__nv_bfloat16><<<blocks, kThreads, 0, s>>>(static_cast<const __nv_bfloat16*>(buf), w, T, P,
                                                                static_cast<__nv_bfloat16*>(out));
      break;
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

extern "C" const char* fastpals_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

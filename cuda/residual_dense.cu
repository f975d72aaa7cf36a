// Batched dense residual steps over many intervals at once (MGRIT relaxation advances all
// coarse intervals of a level together; interval i has its own layer W[i], b[i]).
//
//   forward:   out[i] = u[i] + dt * tanh(u[i] W[i]^T + b[i])
//   input VJP: out[i] = g[i] + dt * ((1 - y[i]^2) * g[i]) W[i],  y[i] = tanh(u[i] W[i]^T + b[i])
//
// u[i], g[i], out[i] are (S, d) row-major (S samples of width d), W[i] is (d, d) row-major as
// in nn.Linear (out x in), b[i] is (d). Within an interval every tensor is contiguous; between
// intervals u, g, W and b may have any stride (in elements), so strided views of stacked layer
// parameters need no copy. out is contiguous (B, S, d).
//
// One thread block per (interval, tile of up to kTile samples): the tile's states are staged in
// shared memory, each warp computes whole rows of W u (lanes over the input index, reduced by
// shuffles), reusing every loaded weight for all samples of the tile. The transposed product
// of the VJP has one thread per input index, which reads W[i] column-wise: coalesced.
//
// Host entry points return a cudaError_t as int (0: success) and never abort.

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

namespace {

constexpr int kThreads = 128;
constexpr int kWarp = 32;
constexpr int kTile = 8;
constexpr size_t kSharedBytes = 48 * 1024;  // dynamic shared memory without opt-in

__device__ __forceinline__ float tanh_of(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_of(double x) { return tanh(x); }

struct Shape {
  int64_t intervals, samples, width;
  int tiles;  // sample tiles per interval
};

struct Strides {  // elements between consecutive intervals
  int64_t u, w, b, g;
};

// acc[r] = W_j . x[r, :] for r < rows, in every lane of the calling warp.
template <typename T, int R>
__device__ __forceinline__ void warp_row_dot(const T* __restrict__ w_row, const T* x, int width,
                                             int rows, T (&acc)[R]) {
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = T(0);
  for (int k = lane; k < width; k += kWarp) {
    const T w = w_row[k];
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (r < rows) acc[r] += w * x[r * width + k];
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (r < rows)  // warp-uniform
      for (int offset = kWarp / 2; offset > 0; offset /= 2)
        acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], offset);
}

// Which interval and samples this block handles, and its two shared buffers (rows x width).
template <typename T, int R>
struct Block {
  int64_t interval;
  int first, rows;
  T* x;
  T* y;

  __device__ Block(const Shape& s, unsigned char* shared) {
    interval = blockIdx.x / s.tiles;
    first = static_cast<int>(blockIdx.x % s.tiles) * R;
    rows = min(R, static_cast<int>(s.samples) - first);
    x = reinterpret_cast<T*>(shared);
    y = x + static_cast<int64_t>(R) * s.width;
  }
};

// y = tanh(x W^T + b) for the block's rows: the tile's states x already staged.
template <typename T, int R>
__device__ __forceinline__ void tile_activation(const Block<T, R>& blk, const T* __restrict__ w,
                                                const T* __restrict__ b, int width) {
  const int lane = threadIdx.x % kWarp;
  for (int j = threadIdx.x / kWarp; j < width; j += kThreads / kWarp) {
    T acc[R];
    warp_row_dot<T, R>(w + static_cast<int64_t>(j) * width, blk.x, width, blk.rows, acc);
    const T bias = b[j];
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (r < blk.rows && lane == r) blk.y[r * width + j] = tanh_of(acc[r] + bias);
  }
}

template <typename T, int R>
__device__ __forceinline__ void stage(const Block<T, R>& blk, const T* __restrict__ src,
                                     T* dst, int width) {
  for (int e = threadIdx.x; e < blk.rows * width; e += kThreads) dst[e] = src[e];
}

template <typename T, int R>
__global__ void __launch_bounds__(kThreads)
dense_step_kernel(const T* __restrict__ u, const T* __restrict__ w, const T* __restrict__ b,
                  T* __restrict__ out, Shape s, Strides st, T dt) {
  extern __shared__ __align__(16) unsigned char shared[];
  const Block<T, R> blk(s, shared);
  const int width = static_cast<int>(s.width);
  const int64_t row0 = static_cast<int64_t>(blk.first) * width;
  stage(blk, u + blk.interval * st.u + row0, blk.x, width);
  __syncthreads();
  tile_activation(blk, w + blk.interval * st.w, b + blk.interval * st.b, width);
  __syncthreads();
  T* dst = out + blk.interval * s.samples * s.width + row0;
  for (int e = threadIdx.x; e < blk.rows * width; e += kThreads)
    dst[e] = blk.x[e] + dt * blk.y[e];
}

template <typename T, int R>
__global__ void __launch_bounds__(kThreads)
dense_step_vjp_kernel(const T* __restrict__ u, const T* __restrict__ w, const T* __restrict__ b,
                      const T* __restrict__ g, T* __restrict__ out, Shape s, Strides st, T dt) {
  extern __shared__ __align__(16) unsigned char shared[];
  const Block<T, R> blk(s, shared);
  const int width = static_cast<int>(s.width);
  const int64_t row0 = static_cast<int64_t>(blk.first) * width;
  const T* wi = w + blk.interval * st.w;
  const T* gi = g + blk.interval * st.g + row0;
  stage(blk, u + blk.interval * st.u + row0, blk.x, width);
  __syncthreads();
  tile_activation(blk, wi, b + blk.interval * st.b, width);
  __syncthreads();
  // z = (1 - y^2) * g, in place of y
  for (int e = threadIdx.x; e < blk.rows * width; e += kThreads)
    blk.y[e] = (T(1) - blk.y[e] * blk.y[e]) * gi[e];
  __syncthreads();
  T* dst = out + blk.interval * s.samples * s.width + row0;
  for (int k = threadIdx.x; k < width; k += kThreads) {
    T acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = T(0);
    for (int j = 0; j < width; ++j) {
      const T wjk = wi[static_cast<int64_t>(j) * width + k];
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (r < blk.rows) acc[r] += wjk * blk.y[r * width + j];
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (r < blk.rows) dst[r * width + k] = gi[r * width + k] + dt * acc[r];
  }
}

// Shared bytes a tile of `rows` samples needs (two buffers of rows x width).
size_t shared_bytes(int rows, int64_t width, size_t element) {
  return 2 * static_cast<size_t>(rows) * static_cast<size_t>(width) * element;
}

// Launches kernel<T, kTile> when its tile fits in shared memory, else kernel<T, 1>.
template <typename T, typename Launch>
int launch(int64_t intervals, int64_t samples, int64_t width, void* stream, Launch run) {
  if (intervals < 0 || samples < 0 || width < 0 || samples > INT_MAX || width > INT_MAX)
    return static_cast<int>(cudaErrorInvalidValue);
  if (intervals == 0 || samples == 0 || width == 0) return static_cast<int>(cudaSuccess);
  const bool tiled = shared_bytes(kTile, width, sizeof(T)) <= kSharedBytes;
  const int rows = tiled ? kTile : 1;
  const size_t bytes = shared_bytes(rows, width, sizeof(T));
  if (bytes > kSharedBytes) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t tiles = (samples + rows - 1) / rows;
  if (intervals > INT_MAX / tiles) return static_cast<int>(cudaErrorInvalidValue);
  const Shape shape{intervals, samples, width, static_cast<int>(tiles)};
  const dim3 grid(static_cast<unsigned>(intervals * tiles));
  run(tiled, grid, bytes, static_cast<cudaStream_t>(stream), shape);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int dense_step(const T* u, const T* w, const T* b, T* out, int64_t intervals, int64_t samples,
               int64_t width, int64_t u_stride, int64_t w_stride, int64_t b_stride, double dt,
               void* stream) {
  const Strides st{u_stride, w_stride, b_stride, 0};
  return launch<T>(intervals, samples, width, stream,
                   [&](bool tiled, dim3 grid, size_t bytes, cudaStream_t s, const Shape& shape) {
                     if (tiled)
                       dense_step_kernel<T, kTile><<<grid, kThreads, bytes, s>>>(
                           u, w, b, out, shape, st, static_cast<T>(dt));
                     else
                       dense_step_kernel<T, 1><<<grid, kThreads, bytes, s>>>(
                           u, w, b, out, shape, st, static_cast<T>(dt));
                   });
}

template <typename T>
int dense_step_vjp(const T* u, const T* w, const T* b, const T* g, T* out, int64_t intervals,
                   int64_t samples, int64_t width, int64_t u_stride, int64_t w_stride,
                   int64_t b_stride, int64_t g_stride, double dt, void* stream) {
  const Strides st{u_stride, w_stride, b_stride, g_stride};
  return launch<T>(intervals, samples, width, stream,
                   [&](bool tiled, dim3 grid, size_t bytes, cudaStream_t s, const Shape& shape) {
                     if (tiled)
                       dense_step_vjp_kernel<T, kTile><<<grid, kThreads, bytes, s>>>(
                           u, w, b, g, out, shape, st, static_cast<T>(dt));
                     else
                       dense_step_vjp_kernel<T, 1><<<grid, kThreads, bytes, s>>>(
                           u, w, b, g, out, shape, st, static_cast<T>(dt));
                   });
}

}  // namespace

extern "C" {

// The widest layer the kernels accept for elements of `element_size` bytes.
int64_t mgrit_dense_max_width(int element_size) {
  return element_size > 0 ? static_cast<int64_t>(kSharedBytes / (2 * element_size)) : 0;
}

const char* mgrit_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

int mgrit_dense_step_f32(const float* u, const float* w, const float* b, float* out,
                         int64_t intervals, int64_t samples, int64_t width, int64_t u_stride,
                         int64_t w_stride, int64_t b_stride, double dt, void* stream) {
  return dense_step(u, w, b, out, intervals, samples, width, u_stride, w_stride, b_stride, dt,
                    stream);
}

int mgrit_dense_step_f64(const double* u, const double* w, const double* b, double* out,
                         int64_t intervals, int64_t samples, int64_t width, int64_t u_stride,
                         int64_t w_stride, int64_t b_stride, double dt, void* stream) {
  return dense_step(u, w, b, out, intervals, samples, width, u_stride, w_stride, b_stride, dt,
                    stream);
}

int mgrit_dense_step_vjp_f32(const float* u, const float* w, const float* b, const float* g,
                             float* out, int64_t intervals, int64_t samples, int64_t width,
                             int64_t u_stride, int64_t w_stride, int64_t b_stride,
                             int64_t g_stride, double dt, void* stream) {
  return dense_step_vjp(u, w, b, g, out, intervals, samples, width, u_stride, w_stride,
                        b_stride, g_stride, dt, stream);
}

int mgrit_dense_step_vjp_f64(const double* u, const double* w, const double* b,
                             const double* g, double* out, int64_t intervals, int64_t samples,
                             int64_t width, int64_t u_stride, int64_t w_stride,
                             int64_t b_stride, int64_t g_stride, double dt, void* stream) {
  return dense_step_vjp(u, w, b, g, out, intervals, samples, width, u_stride, w_stride,
                        b_stride, g_stride, dt, stream);
}

}  // extern "C"

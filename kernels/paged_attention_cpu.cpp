// Paged decode attention on the CPU, fused: each (sequence, KV head) task reads its K/V rows straight
// from the block pool (no gathered copy), scores its query rows, softmaxes and sums V, in fp32.
// Built at first use by kernels/paged_attention.py (torch.utils.cpp_extension, -O3 -march=native);
// plain loops over 16 lanes so the compiler vectorises them, and every sum runs in a fixed order that
// depends only on the sequence itself: a token's output is bitwise the same whatever it is batched with.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

// e^x for x <= 0 (a score minus its row's max), Cody-Waite reduction and a degree-7 Taylor series on
// |r| <= ln2/2 (error ~1 ulp); branch-free so the loop over a row vectorises.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float sum_lanes(const float* a) {  // fixed pairwise order
  float b[kLanes / 2];
  for (int l = 0; l < kLanes / 2; ++l) b[l] = a[l] + a[l + kLanes / 2];
  for (int l = 0; l < 4; ++l) b[l] += b[l + 4];
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// sum of a[i] * b[i], i < dim (a multiple of 16), in 16 lanes then a fixed pairwise order
inline float dot(const float* a, const float* b, int64_t dim) {
#ifdef __AVX512F__
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
  for (int64_t d = kLanes; d < dim; d += kLanes)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  return _mm512_reduce_add_ps(acc);
#else
  float lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = a[l] * b[l];
  for (int64_t d = kLanes; d < dim; d += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[d + l] * b[d + l];
  return sum_lanes(lanes);
#endif
}

inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

// One sequence, all heads: q/out [heads, dim]; k/v the pools [blocks, bs, kv_heads, dim]. Each token's
// K (then V) row is read once, whole and in order (a block is block_size contiguous rows), and the next
// block's row is prefetched: the blocks are scattered, so the hardware prefetcher cannot guess them.
template <typename T>
void decode_sequence(const T* q, const T* k, const T* v, const int32_t* table, int64_t n, int64_t heads,
                     int64_t kv_heads, int64_t dim, int64_t block_size, float scale, std::vector<float>& qf,
                     std::vector<float>& row, std::vector<float>& s, std::vector<float>& acc, T* out) {
  const int64_t group = heads / kv_heads, width = kv_heads * dim;
  qf.resize(heads * dim);
  row.resize(width);
  s.resize(heads * n);
  acc.assign(heads * dim, 0.0f);
  for (int64_t i = 0; i < heads * dim; ++i) qf[i] = to_float(q[i]) * scale;
  auto slot = [&](int64_t t) { return static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size; };
  for (int64_t t = 0; t < n; ++t) {
    if (t + block_size < n) prefetch_row(k + slot(t + block_size) * width, width * sizeof(T));
    const T* kt = k + slot(t) * width;
    for (int64_t d = 0; d < width; ++d) row[d] = to_float(kt[d]);
    for (int64_t i = 0; i < heads; ++i) s[i * n + t] = dot(qf.data() + i * dim, row.data() + i / group * dim, dim);
  }
  for (int64_t i = 0; i < heads; ++i) {
    float* si = s.data() + i * n;
    float m = si[0];
    for (int64_t t = 1; t < n; ++t) m = si[t] > m ? si[t] : m;
    for (int64_t t = 0; t < n; ++t) si[t] = exp_nonpositive(si[t] - m);
  }
  for (int64_t t = 0; t < n; ++t) {
    if (t + block_size < n) prefetch_row(v + slot(t + block_size) * width, width * sizeof(T));
    const T* vt = v + slot(t) * width;
    for (int64_t d = 0; d < width; ++d) row[d] = to_float(vt[d]);
    for (int64_t i = 0; i < heads; ++i) {
      const float p = s[i * n + t];
      const float* vi = row.data() + i / group * dim;
      float* ai = acc.data() + i * dim;
      for (int64_t d = 0; d < dim; ++d) ai[d] += p * vi[d];
    }
  }
  for (int64_t i = 0; i < heads; ++i) {
    const float* si = s.data() + i * n;
    float lanes[kLanes] = {};
    int64_t t = 0;
    for (; t + kLanes <= n; t += kLanes)
      for (int l = 0; l < kLanes; ++l) lanes[l] += si[t + l];
    for (int l = 0; t < n; ++t, ++l) lanes[l] += si[t];
    const float inv = 1.0f / sum_lanes(lanes);
    for (int64_t d = 0; d < dim; ++d) out[i * dim + d] = static_cast<T>(acc[i * dim + d] * inv);
  }
}

// q [B, H, D]; k_cache/v_cache [blocks, block_size, KVH, D]; block_tables int32 [B, W]; context_lens
// int32 [B] (>= 1); sequences are split over threads in chunks of at least `grain`.
torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                           int64_t grain) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kInt);
  TORCH_CHECK(context_lens.is_contiguous() && context_lens.scalar_type() == at::kInt);
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type());
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(dim % kLanes == 0 && heads % kv_heads == 0 && k_cache.size(3) == dim);
  const int64_t width = block_tables.size(1);
  auto out = torch::empty_like(q);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> qf, row, s, acc;
      for (int64_t b = begin; b < end; ++b)
        decode_sequence<scalar_t>(qp + b * heads * dim, kp, vp, tables + b * width, lens[b], heads, kv_heads, dim,
                                  block_size, static_cast<float>(scale), qf, row, s, acc, op + b * heads * dim);
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }

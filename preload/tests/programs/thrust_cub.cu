// Thrust and CUB as CUDA C++ programs use them, on the default stream and on a stream of the program's: sequences,
// transforms, radix sorts of keys and of key-value pairs, reductions whose value the host reads, scans (CUB's
// decoupled look-back: blocks wait for their predecessors' partial sums), unique, count_if, and CUB's device-wide
// reduce, radix sort and select with the temporary storage the program allocates. Thrust allocates its own temporary
// storage and synchronizes where a result goes to the host. Every result is hashed: the same bits with and without
// the preload. A scan of floats is the exception: which predecessors' sums a tile adds up depends on how far they
// got (CUB documents its scans of floats as not reproducible), so its bits are printed for information only and
// its values checked against the host's scan in double precision; an integer scan is hashed instead.
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <vector>
#include <cuda_runtime.h>
#include <thrust/device_vector.h>
#include <thrust/host_vector.h>
#include <thrust/sequence.h>
#include <thrust/transform.h>
#include <thrust/sort.h>
#include <thrust/reduce.h>
#include <thrust/scan.h>
#include <thrust/unique.h>
#include <thrust/count.h>
#include <thrust/execution_policy.h>
#include <cub/cub.cuh>
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  printf("cuda error %s at line %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

struct Scramble {
  unsigned seed;
  __host__ __device__ unsigned operator()(unsigned i) const {
    unsigned x = i * 2654435761u ^ seed;
    x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
    return x;
  }
};
struct ToFloat {
  __host__ __device__ float operator()(unsigned x) const { return (float)(x % 100000) * 0.001f - 50.0f; }
};
struct HighBits {
  __host__ __device__ unsigned operator()(unsigned x) const { return x >> 20; }
};
struct IsSmall {
  __host__ __device__ bool operator()(unsigned x) const { return (x & 0xff) < 40; }
};

static uint64_t fnv(const void *p, size_t n, uint64_t h = 1469598103934665603ull) {
  const unsigned char *b = (const unsigned char *)p;
  for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 1099511628211ull; }
  return h;
}
template <typename T> static uint64_t hash_device(const thrust::device_vector<T> &v, uint64_t h) {
  thrust::host_vector<T> host = v;
  return fnv(host.data(), host.size() * sizeof(T), h);
}

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 2000;
  int rounds = iters / 100 + 2;
  const int n = 1 << 16;
  cudaStream_t st; CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  uint64_t h_float_scan = 1469598103934665603ull;
  long scan_wrong = 0;
  uint64_t h_thrust = 1469598103934665603ull, h_cub = 1469598103934665603ull, h_values = 1469598103934665603ull;
  thrust::device_vector<unsigned> keys(n), keys2(n), flags(n);
  thrust::device_vector<float> vals(n), scanned(n);
  // CUB's temporary storage, sized by its first call with a null pointer.
  unsigned *d_in, *d_out, *d_sel; float *d_vin, *d_vout; int *d_count; float *d_sum;
  CHECK(cudaMalloc(&d_in, n * 4)); CHECK(cudaMalloc(&d_out, n * 4)); CHECK(cudaMalloc(&d_sel, n * 4));
  CHECK(cudaMalloc(&d_vin, n * 4)); CHECK(cudaMalloc(&d_vout, n * 4)); CHECK(cudaMalloc(&d_count, 4));
  CHECK(cudaMalloc(&d_sum, 4));
  size_t temp_sort = 0, temp_reduce = 0, temp_select = 0;
  CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_sort, d_in, d_out, d_vin, d_vout, n, 0, 32, st));
  CHECK(cub::DeviceReduce::Sum(nullptr, temp_reduce, d_vin, d_sum, n, st));
  CHECK(cub::DeviceSelect::If(nullptr, temp_select, d_in, d_sel, d_count, n, IsSmall(), st));
  void *temp; size_t temp_bytes = std::max(temp_sort, std::max(temp_reduce, temp_select));
  CHECK(cudaMalloc(&temp, temp_bytes));
  long launches_hint = 0;
  for (int r = 0; r < rounds; r++) {
    unsigned seed = 0x9e3779b9u * (r + 1);
    // Thrust on the default stream.
    thrust::sequence(keys.begin(), keys.end());
    thrust::transform(keys.begin(), keys.end(), keys.begin(), Scramble{seed});
    thrust::transform(keys.begin(), keys.end(), vals.begin(), ToFloat());
    keys2 = keys;
    thrust::sort(keys2.begin(), keys2.end());
    thrust::sort_by_key(keys.begin(), keys.end(), vals.begin());
    float total = thrust::reduce(vals.begin(), vals.end(), 0.0f);
    thrust::inclusive_scan(vals.begin(), vals.end(), scanned.begin());
    long small = thrust::count_if(keys.begin(), keys.end(), IsSmall());
    thrust::transform(keys2.begin(), keys2.end(), flags.begin(), HighBits());
    auto end = thrust::unique(flags.begin(), flags.end());
    long uniq = end - flags.begin();
    h_thrust = hash_device(keys2, h_thrust);
    h_thrust = hash_device(vals, h_thrust);
    {
      thrust::host_vector<float> v = vals, got = scanned;
      double prefix = 0, magnitude = 0;
      for (int i = 0; i < n; i++) {
        prefix += v[i]; magnitude += v[i] < 0 ? -v[i] : v[i];
        double err = got[i] - prefix;
        if ((err < 0 ? -err : err) > 1e-5 * magnitude + 1e-3) scan_wrong++;
      }
      h_float_scan = fnv(got.data(), n * 4, h_float_scan);
    }
    thrust::inclusive_scan(keys2.begin(), keys2.end(), keys2.begin());
    h_thrust = hash_device(keys2, h_thrust);
    h_values = fnv(&total, sizeof total, h_values);
    h_values = fnv(&small, sizeof small, h_values);
    h_values = fnv(&uniq, sizeof uniq, h_values);
    // Thrust on the program's stream.
    thrust::transform(thrust::cuda::par.on(st), keys.begin(), keys.end(), keys.begin(), Scramble{seed + 1});
    thrust::sort(thrust::cuda::par.on(st), keys.begin(), keys.end());
    unsigned top = thrust::reduce(thrust::cuda::par.on(st), keys.begin(), keys.begin() + 1024, 0u,
                                  thrust::maximum<unsigned>());
    h_values = fnv(&top, sizeof top, h_values);
    // CUB on the program's stream, with the program's temporary storage.
    CHECK(cudaMemcpyAsync(d_in, thrust::raw_pointer_cast(keys2.data()), n * 4, cudaMemcpyDeviceToDevice, st));
    CHECK(cudaMemcpyAsync(d_vin, thrust::raw_pointer_cast(vals.data()), n * 4, cudaMemcpyDeviceToDevice, st));
    size_t bytes = temp_sort;
    CHECK(cub::DeviceRadixSort::SortPairs(temp, bytes, d_in, d_out, d_vin, d_vout, n, 0, 32, st));
    bytes = temp_reduce;
    CHECK(cub::DeviceReduce::Sum(temp, bytes, d_vout, d_sum, n, st));
    bytes = temp_select;
    CHECK(cub::DeviceSelect::If(temp, bytes, d_out, d_sel, d_count, n, IsSmall(), st));
    int count = 0; float sum = 0;
    CHECK(cudaMemcpyAsync(&count, d_count, 4, cudaMemcpyDeviceToHost, st));
    CHECK(cudaMemcpyAsync(&sum, d_sum, 4, cudaMemcpyDeviceToHost, st));
    CHECK(cudaStreamSynchronize(st));
    std::vector<unsigned> out(n), sel(count);
    CHECK(cudaMemcpy(out.data(), d_out, n * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(sel.data(), d_sel, count * 4, cudaMemcpyDeviceToHost));
    h_cub = fnv(out.data(), n * 4, h_cub);
    h_cub = fnv(sel.data(), count * 4, h_cub);
    h_cub = fnv(&count, 4, h_cub);
    h_cub = fnv(&sum, 4, h_cub);
    launches_hint++;
  }
  CHECK(cudaDeviceSynchronize());
  printf("result thrust %016llx\n", (unsigned long long)h_thrust);
  printf("result float_scan_off %ld\n", scan_wrong);
  printf("float_scan_bits %016llx\n", (unsigned long long)h_float_scan);
  printf("result thrust_values %016llx\n", (unsigned long long)h_values);
  printf("result cub %016llx\n", (unsigned long long)h_cub);
  printf("result error %s\n", cudaGetErrorString(cudaGetLastError()));
  printf("rounds %ld\n", launches_hint);
  return 0;
}

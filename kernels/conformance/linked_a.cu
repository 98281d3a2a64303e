// One of two objects linked into one module (nvlink; see kernels/conformance/build_linked.sh): each has its own
// compiler constants (`__unnamed_1`, `$str`: nvlink keeps both objects' under the same names, as in NCCL's kernel
// modules) and its own `static` counter (which nvlink renames apart: `__nv_static_<hash>_..._counter`). A loader
// must keep each object's variables apart though their names agree.
static __device__ int counter = 100;

// Copies `s` (its NUL, then zeros) to out[0..n].
static __device__ void copy_string(char *out, const char *s, int n) {
  int len = 0;
  while (s[len]) len++;
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = i < len ? s[i] : 0;
}

extern "C" __global__ void fill_a(char *name, char *literal, int *count) {
  copy_string(name, __PRETTY_FUNCTION__, 64);
  copy_string(literal, "a string literal of object a", 64);
  if (threadIdx.x == 0) *count = ++counter;
}

// Loads a module linked from two objects (kernels/conformance/linked_locals.sm_90.cubin, the path in argv[1]) with
// the driver API and runs each kernel twice: each prints the `__PRETTY_FUNCTION__` and the string literal of its own
// object (both objects name them `__unnamed_1` and `$str`) and its own `static` counter.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda.h>
#define CHECK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { printf("cuda error %d at %d\n", (int)r, __LINE__); return 1; } } while (0)

int main(int argc, char **argv) {
  if (argc < 2) { printf("usage: linked_module CUBIN\n"); return 2; }
  FILE *f = fopen(argv[1], "rb");
  if (!f) { printf("cannot open %s\n", argv[1]); return 2; }
  std::vector<char> image;
  char chunk[4096];
  size_t n;
  while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) image.insert(image.end(), chunk, chunk + n);
  fclose(f);
  CHECK(cuInit(0));
  CUdevice dev; CHECK(cuDeviceGet(&dev, 0));
  CUcontext ctx; CHECK(cuDevicePrimaryCtxRetain(&ctx, dev)); CHECK(cuCtxSetCurrent(ctx));
  CUmodule m; CHECK(cuModuleLoadData(&m, image.data()));
  CUdeviceptr out; CHECK(cuMemAlloc(&out, 256));
  for (int round = 1; round <= 2; round++) {
    for (const char *name : {"fill_a", "fill_b"}) {
      CUfunction k; CHECK(cuModuleGetFunction(&k, m, name));
      CHECK(cuMemsetD8(out, 0xff, 256));
      CUdeviceptr lit = out + 64, count = out + 128;
      void *params[] = {&out, &lit, &count};
      CHECK(cuLaunchKernel(k, 1, 1, 1, 32, 1, 1, 0, 0, params, nullptr));
      CHECK(cuCtxSynchronize());
      char back[132];
      CHECK(cuMemcpyDtoH(back, out, sizeof back));
      back[63] = back[127] = 0;
      printf("result %s round %d name \"%s\" literal \"%s\" counter %d\n", name, round, back, back + 64, *(int *)(back + 128));
    }
  }
  printf("result done no error\n");
  CHECK(cuMemFree(out));
  CHECK(cuModuleUnload(m));
  return 0;
}

// The CUDA backend's factories when numoe is built without CUDA (NUMOE_CUDA=OFF, or AUTO without nvcc):
// callers compile and link either way and get a clear Unavailable at run time.
#include "backends/cuda/cuda_model.h"
#include "backends/cuda/kernel_profile.h"

namespace numoe {

int CudaDeviceCount() { return 0; }

StatusOr<double> MeasureDeviceCopyGBps(int, int64_t, int) {
  return absl::UnavailableError("numoe was built without CUDA");
}
StatusOr<double> MeasureHostToDeviceGBps(int, int64_t, int) {
  return absl::UnavailableError("numoe was built without CUDA");
}
bool CudaCompiledIn() { return false; }

StatusOr<std::vector<PackedMoeBenchPoint>> BenchPackedMoe(int, const std::vector<int64_t>&, int64_t, int64_t, int64_t,
                                                          int64_t, bool, int) {
  return absl::UnavailableError("numoe was built without CUDA");
}
StatusOr<double> MeasureMmaBf16PeakFlops(int) { return absl::UnavailableError("numoe was built without CUDA"); }

StatusOr<std::unique_ptr<CudaBackend>> CreateCudaBackend(const Checkpoint&, const CudaOptions&) {
  return absl::UnavailableError("numoe was built without CUDA (configure with -DNUMOE_CUDA=ON and nvcc present)");
}

StatusOr<std::unique_ptr<ModelBackend>> CreateCudaModel(const Checkpoint& ckpt, const CudaOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> b, CreateCudaBackend(ckpt, options));
  return std::unique_ptr<ModelBackend>(std::move(b));
}

StatusOr<std::unique_ptr<CudaBackend>> CreateSyntheticCudaBackend(const ModelConfig&, const CudaOptions&, uint64_t) {
  return absl::UnavailableError("numoe was built without CUDA (configure with -DNUMOE_CUDA=ON and nvcc present)");
}

namespace cuda {
namespace internal {
std::atomic<bool> kernel_profile_active{false};
uint64_t PushNote(std::string, int64_t) { return 0; }
void PopNote() {}
}  // namespace internal
Status StartKernelProfile() { return absl::UnavailableError("numoe was built without CUDA"); }
StatusOr<std::vector<KernelRecord>> StopKernelProfile() {
  return absl::UnavailableError("numoe was built without CUDA");
}
}  // namespace cuda

}  // namespace numoe

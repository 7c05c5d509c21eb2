// numoe-bench cuda --packed-moe: cuda::PackedMoe timed on random packed experts (cuda_model.h BenchPackedMoe).
#include <algorithm>
#include <random>
#include <vector>

#include "backends/cuda/cuda_model.h"
#include "backends/cuda/device_memory.h"
#include "backends/cuda/kernels.h"
#include "common/packed_layout.h"

namespace numoe {

StatusOr<std::vector<PackedMoeBenchPoint>> BenchPackedMoe(int device, const std::vector<int64_t>& rows, int64_t k,
                                                          int64_t experts, int64_t hidden, int64_t inter,
                                                          bool split_activations, int iters) {
  if (k < 1 || k > experts) return absl::InvalidArgumentError("packed-moe bench: k must be in [1, experts]");
  if (iters < 1) return absl::InvalidArgumentError("packed-moe bench: iters must be >= 1");
  NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  const experts::PackedExpertShape shape{hidden, inter};
  const int64_t stride = shape.stride();
  ASSIGN_OR_RETURN(cuda::DeviceMem layer,
                   cuda::DeviceMem::Alloc(static_cast<size_t>(experts * stride), "packed experts"));
  // Scales around 2^-6: dot products of O(1) activations stay O(1) (the timing does not depend on it).
  cuda::FillPackedExperts(layer.as<uint8_t>(), experts, hidden, inter, stride, 119, 1, nullptr);
  NUMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  const int64_t max_rows = *std::max_element(rows.begin(), rows.end());
  ASSIGN_OR_RETURN(cuda::DeviceMem x, cuda::DeviceMem::Alloc(static_cast<size_t>(max_rows * hidden) * 4, "x"));
  ASSIGN_OR_RETURN(cuda::DeviceMem out, cuda::DeviceMem::Alloc(static_cast<size_t>(max_rows * hidden) * 4, "out"));
  ASSIGN_OR_RETURN(cuda::DeviceMem ids, cuda::DeviceMem::Alloc(static_cast<size_t>(max_rows * k) * 4, "ids"));
  ASSIGN_OR_RETURN(cuda::DeviceMem wts, cuda::DeviceMem::Alloc(static_cast<size_t>(max_rows * k) * 4, "weights"));
  cuda::FillUniformF32(x.as<float>(), max_rows * hidden, -1.0f, 1.0f, 2, nullptr);
  std::mt19937 rng(3);
  std::vector<int32_t> h_ids(static_cast<size_t>(max_rows * k));
  std::vector<float> h_w(h_ids.size());
  std::vector<int32_t> perm(static_cast<size_t>(experts));
  for (int64_t r = 0; r < max_rows; ++r) {  // k distinct experts per row (a partial Fisher-Yates shuffle)
    for (int64_t e = 0; e < experts; ++e) perm[static_cast<size_t>(e)] = static_cast<int32_t>(e);
    for (int64_t j = 0; j < k; ++j) {
      std::uniform_int_distribution<int64_t> pick(j, experts - 1);
      std::swap(perm[static_cast<size_t>(j)], perm[static_cast<size_t>(pick(rng))]);
      h_ids[static_cast<size_t>(r * k + j)] = perm[static_cast<size_t>(j)];
      h_w[static_cast<size_t>(r * k + j)] = 1.0f / static_cast<float>(k);
    }
  }
  NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(ids.get(), h_ids.data(), h_ids.size() * 4, cudaMemcpyHostToDevice));
  NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(wts.get(), h_w.data(), h_w.size() * 4, cudaMemcpyHostToDevice));
  cudaEvent_t e0, e1;
  NUMOE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e0));
  NUMOE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e1));
  std::vector<PackedMoeBenchPoint> points;
  Status st;
  for (int64_t n : rows) {
    const int64_t scratch_bytes = cuda::PackedMoeScratchBytes(n, k, hidden, inter);
    auto scratch = cuda::DeviceMem::Alloc(static_cast<size_t>(scratch_bytes), "PackedMoe scratch");
    if (!scratch.ok()) {
      st = scratch.status();
      break;
    }
    cuda::PackedMoeArgs a;
    a.layer = layer.as<uint8_t>();
    a.num_experts = experts;
    a.hidden = hidden;
    a.inter = inter;
    a.stride = stride;
    a.x = x.as<float>();
    a.ids = ids.as<int32_t>();
    a.weights = wts.as<float>();
    a.n = n;
    a.k = k;
    a.swiglu_limit = 10.0f;
    a.out = out.as<float>();
    a.scratch = scratch->get();
    a.split_activations = split_activations;
    if (const std::string bad = cuda::PackedMoeCheck(a); !bad.empty()) {
      st = absl::InvalidArgumentError(bad);
      break;
    }
    float best = 1e30f;
    for (int i = 0; i <= iters && st.ok(); ++i) {
      (void)cudaEventRecord(e0);
      const cudaError_t err = cuda::PackedMoe(a, nullptr);
      (void)cudaEventRecord(e1);
      if (err == cudaSuccess) (void)cudaEventSynchronize(e1);
      const cudaError_t sync = cudaGetLastError();
      if (err != cudaSuccess || sync != cudaSuccess) {
        st = absl::InternalError(std::string("PackedMoe: ") + cudaGetErrorString(err != cudaSuccess ? err : sync));
        break;
      }
      float ms = 0;
      (void)cudaEventElapsedTime(&ms, e0, e1);
      if (i > 0) best = std::min(best, ms);  // the first call warms up
    }
    if (!st.ok()) break;
    PackedMoeBenchPoint p;
    p.rows = n;
    p.ms = best;
    p.flops = 6.0 * static_cast<double>(n * k) * static_cast<double>(hidden) * static_cast<double>(inter) /
              (best * 1e-3);
    p.mma_flops = p.flops * (split_activations ? 2 : 1);
    p.scratch_bytes = scratch_bytes;
    points.push_back(p);
  }
  (void)cudaEventDestroy(e0);
  (void)cudaEventDestroy(e1);
  RETURN_IF_ERROR(st);
  return points;
}

StatusOr<double> MeasureMmaBf16PeakFlops(int device) {
  NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  const double flops = cuda::MmaBf16PeakFlops(200.0);
  if (!(flops > 0)) return absl::InternalError("the mma peak loop failed");
  return flops;
}

}  // namespace numoe

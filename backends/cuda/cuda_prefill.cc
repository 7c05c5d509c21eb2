// CUDA backend: GPU prefill. Large passes compute their routed experts on rank 0's GPU from a worker's packed
// expert layers in host memory (HostExperts, model/backend.h), double-buffered: layer l + 1 uploads on the
// copy stream while layer l computes (PackedMoe, kernels.h). Every layer's experts are uploaded whole (all
// experts of the layer: the router of layer l + 1 is only known once layer l is done, and waiting for it would
// serialise the copy behind the compute). One set of device buffers serves every attachment: a pass with host
// experts makes no ExpertBackend call, but may give the model up between its layers (ExpertBackend::YieldModel:
// a prefill lane beside decode lanes), and a pass that runs meanwhile computes its experts the usual way
// (host_pass_active_); each pass ends synchronised.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>

#include "common/log.h"
#include "common/packed_layout.h"
#include "backends/cuda/cuda_model_internal.h"

namespace numoe::cuda {

namespace {

// Checks `e` against the model: the main layers, the routed-expert shapes, every layer inside a region.
Status CheckHostExperts(const HostExperts& e, const ModelConfig& c) {
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(absl::StrCat("host experts: ", what)); };
  if (static_cast<int64_t>(e.layers.size()) != c.num_hidden_layers) {
    return bad(absl::StrCat("layers holds ", e.layers.size(), " layers, the model has ", c.num_hidden_layers));
  }
  if (e.num_experts != c.n_routed_experts) {
    return bad(absl::StrCat("num_experts ", e.num_experts, ", the model routes to ", c.n_routed_experts));
  }
  if (e.hidden != c.hidden_size || e.inter != c.moe_intermediate_size) {
    return bad(absl::StrCat("expert shape hidden ", e.hidden, " x inter ", e.inter, ", the model's is ", c.hidden_size,
                            " x ", c.moe_intermediate_size));
  }
  const int64_t stride = experts::PackedExpertShape{e.hidden, e.inter}.stride();
  if (e.stride != stride) return bad(absl::StrCat("stride ", e.stride, ", the packed layout's is ", stride));
  if (e.regions.empty()) return bad("no regions");
  for (size_t l = 0; l < e.layers.size(); ++l) {
    const uint8_t* p = e.layers[l];
    bool inside = false;
    for (const HostExperts::Region& r : e.regions) {
      inside = inside || (p != nullptr && r.data != nullptr && p >= r.data && p + e.layer_bytes() <= r.data + r.bytes);
    }
    if (!inside) return bad(absl::StrCat("layers[", l, "] is not inside any region"));
  }
  return absl::OkStatus();
}

}  // namespace

StatusOr<HostExpertsAttachment> CudaModel::AttachHostExperts(const HostExperts* e) {
  if (e == nullptr) return absl::InvalidArgumentError("host experts: null");
  if (host_experts_.count(e) != 0) return absl::AlreadyExistsError("host experts: already attached");
  RETURN_IF_ERROR(CheckHostExperts(*e, cfg_));
  Rank& r0 = *ranks_[0];
  NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(r0.device));
  int read_only = 0;
  if (cudaDeviceGetAttribute(&read_only, cudaDevAttrHostRegisterReadOnlySupported, r0.device) != cudaSuccess) {
    (void)cudaGetLastError();
    read_only = 0;
  }
  HostExpertsAttachment out;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<void*> registered;
  auto unregister = [&] {
    for (void* p : registered) (void)cudaHostUnregister(p);
  };
  for (const HostExperts::Region& reg : e->regions) {
    void* p = const_cast<uint8_t*>(reg.data);  // read-only registration where supported; never written
    const unsigned flags = cudaHostRegisterPortable | (read_only != 0 ? cudaHostRegisterReadOnly : 0u);
    const cudaError_t err = cudaHostRegister(p, static_cast<size_t>(reg.bytes), flags);
    if (err == cudaErrorHostMemoryAlreadyRegistered) {
      // Pinned already (another model of this process attached the same experts): usable, and not ours to undo.
      (void)cudaGetLastError();
      continue;
    }
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      unregister();
      return absl::FailedPreconditionError(absl::StrCat(
          "cudaHostRegister of ", reg.bytes, " bytes of host experts", read_only != 0 ? " (read-only)" : "",
          " failed: ", cudaGetErrorString(err),
          read_only != 0 ? "" : " (this device cannot register read-only host memory: map the experts writable)"));
    }
    registered.push_back(p);
  }
  out.register_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // The device side, once for every attachment (grown for a larger layer).
  auto fail = [&](const Status& st) {
    unregister();
    return st;
  };
  const int64_t layer_bytes = e->layer_bytes();
  if (layer_bytes > prefill_layer_bytes_) {
    for (int b = 0; b < 2; ++b) {
      prefill_layer_[b].Reset();
      auto m = DeviceMem::Alloc(static_cast<size_t>(layer_bytes), "GPU prefill layer buffer");
      if (!m.ok()) return fail(m.status());
      prefill_layer_[b] = std::move(*m);
    }
    prefill_layer_bytes_ = layer_bytes;
  }
  const int64_t scratch = PackedMoeScratchBytes(rows_cap_, cfg_.num_experts_per_tok, e->hidden, e->inter);
  if (static_cast<int64_t>(prefill_scratch_.bytes()) < scratch) {
    prefill_scratch_.Reset();
    auto m = DeviceMem::Alloc(static_cast<size_t>(scratch), "GPU prefill expert scratch");
    if (!m.ok()) return fail(m.status());
    prefill_scratch_ = std::move(*m);
  }
  if (prefill_stream_ == nullptr) {
    if (cudaStreamCreateWithFlags(&prefill_stream_, cudaStreamNonBlocking) != cudaSuccess) {
      prefill_stream_ = nullptr;
      return fail(CudaError(cudaGetLastError(), "cudaStreamCreate (GPU prefill)", __FILE__, __LINE__));
    }
    for (int b = 0; b < 2; ++b) {
      if (cudaEventCreateWithFlags(&prefill_ready_[b], cudaEventDisableTiming) != cudaSuccess ||
          cudaEventCreateWithFlags(&prefill_free_[b], cudaEventDisableTiming) != cudaSuccess) {
        return fail(CudaError(cudaGetLastError(), "cudaEventCreate (GPU prefill)", __FILE__, __LINE__));
      }
    }
  }
  out.device_bytes = 2 * prefill_layer_bytes_ + static_cast<int64_t>(prefill_scratch_.bytes());

  // Host-to-device bandwidth from the registered memory: one layer, best of 3.
  cudaEvent_t a = nullptr, b = nullptr;
  if (cudaEventCreate(&a) != cudaSuccess || cudaEventCreate(&b) != cudaSuccess) {
    return fail(CudaError(cudaGetLastError(), "cudaEventCreate (GPU prefill timing)", __FILE__, __LINE__));
  }
  float best_ms = 0;
  cudaError_t err = cudaSuccess;
  for (int i = 0; i < 3 && err == cudaSuccess; ++i) {
    err = cudaEventRecord(a, prefill_stream_);
    if (err == cudaSuccess) {
      err = cudaMemcpyAsync(prefill_layer_[0].get(), e->layers[0], static_cast<size_t>(layer_bytes),
                            cudaMemcpyHostToDevice, prefill_stream_);
    }
    if (err == cudaSuccess) err = cudaEventRecord(b, prefill_stream_);
    if (err == cudaSuccess) err = cudaEventSynchronize(b);
    float ms = 0;
    if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, a, b);
    if (err == cudaSuccess && (i == 0 || ms < best_ms)) best_ms = ms;
  }
  (void)cudaEventDestroy(a);
  (void)cudaEventDestroy(b);
  if (err != cudaSuccess) return fail(CudaError(err, "timing a host experts upload", __FILE__, __LINE__));
  out.h2d_gbps = best_ms > 0 ? static_cast<double>(layer_bytes) / (best_ms * 1e-3) / 1e9 : 0.0;
  host_experts_[e] = std::move(registered);
  return out;
}

void CudaModel::DetachHostExperts(const HostExperts* e) {
  auto it = host_experts_.find(e);
  if (it == host_experts_.end()) return;
  (void)cudaSetDevice(ranks_[0]->device);
  if (prefill_stream_ != nullptr) (void)cudaStreamSynchronize(prefill_stream_);
  for (void* p : it->second) (void)cudaHostUnregister(p);
  host_experts_.erase(it);
}

void CudaModel::ReleaseHostExperts() {
  if (ranks_.empty()) return;
  (void)cudaSetDevice(ranks_[0]->device);
  if (prefill_stream_ != nullptr) (void)cudaStreamSynchronize(prefill_stream_);
  for (auto& [e, regions] : host_experts_) {
    for (void* p : regions) (void)cudaHostUnregister(p);
  }
  host_experts_.clear();
  for (int b = 0; b < 2; ++b) {
    if (prefill_ready_[b] != nullptr) (void)cudaEventDestroy(prefill_ready_[b]);
    if (prefill_free_[b] != nullptr) (void)cudaEventDestroy(prefill_free_[b]);
  }
  if (prefill_stream_ != nullptr) (void)cudaStreamDestroy(prefill_stream_);
  prefill_stream_ = nullptr;
}

bool CudaModel::UseHostExperts(const ExpertBackend* experts, int64_t rows) const {
  const HostExperts* e = experts->host_experts();
  return e != nullptr && e->min_rows > 0 && rows >= e->min_rows && host_experts_.count(e) != 0 &&
         e->layer_bytes() <= prefill_layer_bytes_ && !host_pass_active_;
}

Status CudaModel::BeginHostExpertPass(const HostExperts* e) {
  prefill_ = e;
  prefill_error_ = cudaSuccess;
  NUMOE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ranks_[0]->device));
  const int L = static_cast<int>(cfg_.num_hidden_layers);
  for (int l = 0; l < std::min(L, 2); ++l) UploadHostLayer(l);
  NUMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

void CudaModel::UploadHostLayer(int l) {
  const int b = l % 2;
  auto note = [&](cudaError_t e) {
    if (e != cudaSuccess && prefill_error_ == cudaSuccess) prefill_error_ = e;
  };
  note(cudaStreamWaitEvent(prefill_stream_, prefill_free_[b], 0));  // the layer two before is done with it
  // In pieces of 64 MB (~1 ms of PCIe): the small host-to-device copies of a decode lane's step, issued on
  // their own stream meanwhile, wait for one piece at most instead of a whole layer's upload.
  constexpr int64_t kPiece = int64_t{64} << 20;
  const int64_t bytes = prefill_->layer_bytes();
  auto* dst = static_cast<uint8_t*>(prefill_layer_[b].get());
  const uint8_t* src = prefill_->layers[static_cast<size_t>(l)];
  for (int64_t at = 0; at < bytes; at += kPiece) {
    note(cudaMemcpyAsync(dst + at, src + at, static_cast<size_t>(std::min(kPiece, bytes - at)), cudaMemcpyHostToDevice,
                         prefill_stream_));
  }
  note(cudaEventRecord(prefill_ready_[b], prefill_stream_));
}

void CudaModel::EnqueueHostExpertLayer(Rank& r, int l, const PassDims& d) {
  const int b = l % 2;
  auto note = [&](cudaError_t e) {
    if (e != cudaSuccess && prefill_error_ == cudaSuccess) prefill_error_ = e;
  };
  Scratch& s = r.sc;
  note(cudaStreamWaitEvent(r.stream, prefill_ready_[b], 0));
  PackedMoeArgs a;
  a.layer = prefill_layer_[b].as<uint8_t>();
  a.num_experts = prefill_->num_experts;
  a.hidden = prefill_->hidden;
  a.inter = prefill_->inter;
  a.stride = prefill_->stride;
  a.x = s.xn;
  a.ids = s.ids;
  a.weights = s.wts;
  a.n = d.n;
  a.k = cfg_.num_experts_per_tok;
  a.swiglu_limit = static_cast<float>(cfg_.swiglu_limit);
  a.out = s.routed;
  a.scratch = prefill_scratch_.get();
  note(PackedMoe(a, r.stream));
  note(cudaEventRecord(prefill_free_[b], r.stream));
  if (l + 2 < cfg_.num_hidden_layers) UploadHostLayer(l + 2);
}

}  // namespace numoe::cuda

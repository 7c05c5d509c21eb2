#include "backends/cuda/weights.h"

#include <cmath>
#include <cstring>
#include <random>

#include "common/quant.h"

namespace numoe::cuda {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

uint64_t NameSeed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull ^ seed;
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

void ToTarget(const std::vector<float>& src, WType t, std::vector<uint8_t>* dst) {
  dst->resize(src.size() * static_cast<size_t>(WTypeBytes(t)));
  if (t == WType::kF32) {
    std::memcpy(dst->data(), src.data(), dst->size());
  } else {
    auto* p = reinterpret_cast<uint16_t*>(dst->data());
    for (size_t i = 0; i < src.size(); ++i) p[i] = FloatToBf16(src[i]);
  }
}

}  // namespace

WeightSource::WeightSource(const Checkpoint* ckpt, const ModelConfig& cfg, bool fp32, bool fp8_weights, uint64_t seed)
    : ckpt_(ckpt), cfg_(cfg), fp32_(fp32), fp8_weights_(fp8_weights), seed_(seed) {
  if (ckpt_ == nullptr) {
    for (ExpectedTensor& e : ExpectedTensors(cfg_, 0)) {
      if (!e.routed_expert) expected_[e.name] = std::move(e);
    }
  }
}

bool WeightSource::HasTensor(const std::string& name) const {
  if (ckpt_ == nullptr) return expected_.count(name) > 0;
  return ckpt_->store().Find(name) != nullptr;
}

StatusOr<StagedMatrix> WeightSource::Matrix(const std::string& name, int64_t out, int64_t in, int64_t r0, int64_t rows,
                                            int64_t c0, int64_t cols, bool force_wide) const {
  if (r0 < 0 || c0 < 0 || rows <= 0 || cols <= 0 || r0 + rows > out || c0 + cols > in) {
    return absl::InternalError(absl::StrCat(name, ": bad slice rows [", r0, ", +", rows, ") cols [", c0, ", +", cols,
                                            ") of [", out, ", ", in, "]"));
  }
  StagedMatrix m;
  m.name = name;
  m.rows = rows;
  m.cols = cols;
  m.bo = static_cast<int32_t>(cfg_.fp8_block_out);
  m.bi = static_cast<int32_t>(cfg_.fp8_block_in);
  bool stored_fp8 = false;
  bool stored_bf16 = false;
  const TensorView* t = nullptr;
  const TensorView* s = nullptr;
  if (ckpt_ == nullptr) {
    auto it = expected_.find(name);
    if (it == expected_.end()) return absl::NotFoundError(absl::StrCat("synthetic model has no tensor '", name, "'"));
    if (it->second.shape.size() != 2 || it->second.shape[0] != out || it->second.shape[1] != in) {
      return absl::InternalError(absl::StrCat(name, ": synthetic shape mismatch"));
    }
    stored_fp8 = it->second.format == WeightFormat::kFp8Block;
    stored_bf16 = !stored_fp8;
  } else {
    ASSIGN_OR_RETURN(t, ckpt_->Raw(name));
    stored_fp8 = t->dtype == DType::kF8_E4M3;
    stored_bf16 = t->dtype == DType::kBF16;
    if (stored_fp8) {
      s = ckpt_->store().Find(ScaleNameOf(name));
      if (s == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, ": FP8 weight without its scale"));
      if (t->shape.size() != 2 || t->shape[0] != out || t->shape[1] != in) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": expected [", out, ", ", in, "]"));
      }
    }
  }
  if (stored_fp8 && fp8_weights_) {
    m.type = WType::kFP8;
    m.row_base = r0;
    m.col_base = c0;
    m.scale_rows = CeilDiv(out, m.bo);
    m.scale_cols = CeilDiv(in, m.bi);
    m.scale.assign(static_cast<size_t>(m.scale_rows * m.scale_cols), 0x1p-7f);
    if (ckpt_ == nullptr) return m;
    if (s->numel() != m.scale_rows * m.scale_cols) {
      return absl::InvalidArgumentError(absl::StrCat(ScaleNameOf(name), ": expected ", m.scale_rows, "x", m.scale_cols,
                                                     " block scales, got ", s->numel()));
    }
    if (s->dtype == DType::kF8_E8M0) {
      for (int64_t i = 0; i < s->numel(); ++i) m.scale[static_cast<size_t>(i)] = E8M0ToFloat(s->data[i]);
    } else if (s->dtype == DType::kF32) {
      std::memcpy(m.scale.data(), s->data, m.scale.size() * sizeof(float));
    } else {
      return absl::InvalidArgumentError(absl::StrCat(ScaleNameOf(name), ": scale dtype must be F8_E8M0 or F32"));
    }
    m.bytes.resize(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(m.bytes.data() + r * cols, t->data + (r0 + r) * in + c0, static_cast<size_t>(cols));
    }
    return m;
  }
  m.type = (fp32_ && (!stored_bf16 || force_wide)) ? WType::kF32 : WType::kBF16;
  if (ckpt_ == nullptr) return m;
  ASSIGN_OR_RETURN(F32Tensor f, ckpt_->LoadF32(name));
  if (f.shape.size() != 2 || f.shape[0] != out || f.shape[1] != in) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected logical shape [", out, ", ", in, "]"));
  }
  std::vector<float> slice(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(slice.data() + r * cols, f.data.data() + (r0 + r) * in + c0, static_cast<size_t>(cols) * sizeof(float));
  }
  ToTarget(slice, m.type, &m.bytes);
  return m;
}

StatusOr<std::vector<float>> WeightSource::Vector(const std::string& name, int64_t numel) const {
  if (ckpt_ != nullptr) {
    ASSIGN_OR_RETURN(F32Tensor t, ckpt_->LoadF32(name));
    if (t.numel() != numel) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected ", numel, " values, got ", t.numel()));
    }
    return std::move(t.data);
  }
  std::vector<float> v(static_cast<size_t>(numel));
  std::mt19937_64 rng(NameSeed(seed_, name));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const bool is_norm = name.find("norm") != std::string::npos;
  const bool is_hc_scale = name.find("hc_") != std::string::npos && name.find("scale") != std::string::npos;
  for (float& x : v) x = is_norm ? 1.0f : is_hc_scale ? 1.0f : 0.05f * u(rng);
  return v;
}

StatusOr<std::vector<int32_t>> WeightSource::Tid2Eid(const std::string& name, int64_t vocab, int64_t k,
                                                     int64_t experts) const {
  std::vector<int32_t> ids(static_cast<size_t>(vocab * k));
  if (ckpt_ == nullptr) {
    std::mt19937_64 rng(NameSeed(seed_, name));
    for (int32_t& e : ids) e = static_cast<int32_t>(rng() % static_cast<uint64_t>(experts));
    return ids;
  }
  ASSIGN_OR_RETURN(F32Tensor t, ckpt_->LoadF32(name));
  if (t.numel() != vocab * k) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected [", vocab, ", ", k, "]"));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    const float e = t.data[i];
    if (!(e >= 0 && e < static_cast<float>(experts))) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expert id ", e, " out of range"));
    }
    ids[i] = static_cast<int32_t>(e);
  }
  return ids;
}

bool StackRows(const std::vector<StagedMatrix>& parts, StagedMatrix* out) {
  if (parts.empty()) return false;
  const StagedMatrix& f = parts[0];
  StagedMatrix m;
  m.name = f.name + "+";
  m.type = f.type;
  m.cols = f.cols;
  m.bo = f.bo;
  m.bi = f.bi;
  m.scale_cols = f.scale_cols;
  m.col_base = f.col_base;
  const bool synthetic = f.bytes.empty();
  for (const StagedMatrix& p : parts) {
    if (p.type != m.type || p.cols != m.cols || p.bytes.empty() != synthetic) return false;
    if (m.type == WType::kFP8) {
      if (p.row_base % p.bo != 0 || p.rows % p.bo != 0 || p.bo != m.bo || p.bi != m.bi || p.col_base != m.col_base ||
          p.scale_cols != m.scale_cols) {
        return false;
      }
    }
  }
  for (const StagedMatrix& p : parts) {
    m.rows += p.rows;
    m.bytes.insert(m.bytes.end(), p.bytes.begin(), p.bytes.end());
    if (m.type == WType::kFP8) {
      const int64_t sr0 = p.row_base / p.bo, srn = p.rows / p.bo;
      m.scale.insert(m.scale.end(), p.scale.begin() + sr0 * p.scale_cols, p.scale.begin() + (sr0 + srn) * p.scale_cols);
      m.scale_rows += srn;
    }
  }
  *out = std::move(m);
  return true;
}

StatusOr<DevW> Upload(const StagedMatrix& m, uint64_t seed, cudaStream_t stream, std::vector<DeviceMem>* keep) {
  DevW w;
  w.type = m.type;
  w.out = m.rows;
  w.in = m.cols;
  const size_t bytes = static_cast<size_t>(m.rows * m.cols * WTypeBytes(m.type));
  ASSIGN_OR_RETURN(DeviceMem data, DeviceMem::Alloc(bytes, m.name));
  if (!m.bytes.empty()) {
    if (m.bytes.size() != bytes) return absl::InternalError(absl::StrCat(m.name, ": staged size mismatch"));
    NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(data.get(), m.bytes.data(), bytes, cudaMemcpyHostToDevice));
  } else {
    const uint64_t s = NameSeed(seed, m.name);
    const float amp = 1.0f / std::sqrt(static_cast<float>(m.cols));
    if (m.type == WType::kFP8) {
      FillFp8(data.as<uint8_t>(), m.rows * m.cols, s, stream);
    } else if (m.type == WType::kBF16) {
      FillUniformBf16(data.as<__nv_bfloat16>(), m.rows * m.cols, amp, s, stream);
    } else {
      FillUniformF32(data.as<float>(), m.rows * m.cols, -amp, amp, s, stream);
    }
    NUMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  w.data = data.get();
  keep->push_back(std::move(data));
  if (m.type == WType::kFP8) {
    ASSIGN_OR_RETURN(float* sc, UploadF32(m.scale, m.name + ".scale", stream, keep));
    w.scale = sc;
    w.row_base = m.row_base;
    w.col_base = m.col_base;
    w.bo = m.bo;
    w.bi = m.bi;
    w.scale_cols = m.scale_cols;
  }
  return w;
}

StatusOr<float*> UploadF32(const std::vector<float>& v, const std::string& what, cudaStream_t,
                           std::vector<DeviceMem>* keep) {
  ASSIGN_OR_RETURN(DeviceMem d, DeviceMem::Alloc(std::max<size_t>(v.size(), 1) * sizeof(float), what));
  if (!v.empty()) NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(d.get(), v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
  float* p = d.as<float>();
  keep->push_back(std::move(d));
  return p;
}

StatusOr<int32_t*> UploadI32(const std::vector<int32_t>& v, const std::string& what, cudaStream_t,
                             std::vector<DeviceMem>* keep) {
  ASSIGN_OR_RETURN(DeviceMem d, DeviceMem::Alloc(std::max<size_t>(v.size(), 1) * sizeof(int32_t), what));
  if (!v.empty()) {
    NUMOE_CUDA_RETURN_IF_ERROR(cudaMemcpy(d.get(), v.data(), v.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
  int32_t* p = d.as<int32_t>();
  keep->push_back(std::move(d));
  return p;
}

}  // namespace numoe::cuda

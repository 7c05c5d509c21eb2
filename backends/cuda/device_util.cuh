// Device-side helpers shared by the .cu files: number formats, weight element loads, block reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernels.h"

namespace numoe::cuda {

// FP8 E4M3FN -> fp32, exact: the 7 magnitude bits land in the fp32 exponent/mantissa fields and a multiply
// by 2^120 rebases the exponent (subnormals included). 0x7F/0xFF (NaN) read as 480; weights never hold them.
__device__ __forceinline__ float Fp8ToF32(uint32_t b) {
  const float mag = __uint_as_float((b & 0x7Fu) << 20) * 0x1p120f;
  return (b & 0x80u) ? -mag : mag;
}

__device__ __forceinline__ float Bf16ToF32(uint16_t v) { return __uint_as_float(static_cast<uint32_t>(v) << 16); }

// Two floats as a packed bf16 pair (round to nearest even), `a` in the low half (the lower k of an mma operand).
__device__ __forceinline__ uint32_t PackBf16(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float2 Bf16PairToF32(uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u));
}

// d += A·B for one m16n8k16 tile: bf16 operands (A row-major a0..a3, B column-major b0, b1), fp32 accumulators.
__device__ __forceinline__ void Mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// cp.async of 16 bytes (sm_80+); `valid` false zero-fills the destination and reads nothing.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int size = valid ? 16 : 0;  // 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(size) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ldmatrix of four 8x8 b16 matrices; lanes 8i..8i+7 address the rows of matrix i. The .trans form hands each
// thread the transposed elements (the B operand of an mma from a k-major tile).
__device__ __forceinline__ void Ldmatrix4(uint32_t (&r)[4], const void* smem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}

__device__ __forceinline__ void Ldmatrix4Trans(uint32_t (&r)[4], const void* smem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}

__device__ __forceinline__ float ToF32(float v) { return v; }
__device__ __forceinline__ float ToF32(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T FromF32(float v);
template <>
__device__ __forceinline__ float FromF32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 FromF32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Two consecutive cache values (index i even, 8-byte / 4-byte aligned) as float2.
__device__ __forceinline__ float2 Load2(const float* p, int64_t i) { return *reinterpret_cast<const float2*>(p + i); }
__device__ __forceinline__ float2 Load2(const __nv_bfloat16* p, int64_t i) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p + i));
}
// Four consecutive values (i multiple of 4).
__device__ __forceinline__ float4 Load4(const float* p, int64_t i) { return *reinterpret_cast<const float4*>(p + i); }
__device__ __forceinline__ float4 Load4(const __nv_bfloat16* p, int64_t i) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p + i);
  return make_float4(Bf16ToF32(raw.x & 0xFFFF), Bf16ToF32(raw.x >> 16), Bf16ToF32(raw.y & 0xFFFF),
                     Bf16ToF32(raw.y >> 16));
}

// One weight element W[r, c] (any format), fp32.
__device__ __forceinline__ float LoadWElem(const DevW& w, int64_t r, int64_t c) {
  const int64_t i = r * w.in + c;
  switch (w.type) {
    case WType::kF32:
      return static_cast<const float*>(w.data)[i];
    case WType::kBF16:
      return Bf16ToF32(static_cast<const uint16_t*>(w.data)[i]);
    default: {
      const float s = w.scale[((w.row_base + r) / w.bo) * w.scale_cols + (w.col_base + c) / w.bi];
      return Fp8ToF32(static_cast<const uint8_t*>(w.data)[i]) * s;
    }
  }
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum; every thread gets the result. `red` is shared scratch of >= 32 floats. blockDim % 32 == 0.
__device__ __forceinline__ float BlockSum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = WarpSum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < nw ? red[lane] : 0.0f;
  t = WarpSum(t);
  return t;
}

__device__ __forceinline__ float BlockMax(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < nw ? red[lane] : -INFINITY;
  return WarpMax(t);
}

// Warp-wide argmax (largest value, then lowest index): every lane ends with the warp's (v, idx).
__device__ __forceinline__ void WarpArgmax(float& v, int32_t& idx) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ov > v || (ov == v && oi < idx)) {
      v = ov;
      idx = oi;
    }
  }
}

// Block-wide argmax (largest value, then lowest index). `rv`/`ri` shared scratch of >= 32 entries.
__device__ __forceinline__ void BlockArgmax(float& v, int32_t& idx, float* rv, int32_t* ri) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  WarpArgmax(v, idx);
  __syncthreads();
  if (lane == 0) {
    rv[warp] = v;
    ri[warp] = idx;
  }
  __syncthreads();
  v = lane < nw ? rv[lane] : -INFINITY;
  idx = lane < nw ? ri[lane] : INT32_MAX;
  WarpArgmax(v, idx);
}

// Address of compressed entry `e` of a store (page_off, epp entries per page, dim wide) of slot `slot`.
template <typename CacheT>
__device__ __forceinline__ CacheT* EntryPtr(const CacheDev& c, int32_t slot, int64_t page_off, int32_t epp, int dim,
                                            int64_t e) {
  const int32_t page = c.table[static_cast<int64_t>(slot) * c.max_pages + e / epp];
  return static_cast<CacheT*>(c.pages) + page * c.page_elems + page_off + (e % epp) * dim;
}

template <typename T>
__device__ __forceinline__ T* SlotPtr(const CacheDev& c, int32_t slot, int64_t off_bytes) {
  return reinterpret_cast<T*>(c.fixed + slot * c.slot_bytes + off_bytes);
}

}  // namespace numoe::cuda

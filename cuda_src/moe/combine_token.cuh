// One token's combine: y[t] = bf16(sum over valid slots k, in slot order, of fp32(partial[k][t])).
// Shared by the combine kernel and the fused kernel's tail, so both round identically.
#pragma once

#include "common/types.cuh"
#include "moe/params.cuh"
#include "ptx/cvt.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt::moe {

static_assert(kMaxTopk <= 32, "a slot mask holds one bit per top-k slot");

// Slots of `token` that routed to some expert (empty and refused slots are not: the
// classification of routed_expert, without reporting again what routing reported).
template <typename IdxT>
__device__ __forceinline__ u32 valid_slot_mask(const MoeParams& p, u32 token) {
    u32 mask = 0;
    for (u32 k = 0; k < p.num_topk; ++k)
        if (routed_expert<IdxT>(p, token * p.num_topk + k, /*report=*/false) >= 0) mask |= 1u << k;
    return mask;
}

// Slots whose partials are loaded together before any is added: the loads of a chunk are
// in flight at once instead of one latency per slot.
constexpr u32 kCombineSlotChunk = 8;

// Eight bf16 columns per thread and step; `lane`/`lanes` split the row among cooperating threads.
// Partials are written earlier in the same launch by the fused kernel: plain loads.
__device__ __forceinline__ void combine_token(const MoeParams& p, u32 token, u32 mask, u32 lane, u32 lanes) {
    const u64 slot_stride = static_cast<u64>(p.token_capacity) * p.hidden * 2;
    const u8* base = p.combine + static_cast<u64>(token) * p.hidden * 2;
    u16* out = p.y + static_cast<u64>(token) * p.hidden;
    for (u32 c = lane * 8; c < p.hidden; c += lanes * 8) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (u32 k0 = 0; k0 < p.num_topk; k0 += kCombineSlotChunk) {
            // Empty slots read as +0: adding it leaves every sum bit for bit unchanged (the
            // sum starts at +0, so a -0 could never have survived either).
            ptx::u32x4 v[kCombineSlotChunk];
#pragma unroll
            for (u32 j = 0; j < kCombineSlotChunk; ++j) {
                v[j] = ptx::u32x4{0u, 0u, 0u, 0u};
                if (k0 + j < p.num_topk && (mask >> (k0 + j) & 1u))
                    v[j] = *reinterpret_cast<const ptx::u32x4*>(base + (k0 + j) * slot_stride + c * 2ull);
            }
#pragma unroll
            for (u32 j = 0; j < kCombineSlotChunk; ++j) {
                const u32 words[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    acc[2 * w] += ptx::bf16_bits_to_f32(static_cast<u16>(words[w] & 0xFFFFu));
                    acc[2 * w + 1] += ptx::bf16_bits_to_f32(static_cast<u16>(words[w] >> 16));
                }
            }
        }
        ptx::u32x4 packed;
        packed.x = ptx::cvt_rn_bf16x2_f32(acc[0], acc[1]);
        packed.y = ptx::cvt_rn_bf16x2_f32(acc[2], acc[3]);
        packed.z = ptx::cvt_rn_bf16x2_f32(acc[4], acc[5]);
        packed.w = ptx::cvt_rn_bf16x2_f32(acc[6], acc[7]);
        *reinterpret_cast<ptx::u32x4*>(out + c) = packed;
    }
}

}  // namespace megamoe_rt::moe

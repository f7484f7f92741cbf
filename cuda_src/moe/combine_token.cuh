// One token's combine: y[t] = bf16(sum over valid slots k, in slot order, of fp32(partial[k][t])).
// Shared by the combine kernel and the fused kernel's tail, so both round identically.
#pragma once

#include "common/types.cuh"
#include "moe/params.cuh"
#include "ptx/cvt.cuh"
#include "ptx/ld_st.cuh"

namespace megamoe_rt::moe {

static_assert(kMaxTopk <= 32, "a slot mask holds one bit per top-k slot");

// Slots of `token` that routed to some expert: the classification of routed_expert (empty,
// out-of-range and repeated slots are not; routing has reported them already), computed by a
// whole warp at once. Called by all 32 lanes of a converged warp; every lane gets the mask.
// Lane k loads slot k's id, so a token costs one load per lane instead of one per pair of slots.
template <typename IdxT>
__device__ __forceinline__ u32 valid_slot_mask(const MoeParams& p, u32 token) {
    const u32 lane = threadIdx.x % 32;
    const i64 id = lane < p.num_topk ? load_expert_id<IdxT>(p, token * p.num_topk + lane) : -1;
    const bool in_range = id >= 0 && id < static_cast<i64>(p.num_experts);
    // Lanes with the same id; a slot is repeated when a lower lane (an earlier slot) has it.
    const u32 same = __match_any_sync(0xFFFFFFFFu, static_cast<unsigned long long>(id));
    const bool valid = in_range && (same & ((1u << lane) - 1u)) == 0;
    return __ballot_sync(0xFFFFFFFFu, valid);
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

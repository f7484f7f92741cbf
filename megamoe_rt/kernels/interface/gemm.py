"""The grouped FP8 GEMM (cuda_src/gemm/): parameters, group layouts, flags, shared memory.

Epilogues are policy types registered in megamoe_rt/kernels/epilogues.py; their parameter
structs are declared here, one per epilogue, beside the mainloop's.
"""

from megamoe_rt.kernels.interface.decl import (
    F32,
    I32,
    U8,
    U32,
    U64,
    Constant,
    Enum,
    EnumValue,
    Field,
    Flag,
    Flags,
    Header,
    Ptr,
    Struct,
    Value,
    formula,
)
from megamoe_rt.kernels.interface.sync import WAIT_CONTEXT

BLOCK_K = Constant("kBlockK", 128, doc="K per pipeline stage; e4m3: one 128-byte swizzled row")
SMEM_LIMIT = Constant("kSmemLimit", 232448, doc="opt-in dynamic shared memory per block on sm_90 (227 KiB)")
SMEM_ALIGN_SLACK = Constant(
    "kSmemAlignSlack", 1024, doc="the dynamic shared-memory base is only 16-byte aligned; tiles need 1024"
)
EPILOGUE_SCRATCH_BYTES = Constant(
    "kEpilogueScratchBytes", 2 * 64 * 4, doc="per-row amax exchange between N-split math warpgroups"
)
BARRIER_BYTES_PER_STAGE = Constant("kBarrierBytesPerStage", 2 * 8, doc="a full and an empty mbarrier")
TILE_SLOT_BYTES = Constant(
    "kTileSlotBytes",
    32,
    doc="a tile as the grouped GEMM's producer announces it to the math warpgroups, one slot per stage",
)
BLOCK_MAP_ROWS = Constant(
    "kBlockMapRows", 128, doc="rows of one pool block named by GemmParams::block_map (a multiple of every BLOCK_M)"
)

GROUP_LAYOUT = Enum(
    "GroupLayout",
    [
        EnumValue(
            "kContiguous",
            "contiguous",
            "rows of group g at [group_offsets[g], group_offsets[g+1]), starts BLOCK_M-aligned",
        ),
        EnumValue(
            "kMasked",
            "masked",
            "group g owns rows [g * masked_rows, (g + 1) * masked_rows); first masked_counts[g] valid",
        ),
    ],
)

FLAGS = Flags(
    "Flags",
    [
        Flag("kClamp", 0, "clamp", "clamp gate <= limit, |up| <= limit"),
        Flag("kPow2Scale", 1, "pow2_scale", "round requant scales up to powers of two"),
    ],
    doc="SwigluFp8Params::flags",
)

GEMM_PARAMS = Struct(
    "GemmParams",
    [
        Field(
            "num_rows",
            U32,
            "rows of A and D (contiguous: a window of row_base + num_rows rows of the group layout)\n"
            "or num_groups * masked_rows (masked)",
        ),
        Field("n", U32, "output columns per group"),
        Field("k", U32, "reduction length, a multiple of 128"),
        Field("num_groups", U32),
        Field("masked_rows", U32, "masked layout: rows per group"),
        Field(
            "row_base",
            U32,
            "contiguous: the group layout's row that is row 0 of A and D (a ring's window of the\n"
            "pool: group offsets and per-row metadata are in pool rows, A and D in window rows); 0 otherwise",
        ),
        Field("group_offsets", Ptr(I32, const=True), "contiguous: [num_groups + 1]"),
        Field("group_counts", Ptr(I32, const=True), "contiguous, optional: valid rows per group (nullptr: all)"),
        Field("masked_counts", Ptr(I32, const=True), "masked: [num_groups]"),
        Field("sfb", Ptr(F32, const=True), "[num_groups, n / kBSfN, k / 128]"),
        Field(
            "layout_state",
            Ptr(U32, const=True),
            "written by the group-layout check just before: nonzero = invalid, the GEMM does nothing (nullptr: unchecked)",
        ),
        Field(
            "block_map",
            Ptr(I32, const=True),
            "contiguous, optional: where each kBlockMapRows-row block of the group layout lives in A, D and the\n"
            "per-row metadata (block b's rows at block_map[b] * kBlockMapRows; nullptr: in place). A streamed\n"
            "call's pool hands blocks out as chunks arrive and lays the experts out over them afterwards",
        ),
        Field("wait", WAIT_CONTEXT, "the deadline of the pipeline's shared-memory waits (mbarriers)"),
    ],
    doc="Runtime parameters of the grouped FP8 GEMM's mainloop and tile schedule; what a finished\n"
    "tile is written to is the epilogue's own struct below. Every offset and stride is computed\n"
    "on the host and arrives ready to use.",
)

# Each epilogue's parameters: the kernel's second argument (the policy's ``Params``).
STORE_BF16_PARAMS = Struct(
    "StoreBf16Params",
    [
        Field("d", Ptr(U8), "bf16 rows of D"),
        Field("d_row_stride_bytes", U64),
    ],
    doc="StoreBf16Epilogue: the tile as bf16 rows of D.",
)

SCATTER_BF16_PARAMS = Struct(
    "ScatterBf16Params",
    [Field("row_dst", Ptr(U64, const=True), "per row of the group layout: its destination byte address (0: skipped)")],
    doc="ScatterBf16Epilogue: each bf16 row to its own address.",
)

SWIGLU_FP8_PARAMS = Struct(
    "SwigluFp8Params",
    [
        Field("flags", U32, "Flags"),
        Field("swiglu_limit", F32),
        Field("d", Ptr(U8), "e4m3 rows of the activations, n / 2 wide"),
        Field("d_row_stride_bytes", U64),
        Field("d_sf", Ptr(F32), "their scales, [n / 2 / gran, d_sf_row_stride] (K-block major)"),
        Field("d_sf_row_stride", U64, "in floats (>= num_rows)"),
        Field("row_weight", Ptr(F32, const=True), "per row of the group layout: its top-k weight"),
    ],
    doc="SwigluFp8Epilogue: SwiGLU of the interleaved gate|up columns, times the row's weight,\n"
    "requantized to e4m3 with a scale per group of out_sf_gran activations.",
)


@formula(
    doc="Shared memory of one pipeline stage: A and B tiles and an A-scale slot with room for\n"
    "64-wide groups, so GEMMs that differ only in A-scale granularity share one carve-up."
)
def stage_bytes(block_m: Value, block_n: Value) -> Value:
    return block_m * BLOCK_K + block_n * BLOCK_K + (BLOCK_K // 64) * block_m * 4


@formula(doc="Bytes TMA delivers per stage (the full barrier's transaction count).")
def stage_tx_bytes(block_m: Value, block_n: Value, a_sf_gran: Value) -> Value:
    return block_m * BLOCK_K + block_n * BLOCK_K + (BLOCK_K // a_sf_gran) * block_m * 4


@formula(doc="Shared memory besides the stages: epilogue scratch, barriers, alignment slack.")
def fixed_smem_bytes(stages: Value) -> Value:
    return EPILOGUE_SCRATCH_BYTES + BARRIER_BYTES_PER_STAGE * stages + SMEM_ALIGN_SLACK


@formula(
    doc="The tile pipeline's shared memory (stages, scratch, barriers, slack): what gemm::Config lays\n"
    "out and the fused kernel shares between its two GEMMs."
)
def pipeline_smem_bytes(block_m: Value, block_n: Value, stages: Value) -> Value:
    return stages * stage_bytes(block_m, block_n) + fixed_smem_bytes(stages)


@formula(doc="Dynamic shared memory of a grouped GEMM launch: the pipeline and one tile slot per stage.")
def dynamic_smem_bytes(block_m: Value, block_n: Value, stages: Value) -> Value:
    return pipeline_smem_bytes(block_m, block_n, stages) + TILE_SLOT_BYTES * stages


HEADER = Header(
    "gemm",
    "megamoe_rt::gemm",
    [
        BLOCK_K,
        SMEM_LIMIT,
        SMEM_ALIGN_SLACK,
        EPILOGUE_SCRATCH_BYTES,
        BARRIER_BYTES_PER_STAGE,
        TILE_SLOT_BYTES,
        BLOCK_MAP_ROWS,
        GROUP_LAYOUT,
        FLAGS,
        GEMM_PARAMS,
        STORE_BF16_PARAMS,
        SCATTER_BF16_PARAMS,
        SWIGLU_FP8_PARAMS,
        stage_bytes,
        stage_tx_bytes,
        fixed_smem_bytes,
        pipeline_smem_bytes,
        dynamic_smem_bytes,
    ],
    doc="The grouped FP8 GEMM's parameters, group layouts, flags and shared-memory sizes.",
    module=__name__,
)

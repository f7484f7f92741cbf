"""FP8 quantization kernels (cuda_src/quantize/)."""

from megamoe_rt.kernels.interface.decl import F32, U8, U32, U64, VOID, Constant, Field, Header, Ptr, Struct

GROUP = Constant("kGroupSize", 128, doc="elements per activation scale (1 x 128) and weight block side (128 x 128)")
THREADS = Constant("kQuantizeThreads", 256)
WEIGHT_THREADS = Constant("kWeightQuantThreads", 512, doc="one 128 x 128 block: four threads per row")

QUANTIZE_PARAMS = Struct(
    "QuantizeParams",
    [
        Field("x", Ptr(VOID, const=True), "bf16 bits or fp32, row-major, contiguous"),
        Field("q", Ptr(U8), "e4m3 codes, row-major"),
        Field("sf", Ptr(F32), "[rows, hidden / 128]"),
        Field("num_groups", U64, "rows * hidden / 128"),
        Field("groups_per_row", U32, "hidden / 128"),
        Field("pad_", U32),
    ],
    doc="Per-token 1 x 128 activation quantization.",
)

WEIGHT_QUANTIZE_PARAMS = Struct(
    "WeightQuantizeParams",
    [
        Field("w", Ptr(VOID, const=True), "[groups, n, k] bf16 bits or fp32"),
        Field("q", Ptr(U8), "[groups, n, k]"),
        Field("sf", Ptr(F32), "[groups, n / 128, k / 128]"),
        Field("n", U32),
        Field("k", U32),
        Field("num_blocks", U32, "groups * (n / 128) * (k / 128)"),
        Field("pad_", U32),
    ],
    doc="128 x 128 block weight quantization.",
)

HEADER = Header(
    "quantize",
    "megamoe_rt",
    [
        GROUP,
        THREADS,
        WEIGHT_THREADS,
        QUANTIZE_PARAMS,
        WEIGHT_QUANTIZE_PARAMS,
    ],
    doc="Parameters of the FP8 quantization kernels.",
    module=__name__,
)

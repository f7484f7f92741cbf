"""Input errors the kernels detect and report to the host without stopping (cuda_src/common/error_report.cuh).

A kernel that meets a bad input (an expert id out of range, a grouped GEMM's group offsets out
of order) does what keeps memory safe (drops the pair, skips the GEMM) and stores one word into
the caller's :data:`ERROR_REPORT`, which lives in mapped pinned host memory: the host reads it
without synchronising and raises (megamoe_rt.runtime.error_report).
"""

from megamoe_rt.kernels.interface.decl import U64, Array, Constant, Enum, EnumValue, Field, Header, Struct

ERROR_KIND = Enum(
    "ErrorKind",
    [
        EnumValue(
            "kExpertIdOutOfRange",
            "expert_id_out_of_range",
            "a routed id is outside [-1, num_experts); the pair is dropped",
            "expert id outside [-1, num_experts)",
        ),
        EnumValue(
            "kRepeatedExpertId",
            "repeated_expert_id",
            "an expert appears twice in one token's top-k; the later slot is dropped",
            "expert repeated within a token's top-k",
        ),
        EnumValue(
            "kPoolOverflow",
            "pool_overflow",
            "the routing needs more pool rows than the buffer holds (details: rows needed, rows held)",
            "routing overflows the expert pool",
        ),
        EnumValue(
            "kGroupLayout",
            "group_layout",
            "grouped GEMM: group offsets or counts break the layout contract; the GEMM is skipped",
            "grouped GEMM group layout invalid",
        ),
    ],
    doc="What a kernel found wrong with its inputs; one word of ErrorReport each.",
    count="kCount",
    message_fn="error_kind_name",
    default_message="unknown error",
)

ERROR_RAISED = Constant(
    "kErrorRaised",
    1 << 63,
    type=U64,
    hex=True,
    doc="set in a report word once its kind occurred; bits 62..32 and 31..0 carry two details",
)

ERROR_REPORT = Struct(
    "ErrorReport",
    [
        Field(
            "words",
            Array(U64, len(ERROR_KIND.values)),
            "per ErrorKind: 0, or kErrorRaised | (where & 0x7fffffff) << 32 | what",
        ),
    ],
    doc="Mapped pinned host memory the kernels of one layer (or one GEMM plan) report into.\n"
    "Words are written with plain system-scope stores, each by whichever thread found the\n"
    "error last: a word names one occurrence, not all of them.",
)

HEADER = Header(
    "errors",
    "megamoe_rt::errors",
    [ERROR_KIND, ERROR_RAISED, ERROR_REPORT],
    doc="Input errors found on the device and the report the host reads them from.",
    module=__name__,
)

"""Probe and synthetic workloads for partition experiments (cuda_src/probe/)."""

from megamoe_rt.kernels.interface.decl import U32, U64, Field, Header, Opaque, Ptr, Struct

_U32X4 = Opaque("ptx::u32x4", include="ptx/ld_st.cuh")

SM_PROBE_PARAMS = Struct(
    "SmProbeParams",
    [
        Field("smid", Ptr(U32), "[grid]"),
        Field("start_ns", Ptr(U64), "[grid]"),
        Field("end_ns", Ptr(U64), "[grid]"),
        Field("spin_ns", U64),
    ],
    doc="sm_probe: each block records its SM and %globaltimer at start and end.",
)

STREAM_COPY_PARAMS = Struct(
    "StreamCopyParams",
    [
        Field("src", Ptr(_U32X4, const=True)),
        Field("dst", Ptr(_U32X4)),
        Field("n16", U64, "16-byte words to copy"),
    ],
    doc="stream_copy: a memory-bound workload.",
)

HEADER = Header(
    "probe",
    "megamoe_rt::probe",
    [SM_PROBE_PARAMS, STREAM_COPY_PARAMS],
    doc="Parameters of the probe kernels.",
    module=__name__,
)

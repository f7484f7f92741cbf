"""The unfused layer's cross-rank kernels (cuda_src/ep/); their bank layout is also the fused
kernel's across ranks."""

from megamoe_rt.kernels.interface.decl import (
    I32,
    U32,
    U64,
    Constant,
    Field,
    Header,
    Ptr,
    Struct,
    Value,
    formula,
    packed_offsets,
)
from megamoe_rt.kernels.interface.moe import MOE_PARAMS
from megamoe_rt.kernels.interface.sync import WAIT_CONTEXT

MAX_EXPERTS = Constant(
    "kMaxExperts", 1024, doc="global experts: the count kernel's shared histogram and one scan block"
)
THREADS = Constant("kThreads", 256)
MAX_RANKS = Constant(
    "kMaxRanks", 256, doc="ep_publish and ep_finish signal and wait with one thread of a kThreads block per rank"
)
SCAN_THREADS = Constant("kScanThreads", 1024, doc="one block scans every global expert")

EP_BANK_LAYOUT = Struct(
    "EpBankLayout",
    [
        Field("words", U32),
        Field("recv_counts", U32, "[num_ranks][num_local_experts] rows source s sends to local expert e"),
        Field("recv_offsets", U32, "[num_ranks][num_local_experts] where they start in s's send list"),
        Field("count_ready", U32, "[num_ranks] source s has published its counts and send list"),
        Field("combine_ready", U32, "[num_ranks] rank s has scattered every partial it owes this rank"),
        Field("pool_cycles", U32, "one word: the most pool cycles any rank runs this launch (each rank's max)"),
    ],
    doc="Words peers write into this rank's buffer, in one of two banks picked by the launch parity\n"
    "(the launch zeroes the other bank for the next one; megamoe_rt/schedule/ep_protocol.py\n"
    "models why that is safe). Word offsets inside a bank, computed on the host.",
)


@formula(
    doc="u32 words of one bank (EpBankLayout::words): two [num_ranks][num_local_experts]\n"
    "tables, two [num_ranks] flag rows and the pool-cycle word."
)
def bank_words(num_ranks: Value, num_local_experts: Value) -> Value:
    return 2 * num_ranks * num_local_experts + 2 * num_ranks + 1


def bank_region_words(num_ranks: int, num_local_experts: int) -> dict[str, int]:
    """u32 words of each region of one bank, in :data:`EP_BANK_LAYOUT`'s field order."""
    r, el = int(num_ranks), int(num_local_experts)
    return {
        "recv_counts": r * el,
        "recv_offsets": r * el,
        "count_ready": r,
        "combine_ready": r,
        "pool_cycles": 1,
    }


def bank_offsets(num_ranks: int, num_local_experts: int) -> dict[str, int]:
    """The values of :data:`EP_BANK_LAYOUT` for one bank (the host's ``EpBankLayout``): each
    region's first word, the regions packed in field order, and ``words``, which is
    :func:`bank_words` (what the buffer layout reserves per bank)."""
    out = packed_offsets(EP_BANK_LAYOUT, bank_region_words(num_ranks, num_local_experts))
    words = bank_words(int(num_ranks), int(num_local_experts))
    if out["words"] != words:
        raise AssertionError(f"EpBankLayout: the regions take {out['words']} words, bank_words() reserves {words}")
    return out


EP_PARAMS = Struct(
    "EpParams",
    [
        Field(
            "moe",
            MOE_PARAMS,
            "this rank's tokens and routing, pool, combine buffer, y;\n"
            "expert_counts = received rows per local expert (all sources)",
        ),
        Field("peer_bases", Ptr(U64, const=True), "[num_ranks] base address of every rank's buffer (own included)"),
        Field("off_x", U64, "byte offsets of regions, the same on every rank"),
        Field("off_x_sf", U64),
        Field("off_send_list", U64),
        Field("off_combine", U64),
        Field("off_banks", U64),
        Field(
            "staging",
            U64,
            "NVSHMEM transport: this rank's staging rows [pool_rows, H] bf16, where the L2 epilogue\n"
            "leaves the partials owed to other ranks until they are put (0 with peer pointers)",
        ),
        Field("send_counts", Ptr(I32), "[num_experts] this rank's pairs per global expert"),
        Field("send_offsets", Ptr(I32), "[num_experts + 1] exclusive scan: send list grouped by expert"),
        Field("send_cursors", Ptr(I32), "[num_experts]"),
        Field("send_list", Ptr(U64), "[num_tokens * num_topk] (weight bits << 32) | (token * num_topk + slot)"),
        Field("src_rows", Ptr(I32), "[num_local_experts][num_ranks + 1] first pool row per source; last = end"),
        Field("banks", Ptr(U32), "this rank's banks (bank b at banks + b * bank.words)"),
        Field("bank", EP_BANK_LAYOUT),
        Field("launch_epoch", Ptr(U32)),
        Field("wait", WAIT_CONTEXT),
        Field("rank", U32),
        Field("num_ranks", U32),
    ],
    doc="Parameters of the expert-parallel kernels of the unfused layer. Regions of the symmetric\n"
    "buffer sit at the same offsets on every rank, so a peer's region is peer_bases[peer] + its offset.",
)

HEADER = Header(
    "ep",
    "megamoe_rt::ep",
    [
        MAX_EXPERTS,
        MAX_RANKS,
        THREADS,
        SCAN_THREADS,
        EP_BANK_LAYOUT,
        bank_words,
        EP_PARAMS,
    ],
    doc="Parameters, bank layout and limits of the expert-parallel kernels of the unfused layer.",
    module=__name__,
)

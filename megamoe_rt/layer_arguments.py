"""A layer's constructor arguments, checked once, and what the ranks agree on.

:func:`check_layer_arguments` turns ``MegaMoE(...)``'s arguments into a :class:`LayerArguments`
(the :class:`~megamoe_rt.modes.base.LayerSpec` plus the settings LayerSpec does not hold) or
raises the TypeError/ValueError naming the argument; it touches no GPU and no other rank.

Across ranks every setting of a layer is the same on every rank (compared when the layers are
constructed, ep/agreement.py), except the few each rank has for itself, listed here with the
reason. Agreed: every LayerSpec field not in :data:`RANK_LOCAL_SPEC_FIELDS` (so a new field is
agreed unless listed here), and :data:`AGREED_LAYER_SETTINGS`, the constructor's settings
LayerSpec does not hold. tests/cpu/test_rank_agreement.py holds every constructor parameter to
one of the two.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from megamoe_rt.kernels import moe as mk
from megamoe_rt.modes.base import LayerSpec, check_transport
from megamoe_rt.modes.registry import select_mode
from megamoe_rt.runtime import args
from megamoe_rt.runtime.deadlines import wait_timeout_ns
from megamoe_rt.schedule.layout import check_channels
from megamoe_rt.schedule.plan import check_expert_split
from megamoe_rt.schedule.ring_size import check_chunk_ratio
from megamoe_rt.schedule.streaming import StreamConfig

RANK_LOCAL_SPEC_FIELDS: dict[str, str] = {
    "rank": "the rank's own number in the group",
    "device": "the rank's own GPU",
    "sm_count": "the SM count of the rank's own GPU: grids are per rank, nothing across ranks counts SMs",
    "split_sms": (
        "the split mode's SM partition of the rank's own GPU (tuned per device); K1, K2 and K3 share it "
        "on that GPU only, the cross-rank protocol does not depend on it"
    ),
}

RANK_LOCAL_PARAMETERS: dict[str, str] = {
    "device": "the rank's own GPU (checked against the group's device for the rank)",
    "group": "each rank's own view of the group; its world size is agreed (num_ranks)",
    "track_expert_stats": "a counter array of the rank's own experts on its own GPU; no peer reads it",
    "split_sms": RANK_LOCAL_SPEC_FIELDS["split_sms"],
}

# Constructor settings outside LayerSpec that every rank passes alike (transport as given:
# "auto" decides which collectives construction makes before it is resolved).
AGREED_LAYER_SETTINGS = ("mode", "ring_blocks", "chunk_ratio", "validate_ids", "transport", "token_window")


def agreed_settings(spec: LayerSpec, **layer_settings: object) -> dict[str, object]:
    """Every setting the ranks' layers must share, by name: the fields of ``spec`` but the
    rank-local ones, then ``layer_settings`` (exactly :data:`AGREED_LAYER_SETTINGS`; a value
    there wins over the field of the same name)."""
    if set(layer_settings) != set(AGREED_LAYER_SETTINGS):
        raise TypeError(f"agreed_settings: expected the settings {AGREED_LAYER_SETTINGS}, got {tuple(layer_settings)}")
    out: dict[str, object] = {
        f.name: getattr(spec, f.name) for f in fields(spec) if f.name not in RANK_LOCAL_SPEC_FIELDS
    }
    out.update(layer_settings)
    return out


@dataclass(frozen=True)
class LayerArguments:
    """``MegaMoE(...)``'s arguments once checked: the spec the mode runs (its transport
    ``"nvlink"`` until an ``"auto"`` choice is resolved; with a token window its token capacity
    is the window's) and the constructor settings LayerSpec does not hold."""

    spec: LayerSpec
    capacity: int  # num_max_tokens_per_rank as given: the most tokens a call may have
    token_window: int | None  # as given; the spec holds min(capacity, token_window)
    mode: str | None
    ring_blocks: int | None
    chunk_ratio: float | str | None
    validate_ids: bool
    transport: str  # as given: "auto", "nvlink" or "nvshmem"

    @property
    def windowed(self) -> bool:
        """Whether calls run in token windows (a window smaller than the capacity)."""
        return self.spec.num_max_tokens_per_rank < self.capacity

    def agreed(self, spec: LayerSpec | None = None, *, mode: str | None = None) -> dict[str, object]:
        """The settings the ranks compare: as given, or (``spec``, ``mode``) as resolved."""
        resolved = spec is not None
        out = agreed_settings(
            spec or self.spec,
            mode=mode if resolved else self.mode,
            ring_blocks=self.ring_blocks,
            chunk_ratio=self.chunk_ratio,
            validate_ids=self.validate_ids,
            transport=(spec or self.spec).transport if resolved else self.transport,
            token_window=self.token_window,
        )
        out["num_max_tokens_per_rank"] = self.capacity  # the spec's is the window's
        return out


def check_layer_arguments(
    hidden: Any,
    intermediate: Any,
    num_experts: Any,
    num_topk: Any,
    num_max_tokens_per_rank: Any,
    *,
    rank: int,
    world: int,
    swiglu_limit: Any,
    act_sf_gran: Any,
    pow2_scale: Any,
    validate_ids: Any,
    debug: Any,
    mode: Any,
    ring_blocks: Any,
    chunk_ratio: Any,
    split_sms: Any,
    timeout_s: Any,
    streaming: Any,
    transport: Any,
    token_window: Any = None,
) -> LayerArguments:
    """The checks of ``MegaMoE``'s arguments, in the order the constructor reports them, and the
    mode's checks of its own (its name, SM counts, a ring it does not take, streaming)."""
    hidden, intermediate = check_channels(hidden, intermediate)
    # The experts over the ranks and the top-k: the layout's and the planner's one check.
    num_experts, num_topk, _ = check_expert_split(num_experts, num_topk, world)
    capacity = args.integer("num_max_tokens_per_rank", num_max_tokens_per_rank, minimum=1)
    if num_topk > mk.MAX_TOPK:
        raise ValueError(f"num_topk={num_topk}: expected at most {mk.MAX_TOPK} (the kernels' slot masks)")
    if num_experts > mk.MAX_LOCAL_EXPERTS:
        raise ValueError(f"num_experts={num_experts}: at most {mk.MAX_LOCAL_EXPERTS} experts are supported")
    act_sf_gran = args.integer_choice("act_sf_gran", act_sf_gran, (64, 128))
    if swiglu_limit is not None:
        swiglu_limit = float(args.positive_float32("swiglu_limit", swiglu_limit))
    transport = check_transport(transport, world)
    if streaming is not None:
        if not isinstance(streaming, StreamConfig):
            raise TypeError(f"streaming: expected a StreamConfig or None, got {type(streaming).__name__}")
        if streaming.tokens_per_slot > capacity:
            raise ValueError(
                f"streaming: tokens_per_slot={streaming.tokens_per_slot} exceeds num_max_tokens_per_rank="
                f"{capacity} (a chunk runs as a call of at most that many tokens)"
            )
    if chunk_ratio is not None:
        chunk_ratio = check_chunk_ratio(chunk_ratio)
    if ring_blocks is not None:
        ring_blocks = args.integer("ring_blocks", ring_blocks, minimum=1)
    if timeout_s is not None:
        wait_timeout_ns(timeout_s)  # validates
        timeout_s = float(timeout_s)  # 60 and 60.0 are one setting across ranks
    if token_window is not None:
        token_window = args.integer("token_window", token_window, minimum=1)
        if streaming is not None:
            raise ValueError(
                f"token_window={token_window}: a streamed layer's calls are already sized by its input ring "
                "(streaming=); pass one of them"
            )
    spec = LayerSpec(
        hidden,
        intermediate,
        num_experts,
        num_topk,
        capacity if token_window is None else min(capacity, token_window),
        num_ranks=world,
        rank=rank,
        act_sf_gran=act_sf_gran,
        swiglu_limit=swiglu_limit,
        pow2_scale=bool(pow2_scale),
        debug=bool(debug),
        timeout_s=timeout_s,
        split_sms=split_sms,
        streaming=streaming,
        transport="nvshmem" if transport == "nvshmem" else "nvlink",
    )
    # Before any rank starts NVSHMEM; the mode is picked again once the transport is known.
    select_mode(mode, spec, ring_blocks=ring_blocks, split_sms=split_sms, chunk_ratio=chunk_ratio)
    return LayerArguments(spec, capacity, token_window, mode, ring_blocks, chunk_ratio, bool(validate_ids), transport)

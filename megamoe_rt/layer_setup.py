"""A layer's construction on one rank: checked arguments, its GPU, the transport, the mode and
its buffer layout, the buffer, and the mode bound to it.

Across ranks construction is collective and every step that can fail on one rank only is
agreed: the ranks compare their settings before any collective, and after each step either
all go on or all raise the failing rank's error, naming it, so that no rank is left inside
NVSHMEM (megamoe_rt/ep/agreement.py; docs/USAGE.md, "Across ranks").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megamoe_rt.ep import agreement
from megamoe_rt.ep.group import RankGroup, check_group
from megamoe_rt.layer_arguments import LayerArguments, check_layer_arguments
from megamoe_rt.layer_reports import LayerReports
from megamoe_rt.modes.base import LayerSpec, Mode, buffer_layout
from megamoe_rt.modes.registry import select_mode
from megamoe_rt.modes.sizing import layer_layout
from megamoe_rt.runtime import args, devices, driver
from megamoe_rt.runtime.arrays import require_cupy
from megamoe_rt.runtime.buffer import DeviceBuffer, LayerBuffer


@dataclass
class RankSetup:
    """What construction leaves a layer on this rank."""

    given: LayerArguments
    spec: LayerSpec  # as the mode runs it (transport resolved, device and SM count filled in)
    group: RankGroup | None  # None on one rank
    rank: int
    device_info: Any
    runner: Mode
    layout: Any
    buffer: LayerBuffer
    reports: LayerReports
    expert_recv_stats: Any


class _Agreed:
    """One construction step: a failure on one rank is every rank's (one rank: raised as is)."""

    def __init__(self, group: RankGroup | None, step: str) -> None:
        self.group, self.step = group, step

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        # One rank, or an interrupt (not a set-up failure to agree on): raised here as it is.
        if self.group is None or (exc is not None and not isinstance(exc, Exception)):
            return False
        failed = agreement.gather_failures(self.group, f"MegaMoE set-up: {self.step}", exc)
        if failed:
            raise agreement.refusal(f"MegaMoE set-up ({self.step})", failed) from exc
        return True  # every rank goes on


def _checked_device(device: Any, group: RankGroup | None) -> int | None:
    """The device argument, refused on the rank that has it when it contradicts the group."""
    if device is None:
        return None if group is None else group.device
    device = args.integer("device", device, minimum=0)
    if group is not None and device != group.device:
        raise ValueError(
            f"device={device}: the rank group runs this rank on device {group.device}; "
            "pass device=None or the group's device"
        )
    return device


def set_up_rank(
    shape: tuple, *, group: RankGroup | None, device: Any, track_expert_stats: bool, **settings
) -> RankSetup:
    """Construct a layer's rank: ``shape`` is (hidden, intermediate, num_experts, num_topk,
    num_max_tokens_per_rank), ``settings`` the remaining ``MegaMoE`` keyword arguments."""
    # A group that cannot be one (world size 0, a rank outside it) cannot agree on anything:
    # refused here, on the rank that has it, before any exchange.
    rank, world = (0, 1) if group is None else check_group(group)
    device = _checked_device(device, group)
    multi = group if world > 1 else None
    # Nothing up to the comparison is collective: a rank whose arguments are refused tells the
    # others there, and every rank raises the same error.
    failure: Exception | None = None
    compared: dict[str, object] = {}
    try:
        given = check_layer_arguments(*shape, rank=rank, world=world, **settings)
        compared = given.agreed()  # "auto" is compared as given: it decides the collectives below
    except Exception as exc:
        if multi is None:
            raise
        failure = exc
    if multi is not None:
        agreement.agree_on_construction(multi, compared, failure)
    spec = given.spec
    # Every rank's GPU, before any rank starts NVSHMEM (whose start-up waits for all).
    with _Agreed(multi, "the ranks' GPUs"):
        device_info = devices.require_hopper(device)
        driver.ensure_context(device_info.ordinal)
    if multi is not None and given.transport == "auto":
        # Resolved before a mode is picked (where a peer is not mapped, only 'unfused' runs):
        # NVSHMEM starts here, its heap sized for the largest buffer the layer may take.
        from megamoe_rt.ep.symm import NvshmemRuntime
        from megamoe_rt.modes.unfused import UnfusedMode

        largest = buffer_layout(replace(spec, transport="nvshmem"), UnfusedMode.layout_needs(spec))
        runtime = NvshmemRuntime.initialize(multi, heap_bytes=largest.total_bytes)
        spec = replace(spec, transport="nvlink" if runtime.every_peer_mapped() else "nvshmem")
    # The mode and the buffer's layout (host-only; fused: a ring below the live window is
    # refused here), agreed before any memory is allocated.
    with _Agreed(multi, "the mode and the buffer's layout"):
        mode_cls = select_mode(
            given.mode,
            spec,
            ring_blocks=given.ring_blocks,
            split_sms=settings["split_sms"],
            chunk_ratio=given.chunk_ratio,
        )
        # What every call compares (a digest: it is posted with every call): the ranks call
        # layers constructed alike, the mode and transport as resolved.
        digest = agreement.settings_digest(agreement.settings_text(given.agreed(spec, mode=mode_cls.name)))
        spec = replace(spec, device=device_info.ordinal, sm_count=device_info.sm_count)
        layout = layer_layout(
            mode_cls,
            spec,
            ring_blocks=given.ring_blocks,
            chunk_ratio=given.chunk_ratio,
            free_bytes=lambda: driver.free_memory_bytes(device_info.ordinal),
        )
        runner = mode_cls(spec, layout)
    buffer: LayerBuffer
    if multi is None:
        buffer = DeviceBuffer(layout, device=device_info.ordinal)
    else:
        from megamoe_rt.ep.symm import NvshmemRuntime, SymmetricBuffer

        # Each collective (start-up, allocation) agrees first that every rank can enter it.
        runtime = NvshmemRuntime.initialize(multi, heap_bytes=layout.total_bytes)
        # Zeroed on every rank when it returns; peers unmapped only under the NVSHMEM transport.
        buffer = SymmetricBuffer(layout, runtime, require_peer_mapping=spec.transport == "nvlink")
    failure = None
    try:
        reports, stats = _bind(runner, buffer, spec, given, multi, rank, digest, track_expert_stats)
    except Exception as exc:
        if multi is None:
            raise
        failure = exc
    if multi is not None:
        failed = agreement.gather_failures(multi, "MegaMoE set-up: after the allocation", failure)
        if failed:
            error = agreement.refusal("MegaMoE set-up after the symmetric allocation", failed)
            try:
                buffer.close()  # collective: every rank is here, none keeps its part
            except Exception as exc:
                raise error from exc
            raise error from failure
    return RankSetup(given, spec, multi, rank, device_info, runner, layout, buffer, reports, stats)


def _bind(runner, buffer, spec, given, group, rank, digest, track_expert_stats) -> tuple[LayerReports, Any]:
    """The buffer's first fill, the statistics array and the report, bound into the mode."""
    # The fused kernel's counters, grid barrier and launch epoch start from zero once; after
    # that every launch leaves them ready for the next. The fills run on CuPy's stream, the
    # calls on the caller's: finish them before any call can be issued.
    cupy = require_cupy()
    with cupy.cuda.Device(spec.device):
        if group is None:
            buffer.view("workspace").fill(0)
        stats = cupy.zeros(spec.num_local_experts, dtype=cupy.int32) if track_expert_stats else None
        cupy.cuda.Device(spec.device).synchronize()
    reports = LayerReports(
        spec.device,
        num_topk=spec.num_topk,
        num_experts=spec.num_experts,
        validate_ids=given.validate_ids,
        group=group,
        rank=rank,
        settings=digest,
    )
    runner.bind(
        buffer,
        expert_recv_stats=0 if stats is None else int(stats.data.ptr),
        error_report=reports.device_ptr,
    )
    return reports, stats

"""Green contexts over SM partitions of one device (driver API, every call checked).

cuda.core 1.2 has green contexts too (``SMResource.split``, ``Device.create_context``), but
its split picks ``cuDevSmResourceSplit`` or ``cuDevSmResourceSplitByCount`` by driver
version, so which SMs a request gets would change with the driver. The partitioning below
is built on what ``cuDevSmResourceSplitByCount`` does on Hopper (groups formed along the
chip's topology, unequal partitions as unions of granularity-sized groups), so it calls
that directly; kernel nodes take the partition's ``CUcontext`` and launches its ``CUstream``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megamoe_rt.graph.partition import Request, plan_partitions
from megamoe_rt.runtime import driver


def _cu():
    from cuda.bindings import driver as cu

    return cu


def sm_resource(device: int):
    cu = _cu()
    driver.ensure_context(device)
    dev = driver.call(cu.cuDeviceGet, device)
    return driver.call(cu.cuDeviceGetDevResource, dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)


def partition_granularity(device: int) -> int:
    """Minimum SMs per partition, as the driver reports it (or, where the field is not
    filled in, as the driver rounds a one-SM request)."""
    res = sm_resource(device)
    reported = int(getattr(res.sm, "minSmPartitionSize", 0) or 0)
    align = int(getattr(res.sm, "smCoscheduledAlignment", 0) or 0)
    if reported:
        return max(reported, align)
    cu = _cu()
    groups, _, _ = driver.call(cu.cuDevSmResourceSplitByCount, 1, res, 0, 1)
    return int(groups[0].sm.smCount)


@dataclass
class GreenPartition:
    name: str
    sm_count: int
    green_ctx: Any
    ctx: Any  # CUcontext view of the green context (kernel nodes' ctx)
    stream: Any  # non-blocking stream of the green context

    @property
    def stream_handle(self) -> int:
        return int(self.stream)


class GreenPartitions:
    """Named SM partitions of a device, each with a green context and a stream.

    Partitions are carved in request order from the device's SM resource; ``close()``
    (or leaving the ``with`` block) destroys streams, then green contexts.
    """

    def __init__(self, requests: Sequence[tuple[str, Request]], *, device: int = 0):
        cu = _cu()
        self.device = device
        info = driver.require_hopper(device)
        self.granularity = partition_granularity(device)
        self.partitions: dict[str, GreenPartition] = {}
        self._closed = False
        dev = driver.call(cu.cuDeviceGet, device)
        full = sm_resource(device)
        sizes = [r for _, r in requests]
        # The driver forms groups along the chip's topology, so not every sum of
        # granularity-sized pieces is reachable (an H200 gives 2 x 64 SMs in one split but
        # only 15 groups of 8). Equal partitions come from one split of that size; others
        # are unions of one split's granularity-sized groups, "rest" taking what is left.
        if "rest" not in sizes and len(set(sizes)) == 1:
            count = sizes[0]
            self.plan = plan_partitions(info.sm_count, self.granularity, requests)
            groups, made, _ = driver.call(cu.cuDevSmResourceSplitByCount, len(sizes), full, 0, count)
            if made < len(sizes):
                raise ValueError(f"the device forms only {made} partition(s) of {count} SMs, {len(sizes)} asked")
            pieces = [[g] for g in groups[: len(sizes)]]
            self.available_sms = made * count
        else:
            groups, made, _ = driver.call(
                cu.cuDevSmResourceSplitByCount, info.sm_count // self.granularity, full, 0, self.granularity
            )
            self.available_sms = made * self.granularity
            self.plan = plan_partitions(self.available_sms, self.granularity, requests)
            pieces, first = [], 0
            for _, count in self.plan.sizes:
                take = count // self.granularity
                pieces.append(list(groups[first : first + take]))
                first += take
        try:
            for (name, count), mine in zip(self.plan.sizes, pieces):
                got = sum(int(g.sm.smCount) for g in mine)
                if got != count:
                    raise ValueError(f"partition {name!r}: asked the driver for {count} SMs, got {got}")
                desc = driver.call(cu.cuDevResourceGenerateDesc, mine, len(mine))
                gctx = driver.call(
                    cu.cuGreenCtxCreate, desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
                )
                # Registered at once, so a failure below still destroys it in close().
                part = self.partitions[name] = GreenPartition(name, got, gctx, None, None)
                part.ctx = driver.call(cu.cuCtxFromGreenCtx, gctx)
                part.stream = driver.call(cu.cuGreenCtxStreamCreate, gctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0)
            self.remainder_sms = info.sm_count - sum(p.sm_count for p in self.partitions.values())
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> GreenPartition:
        try:
            return self.partitions[name]
        except KeyError:
            raise KeyError(f"no partition {name!r}; have {', '.join(self.partitions)}") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        cu = _cu()
        first_error = None
        for part in reversed(list(self.partitions.values())):
            # Try every destroy; report the first failure after all were attempted.
            for fn, handle in ((cu.cuStreamDestroy, part.stream), (cu.cuGreenCtxDestroy, part.green_ctx)):
                if handle is None:
                    continue
                try:
                    driver.call(fn, handle)
                except Exception as exc:
                    first_error = first_error or exc
        self.partitions.clear()
        driver.ensure_context(self.device)
        if first_error is not None:
            raise first_error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

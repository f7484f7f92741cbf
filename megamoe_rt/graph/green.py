"""Green contexts over SM partitions of one device (driver API, every call checked).

cuda.core 1.2 has green contexts too (``SMResource.split``, ``Device.create_context``), but
its split picks ``cuDevSmResourceSplit`` or ``cuDevSmResourceSplitByCount`` by driver
version, so which SMs a request gets would change with the driver. The partitioning below
calls ``cuDevSmResourceSplitByCount`` directly: each partition is split off what the ones
before it left (one group of its size), and the remainder, once a green context holds it,
is split again. Measured on an H200 (bench/results/green_splits_h200_2026-12-01.md): any
multiple of 8 SMs up to 128 splits off the whole device, the remainder splits the same way
(96, then 32 of the 36 left), and without SM co-scheduling any even count does. Kernel
nodes take the partition's ``CUcontext``, launches its ``CUstream``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megamoe_rt.graph.partition import Request, plan_partitions
from megamoe_rt.runtime import devices, driver


def sm_resource(device: int):
    cu = driver.cuda_driver()
    driver.ensure_context(device)
    dev = driver.call(cu.cuDeviceGet, device)
    return driver.call(cu.cuDeviceGetDevResource, dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)


def _split_flags(fine: bool) -> int:
    cu = driver.cuda_driver()
    return int(cu.CUdevSmResourceSplitByCount_flags.CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING) if fine else 0


def partition_granularity(device: int, *, fine: bool = False) -> int:
    """Minimum SMs per partition, as the driver rounds a one-SM request: 8 on Hopper, 2 with
    ``fine`` (SM co-scheduling ignored: finer partitions, no large thread-block clusters)."""
    res = sm_resource(device)
    cu = driver.cuda_driver()
    groups, made, _ = driver.call(cu.cuDevSmResourceSplitByCount, 1, res, _split_flags(fine), 1)
    if made:
        return int(groups[0].sm.smCount)
    reported = int(getattr(res.sm, "minSmPartitionSize", 0) or 0)
    return max(reported, int(getattr(res.sm, "smCoscheduledAlignment", 0) or 0), 1)


def split_table(device: int, *, fine: bool = False) -> list[tuple[int, int, int]]:
    """``(asked, granted, left)`` for one group of each count split off the whole device:
    what the hardware allows as a first partition (nothing is created)."""
    cu = driver.cuda_driver()
    res = sm_resource(device)
    flags = _split_flags(fine)
    rows = []
    for count in range(1, int(res.sm.smCount) + 1):
        groups, made, left = driver.call(cu.cuDevSmResourceSplitByCount, 1, res, flags, count)
        rows.append((count, int(groups[0].sm.smCount) if made else 0, int(left.sm.smCount)))
    return rows


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

    def __init__(self, requests: Sequence[tuple[str, Request]], *, device: int = 0, fine: bool = False):
        cu = driver.cuda_driver()
        self.device = device
        info = devices.require_hopper(device)
        self.granularity = partition_granularity(device, fine=fine)
        self.available_sms = info.sm_count
        self.plan = plan_partitions(info.sm_count, self.granularity, requests)
        self.partitions: dict[str, GreenPartition] = {}
        self._closed = False
        self._holders: list[Any] = []  # green contexts over remainders, only to split them again
        dev = driver.call(cu.cuDeviceGet, device)
        flags = _split_flags(fine)
        try:
            # Fixed sizes in request order, each split off what is left; "rest" takes the end.
            left = sm_resource(device)
            pieces: dict[str, Any] = {}
            for name, count in self.plan.sizes:
                if dict(requests)[name] == "rest":
                    continue
                groups, made, remainder = driver.call(cu.cuDevSmResourceSplitByCount, 1, left, flags, count)
                got = int(groups[0].sm.smCount) if made else 0
                if got != count:
                    raise ValueError(
                        f"partition {name!r}: asked the driver for {count} SMs of the {int(left.sm.smCount)} left, "
                        f"got {got}; valid counts here: multiples of {self.granularity} up to "
                        f"{int(left.sm.smCount) - int(left.sm.smCount) % self.granularity}"
                    )
                pieces[name] = groups[0]
                left = self._resplittable(remainder, dev) if int(remainder.sm.smCount) else remainder
            for name, _ in self.plan.sizes:
                if name not in pieces:  # the rest: everything left
                    pieces[name] = left
            for name, _ in self.plan.sizes:
                desc = driver.call(cu.cuDevResourceGenerateDesc, [pieces[name]], 1)
                gctx = driver.call(
                    cu.cuGreenCtxCreate, desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
                )
                # Registered at once, so a failure below still destroys it in close().
                part = self.partitions[name] = GreenPartition(name, int(pieces[name].sm.smCount), gctx, None, None)
                part.ctx = driver.call(cu.cuCtxFromGreenCtx, gctx)
                part.stream = driver.call(cu.cuGreenCtxStreamCreate, gctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0)
            self.remainder_sms = info.sm_count - sum(p.sm_count for p in self.partitions.values())
        except BaseException:
            self.close()
            raise

    def _resplittable(self, remainder: Any, dev: Any) -> Any:
        """The SM resource of a green context over ``remainder``: a split's remainder can only
        be split again through one (the context stays alive until :meth:`close`)."""
        cu = driver.cuda_driver()
        desc = driver.call(cu.cuDevResourceGenerateDesc, [remainder], 1)
        holder = driver.call(cu.cuGreenCtxCreate, desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
        self._holders.append(holder)
        return driver.call(cu.cuGreenCtxGetDevResource, holder, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)

    def __getitem__(self, name: str) -> GreenPartition:
        try:
            return self.partitions[name]
        except KeyError:
            raise KeyError(f"no partition {name!r}; have {', '.join(self.partitions)}") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        cu = driver.cuda_driver()
        first_error = None
        handles = [
            (fn, handle)
            for part in reversed(list(self.partitions.values()))
            for fn, handle in ((cu.cuStreamDestroy, part.stream), (cu.cuGreenCtxDestroy, part.green_ctx))
        ] + [(cu.cuGreenCtxDestroy, h) for h in reversed(self._holders)]
        for fn, handle in handles:
            # Try every destroy; report the first failure after all were attempted.
            if handle is None:
                continue
            try:
                driver.call(fn, handle)
            except Exception as exc:
                first_error = first_error or exc
        self.partitions.clear()
        self._holders.clear()
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

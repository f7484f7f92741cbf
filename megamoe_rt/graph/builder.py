"""CUDA graphs built node by node with the driver API: kernel nodes bound to green-context
partitions (a ``CUkernel`` with the node's ``ctx``), memset nodes, explicit dependencies,
instantiation, replay and kernel-parameter updates between replays."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megamoe_rt.runtime import driver, kernel_launch, streams


@dataclass
class KernelNode:
    node: Any
    kernel: kernel_launch.LoadedKernel
    params: Any  # CUDA_KERNEL_NODE_PARAMS (kept: updates start from it)
    args: list  # ctypes arguments, alive as long as the node


def _kernel_params(kernel: kernel_launch.LoadedKernel, grid, block, args: Sequence, ctx, smem: int | None):
    cu = driver.cuda_driver()
    g = tuple(grid) + (1,) * (3 - len(tuple(grid)))
    b = tuple(block) + (1,) * (3 - len(tuple(block)))
    p = cu.CUDA_KERNEL_NODE_PARAMS()
    p.gridDimX, p.gridDimY, p.gridDimZ = g
    p.blockDimX, p.blockDimY, p.blockDimZ = b
    p.sharedMemBytes = kernel.dynamic_smem_bytes if smem is None else smem
    # A context-independent CUkernel with the node's context: this is what binds the node
    # to a green context's SM partition (func must stay NULL).
    p.kern = kernel.kernel
    p.ctx = ctx
    ptrs = (ctypes.c_void_p * max(len(args), 1))(*[ctypes.addressof(a) for a in args])
    p.kernelParams = ctypes.addressof(ptrs)
    return p, ptrs


class GraphBuilder:
    def __init__(self):
        self.graph = driver.call(driver.cuda_driver().cuGraphCreate, 0)
        self.exec = None
        self._keep: list = []

    def add_kernel(
        self,
        kernel: kernel_launch.LoadedKernel,
        grid,
        block,
        args: Sequence,
        *,
        ctx: Any = None,
        deps: Sequence[Any] = (),
        smem: int | None = None,
    ) -> KernelNode:
        cu = driver.cuda_driver()
        if ctx is None:
            ctx = driver.ensure_context()
        params, ptrs = _kernel_params(kernel, grid, block, args, ctx, smem)
        dep_nodes = [d.node if isinstance(d, KernelNode) else d for d in deps]
        node = driver.call(cu.cuGraphAddKernelNode, self.graph, dep_nodes, len(dep_nodes), params)
        self._keep.append((ptrs, list(args)))
        return KernelNode(node, kernel, params, list(args))

    def add_memset_u32(self, ptr: int, value: int, count: int, *, deps: Sequence[Any] = (), ctx: Any = None):
        cu = driver.cuda_driver()
        p = cu.CUDA_MEMSET_NODE_PARAMS()
        p.dst = ptr
        p.value = value & 0xFFFFFFFF
        p.elementSize = 4
        p.width = count
        p.height = 1
        p.pitch = 0
        dep_nodes = [d.node if isinstance(d, KernelNode) else d for d in deps]
        return driver.call(
            cu.cuGraphAddMemsetNode,
            self.graph,
            dep_nodes,
            len(dep_nodes),
            p,
            ctx if ctx is not None else driver.ensure_context(),
        )

    def set_cooperative(self, node: KernelNode) -> None:
        """Launch the node's grid cooperatively (all blocks co-resident, as a grid barrier needs)."""
        cu = driver.cuda_driver()
        value = cu.CUkernelNodeAttrValue()
        value.cooperative = 1
        driver.call(
            cu.cuGraphKernelNodeSetAttribute, node.node, cu.CUkernelNodeAttrID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE, value
        )

    def add_to_capture(self, stream: Any) -> None:
        """Append this graph to the graph ``stream`` is being captured into, as one child node
        after the stream's current dependencies (the kernels' arguments as they are now)."""
        cu = driver.cuda_driver()
        sh = streams.stream_handle(stream)
        info = driver.call(cu.cuStreamGetCaptureInfo, sh)
        # (status, id, graph, dependencies, edge data, count) with cuda-bindings 13; 12 has no edge data.
        graph, deps, count = info[2], info[3], info[-1]
        deps = list(deps)[: int(count)]
        child = driver.call(cu.cuGraphAddChildGraphNode, graph, deps, len(deps), self.graph)
        flag = cu.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
        if len(info) == 6:
            driver.call(cu.cuStreamUpdateCaptureDependencies, sh, [child], None, 1, flag)
        else:
            driver.call(cu.cuStreamUpdateCaptureDependencies, sh, [child], 1, flag)

    def instantiate(self):
        cu = driver.cuda_driver()
        if self.exec is not None:
            driver.call(cu.cuGraphExecDestroy, self.exec)
            self.exec = None
        self.exec = driver.call(cu.cuGraphInstantiate, self.graph, 0)
        return self

    def launch(self, stream: Any = None) -> None:
        if self.exec is None:
            self.instantiate()
        driver.call(driver.cuda_driver().cuGraphLaunch, self.exec, streams.stream_handle(stream))

    def update_kernel(self, node: KernelNode, args: Sequence, *, grid=None, template: bool = True) -> None:
        """Rewrite a kernel node's arguments, and its grid when given, in the executable graph
        (launches already enqueued keep what they had); with ``template`` (or before the graph is
        instantiated) in the graph it is built from, else later through :meth:`update_template`
        (only a capture copies it). The arguments are copied, so the caller may change its ctypes
        objects afterwards."""
        cu = driver.cuda_driver()
        p = node.params
        if grid is not None:
            g = tuple(grid) + (1,) * (3 - len(tuple(grid)))
            p.gridDimX, p.gridDimY, p.gridDimZ = g
        node.args = [type(a).from_buffer_copy(a) for a in args]
        ptrs = (ctypes.c_void_p * max(len(node.args), 1))(*[ctypes.addressof(a) for a in node.args])
        p.kernelParams = ctypes.addressof(ptrs)
        if self.exec is not None:
            driver.call(cu.cuGraphExecKernelNodeSetParams, self.exec, node.node, p)
        if template or self.exec is None:
            driver.call(cu.cuGraphKernelNodeSetParams, node.node, p)

    def update_template(self, node: KernelNode) -> None:
        """Bring the built-from graph's copy of ``node`` up to :meth:`update_kernel`'s last write."""
        cu = driver.cuda_driver()
        p = node.params
        ptrs = (ctypes.c_void_p * max(len(node.args), 1))(*[ctypes.addressof(a) for a in node.args])
        p.kernelParams = ctypes.addressof(ptrs)
        driver.call(cu.cuGraphKernelNodeSetParams, node.node, p)

    def close(self) -> None:
        cu = driver.cuda_driver()
        if self.exec is not None:
            driver.call(cu.cuGraphExecDestroy, self.exec)
            self.exec = None
        if self.graph is not None:
            driver.call(cu.cuGraphDestroy, self.graph)
            self.graph = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

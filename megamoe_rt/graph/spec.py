"""Pipeline specs (``graphs/*.toml``): partitions and kernel nodes, validated.

name = "two-way"
[[partition]]
name = "k1"
sms = 64            # a multiple of the device's partition granularity, or "rest"
[[node]]
name = "probe_a"
kernel = "probe"    # a kernel known to the runner
partition = "k1"
grid = 256
block = 128
smem = 0            # dynamic shared memory, bytes (optional)
deps = []           # names of nodes that must finish first (optional)
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megamoe_rt.graph.partition import PartitionPlan, plan_partitions
from megamoe_rt.kernels.interface import gemm as gemm_interface

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


MAX_GRID = 2**31 - 1
MAX_SMEM = gemm_interface.SMEM_LIMIT.value  # 227 KiB per block on sm_90

# The arguments each workload of megamoe_rt/graph/workloads.py takes: (least, most, multiple of).
# A spin past ten seconds, a copy past 64 GiB or a GEMM past 64Ki in any dimension is a typo,
# not an experiment; a negative spin would wrap to centuries in the kernel's unsigned field.
WORKLOAD_ARGS: dict[str, dict[str, tuple[int, int, int]]] = {
    "sm_probe": {"spin_ns": (0, 10_000_000_000, 1)},
    "stream_copy": {"mib": (1, 65536, 1)},
    "fp8_gemm": {"m": (128, 65536, 128), "n": (128, 65536, 128), "k": (128, 65536, 128)},
}


def _workload_args(where: str, kernel: str, args: dict[str, Any]) -> dict[str, Any]:
    schema = WORKLOAD_ARGS.get(kernel)
    if schema is None:
        return args
    _no_unknown_keys(where, args, tuple(schema))
    for key, value in args.items():
        least, most, multiple = schema[key]
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most or value % multiple:
            step = f", a multiple of {multiple}" if multiple > 1 else ""
            raise SpecError(f"{where}: {key} = {value!r}, expected an integer in [{least}, {most}]{step}")
    return args


class SpecError(ValueError):
    """A pipeline spec that cannot run as written; the message says where and why."""


@dataclass(frozen=True)
class NodeSpec:
    name: str
    kernel: str
    partition: str
    grid: int
    block: int
    smem: int = 0
    deps: tuple[str, ...] = ()
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    partitions: tuple[tuple[str, Any], ...]  # (name, SMs or "rest")
    nodes: tuple[NodeSpec, ...]

    def plan(self, total_sms: int, granularity: int) -> PartitionPlan:
        try:
            return plan_partitions(total_sms, granularity, self.partitions)
        except ValueError as exc:
            raise SpecError(f"spec {self.name!r}: {exc}") from None

    def topological_order(self) -> list[NodeSpec]:
        """Nodes with every dependency first. Iterative, so a long dependency chain is an
        order, not a RecursionError; a cycle is a SpecError naming it."""
        by_name = {n.name: n for n in self.nodes}
        order: list[NodeSpec] = []
        state: dict[str, int] = {}  # 1 = on the current path, 2 = done
        for root in self.nodes:
            if state.get(root.name) == 2:
                continue
            path: list[str] = [root.name]
            pending: list[list[str]] = [list(root.deps)]  # deps still to visit, per path entry
            state[root.name] = 1
            while path:
                if not pending[-1]:
                    done = path.pop()
                    pending.pop()
                    state[done] = 2
                    order.append(by_name[done])
                    continue
                dep = pending[-1].pop(0)
                if state.get(dep) == 2:
                    continue
                if state.get(dep) == 1:
                    cycle = path[path.index(dep) :] + [dep]
                    raise SpecError(f"spec {self.name!r}: dependency cycle {' -> '.join(cycle)}")
                state[dep] = 1
                path.append(dep)
                pending.append(list(by_name[dep].deps))
        return order


def _positive_int(where: str, key: str, value: Any, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise SpecError(
            f"{where}: {key} = {value!r}, expected a {'non-negative' if allow_zero else 'positive'} integer"
        )
    return value


_TOP_KEYS = ("name", "partition", "node")
_PARTITION_KEYS = ("name", "sms")


def _no_unknown_keys(where: str, table: dict, known: tuple[str, ...]) -> None:
    unknown = sorted(k for k in table if k not in known)
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; expected {', '.join(known)}")


def parse_spec(data: dict, *, name: str = "<spec>", known_kernels: Iterable[str] | None = None) -> PipelineSpec:
    spec_name = str(data.get("name", name))
    _no_unknown_keys(f"spec {spec_name!r}", data, _TOP_KEYS)
    parts_raw = data.get("partition", [])
    if not isinstance(parts_raw, list) or not parts_raw:
        raise SpecError(f"spec {spec_name!r}: needs at least one [[partition]]")
    partitions = []
    for i, p in enumerate(parts_raw):
        where = f"spec {spec_name!r}, partition #{i + 1}"
        if not isinstance(p, dict) or "name" not in p or "sms" not in p:
            raise SpecError(f"{where}: needs name and sms")
        _no_unknown_keys(where, p, _PARTITION_KEYS)
        sms = p["sms"]
        if sms != "rest":
            _positive_int(where, "sms", sms)
        partitions.append((str(p["name"]), sms))
    pnames = {n for n, _ in partitions}
    if len(pnames) != len(partitions):
        raise SpecError(f"spec {spec_name!r}: partition names must be unique")
    known = None if known_kernels is None else set(known_kernels)
    nodes = []
    nodes_raw = data.get("node", [])
    if not isinstance(nodes_raw, list):
        raise SpecError(f"spec {spec_name!r}: node must be an array of tables ([[node]])")
    for i, n in enumerate(nodes_raw):
        where = f"spec {spec_name!r}, node #{i + 1}"
        if not isinstance(n, dict):
            raise SpecError(f"{where}: expected a table ([[node]]), got {type(n).__name__}")
        for key in ("name", "kernel", "partition", "grid", "block"):
            if key not in n:
                raise SpecError(f"{where}: missing {key}")
        where = f"spec {spec_name!r}, node {n['name']!r}"
        if n["partition"] not in pnames:
            raise SpecError(f"{where}: unknown partition {n['partition']!r}; spec has {', '.join(sorted(pnames))}")
        if known is not None and n["kernel"] not in known:
            raise SpecError(f"{where}: unknown kernel {n['kernel']!r}; known: {', '.join(sorted(known))}")
        block = _positive_int(where, "block", n["block"])
        if block > 1024 or block % 32:
            raise SpecError(f"{where}: block = {block}, expected a multiple of 32 up to 1024")
        deps = n.get("deps", [])
        if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
            raise SpecError(f"{where}: deps must be a list of node names")
        if len(set(deps)) != len(deps):
            raise SpecError(f"{where}: deps lists a node twice: {deps}")
        if _positive_int(where, "grid", n["grid"]) > MAX_GRID:
            raise SpecError(f"{where}: grid = {n['grid']} exceeds {MAX_GRID}")
        if _positive_int(where, "smem", n.get("smem", 0), allow_zero=True) > MAX_SMEM:
            raise SpecError(f"{where}: smem = {n['smem']} exceeds the {MAX_SMEM}-byte shared-memory limit")
        extra = _workload_args(
            where,
            str(n["kernel"]),
            {k: v for k, v in n.items() if k not in ("name", "kernel", "partition", "grid", "block", "smem", "deps")},
        )
        nodes.append(
            NodeSpec(
                str(n["name"]),
                str(n["kernel"]),
                str(n["partition"]),
                _positive_int(where, "grid", n["grid"]),
                block,
                _positive_int(where, "smem", n.get("smem", 0), allow_zero=True),
                tuple(deps),
                extra,
            )
        )
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise SpecError(f"spec {spec_name!r}: node names must be unique")
    for n in nodes:
        for d in n.deps:
            if d not in names:
                raise SpecError(f"spec {spec_name!r}, node {n.name!r}: depends on unknown node {d!r}")
    spec = PipelineSpec(spec_name, tuple(partitions), tuple(nodes))
    spec.topological_order()  # raises on cycles
    return spec


def load_spec(path: str | Path, *, known_kernels: Iterable[str] | None = None) -> PipelineSpec:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML ({exc})") from None
    return parse_spec(data, name=path.stem, known_kernels=known_kernels)


# The specs the package ships: graphs/ of the source tree, packaged as megamoe_rt/graphs in the
# wheel (pyproject.toml's force-include).
_PKG_DIR = Path(__file__).resolve().parents[1]


def shipped_specs_dir() -> Path | None:
    """Where the shipped specs are: inside the installed package, or the source checkout's graphs/."""
    for cand, marker in ((_PKG_DIR / "graphs", None), (_PKG_DIR.parent / "graphs", _PKG_DIR.parent / "pyproject.toml")):
        if cand.is_dir() and (marker is None or marker.is_file()):
            return cand
    return None


def shipped_spec_names() -> list[str]:
    """The shipped specs' names (file names without ``.toml``), sorted."""
    where = shipped_specs_dir()
    return sorted(p.stem for p in where.glob("*.toml")) if where is not None else []


def resolve_spec(spec: str | Path) -> Path:
    """The spec file ``spec`` names: a path to a file, or the name of a shipped spec, with or
    without ``.toml`` (``membound_vs_gemm``). A :class:`SpecError` listing the shipped names
    when it is neither."""
    path = Path(spec)
    if path.is_file():
        return path
    where = shipped_specs_dir()
    if where is not None and path.parent == Path(".") and path.name:
        shipped = where / (path.name if path.suffix == ".toml" else f"{path.name}.toml")
        if shipped.is_file():
            return shipped
    names = ", ".join(shipped_spec_names()) or "none found"
    what = (
        "a directory"
        if path.is_dir()
        else "no such file"
        if path.parent != Path(".")
        else "no such file or shipped spec"
    )
    raise SpecError(f"{spec}: {what} (shipped specs: {names})")

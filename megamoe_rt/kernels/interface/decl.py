"""The declaration vocabulary of the kernel interface.

A handful of objects describe everything the host and the device code must agree on:
:class:`Struct` (typed fields with comments), :class:`Enum` (optionally with a message per
value), :class:`Flags` (bit masks), :class:`Constant` and :class:`Formula` (an integer
expression of named arguments, constants and other formulas). A :class:`Header` groups them
under one C++ namespace; :mod:`megamoe_rt.kernels.interface.generate` renders it.

The host side uses the same objects directly: ``Struct.ctype`` is the ctypes class, an enum
answers ``ENUM["kName"]``, a constant's ``value`` is an int and a formula called with ints
returns an int. Called with symbolic arguments a formula records its expression instead,
which is how the C++ function body is produced from the one Python definition.
"""

from __future__ import annotations

import ctypes
import inspect
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Union

# --- types ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scalar:
    cxx: str
    ctype: type
    size: int
    py: str  # the ctypes name written into the generated Python ("c_uint32": some are aliases)

    @property
    def align(self) -> int:
        return self.size


U8 = Scalar("u8", ctypes.c_uint8, 1, "c_uint8")
U16 = Scalar("u16", ctypes.c_uint16, 2, "c_uint16")
U32 = Scalar("u32", ctypes.c_uint32, 4, "c_uint32")
U64 = Scalar("u64", ctypes.c_uint64, 8, "c_uint64")
I32 = Scalar("i32", ctypes.c_int32, 4, "c_int32")
I64 = Scalar("i64", ctypes.c_int64, 8, "c_int64")
F32 = Scalar("float", ctypes.c_float, 4, "c_float")


@dataclass(frozen=True)
class Opaque:
    """A C++ type the host never looks into; only pointed to. ``cxx`` is written relative to
    namespace megamoe_rt (``"ptx::u32x4"``); ``include`` is the header that defines it."""

    cxx: str
    include: str = ""


VOID = Opaque("void")

# A __grid_constant__ ptx::TmaDescriptor kernel parameter: the driver's 128 opaque bytes
# (megamoe_rt.runtime.tma.TensorMap2D.raw has this type).
TMA_DESCRIPTOR = ctypes.c_uint64 * 16


@dataclass(frozen=True)
class Ptr:
    """A device pointer: a 64-bit integer on the host."""

    to: Scalar | Struct | Opaque
    const: bool = False
    size = 8
    align = 8
    ctype = ctypes.c_uint64


@dataclass(frozen=True)
class Array:
    of: Scalar | Ptr | Struct
    n: int

    @property
    def size(self) -> int:
        return self.of.size * self.n

    @property
    def align(self) -> int:
        return self.of.align

    @property
    def ctype(self) -> Any:
        elem: Any = self.of.ctype
        return elem * self.n


FieldType = Union[Scalar, Ptr, Array, "Struct"]


# --- declarations -----------------------------------------------------------------------------


class Decl:
    """Something a header declares; the header sets ``header`` when it takes it."""

    name: str
    header: Header | None = None

    @property
    def namespace(self) -> str:
        if self.header is None:
            raise RuntimeError(f"{self.name} belongs to no Header")
        return self.header.namespace

    @property
    def qualified(self) -> str:
        return f"{self.namespace}::{self.name}"


@dataclass(frozen=True)
class Field:
    name: str
    type: FieldType
    doc: str = ""


@dataclass(frozen=True)
class Comment:
    """A comment line between fields (a heading for the fields below it)."""

    text: str


def _align_up(n: int, a: int) -> int:
    return -(-n // a) * a


class Struct(Decl):
    """A plain struct with natural alignment, as both the C++ compiler and ctypes lay it out.

    Padding the compiler would insert is allowed but never silent: the generated header
    asserts every field's offset and the size, so any difference fails to compile.
    """

    def __init__(self, name: str, items: Iterable[Field | Comment], *, doc: str = ""):
        self.name = name
        self.doc = doc
        self.items = tuple(items)
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"{name}: duplicate field names")

    @property
    def fields(self) -> tuple[Field, ...]:
        return tuple(i for i in self.items if isinstance(i, Field))

    @property
    def align(self) -> int:
        return max(f.type.align for f in self.fields)

    def offsets(self) -> dict[str, int]:
        out, at = {}, 0
        for f in self.fields:
            at = _align_up(at, f.type.align)
            out[f.name] = at
            at += f.type.size
        return out

    @property
    def size(self) -> int:
        last = self.fields[-1]
        return _align_up(self.offsets()[last.name] + last.type.size, self.align)

    @property
    def ctype(self) -> type[ctypes.Structure]:
        """The ctypes class of this struct, from the generated module (typed for the host code)."""
        from megamoe_rt.kernels.interface import structs

        cls: type[ctypes.Structure] | None = getattr(structs, self.name, None)
        if cls is None or [f[0] for f in cls._fields_] != [f.name for f in self.fields]:
            raise RuntimeError(
                f"{self.name}: megamoe_rt/kernels/interface/structs.py differs from the declaration; "
                "run python -m megamoe_rt.kernels.interface"
            )
        return cls


def packed_offsets(layout: Struct, lengths: Mapping[str, int], *, total: str = "words") -> dict[str, int]:
    """The values of a word-layout struct (``EpBankLayout``, ``BankLayout``): its fields other
    than ``total`` are the first words of regions packed back to back in field order, region
    ``name`` taking ``lengths[name]`` words; ``total`` gets the words of them all.

    ``lengths`` names exactly those fields, in field order, so a field added to the struct
    without its length (or a length of no field) is refused rather than laid out wrong."""
    regions = [f.name for f in layout.fields if f.name != total]
    if list(lengths) != regions:
        raise ValueError(
            f"lengths: expected the regions of {layout.name} in field order {regions}, got {list(lengths)}"
        )
    out: dict[str, int] = {}
    at = 0
    for name in regions:
        out[name] = at
        at += int(lengths[name])
    out[total] = at
    return out


@dataclass(frozen=True)
class EnumValue:
    cxx: str  # C++ enumerator: "kRingOverflow"
    key: str = ""  # the host's name for it: "contiguous", "start"
    doc: str = ""
    message: str = ""  # the text a message table returns for it


class Enum(Decl):
    """Enumerators numbered from 0 in declaration order.

    ``scoped``: ``enum class`` (else a plain enum whose names live in the namespace).
    ``count``: an extra last enumerator equal to the number of values.
    ``message_fn``: also emit ``const char* message_fn(Enum)`` returning each value's message
    (``default_message`` for anything else); the host reads the same texts from ``messages``.
    """

    def __init__(
        self,
        name: str,
        values: Iterable[EnumValue],
        *,
        doc: str = "",
        underlying: Scalar = U32,
        scoped: bool = True,
        count: str = "",
        count_doc: str = "",
        message_fn: str = "",
        default_message: str = "",
    ):
        self.name = name
        self.values = tuple(values)
        self.doc = doc
        self.underlying = underlying
        self.scoped = scoped
        self.count = count
        self.count_doc = count_doc
        self.message_fn = message_fn
        self.default_message = default_message
        cxx = [v.cxx for v in self.values] + ([count] if count else [])
        if len(set(cxx)) != len(cxx):
            raise ValueError(f"{name}: duplicate enumerators")
        keys = [v.key for v in self.values if v.key]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{name}: duplicate keys")
        if message_fn and not all(v.message for v in self.values):
            raise ValueError(f"{name}: every value needs a message for {message_fn}()")

    def __getitem__(self, name: str) -> int:
        """The number of a value, by C++ enumerator or host key."""
        for i, v in enumerate(self.values):
            if name in (v.cxx, v.key):
                return i
        if name == self.count and self.count:
            return len(self.values)
        raise KeyError(f"{self.name} has no value {name!r}")

    def keys(self) -> dict[str, int]:
        return {v.key: i for i, v in enumerate(self.values) if v.key}

    def cxx_of(self, key: str) -> str:
        """The qualified C++ name of a value: ``megamoe_rt::gemm::GroupLayout::kMasked``."""
        v = self.values[self[key]]
        return f"{self.qualified}::{v.cxx}" if self.scoped else f"{self.namespace}::{v.cxx}"

    @property
    def messages(self) -> tuple[str, ...]:
        return tuple(v.message for v in self.values)


@dataclass(frozen=True)
class Flag:
    cxx: str
    bit: int
    key: str = ""
    doc: str = ""

    @property
    def mask(self) -> int:
        return 1 << self.bit


class Flags(Decl):
    """Bits of a u32 word, emitted as a struct of ``static constexpr u32`` masks."""

    def __init__(self, name: str, flags: Iterable[Flag], *, doc: str = ""):
        self.name = name
        self.flags = tuple(flags)
        self.doc = doc
        bits = [f.bit for f in self.flags]
        if len(set(bits)) != len(bits) or not all(0 <= b < 32 for b in bits):
            raise ValueError(f"{name}: bits must be distinct and below 32")
        if len({f.cxx for f in self.flags}) != len(self.flags):
            raise ValueError(f"{name}: duplicate names")

    def __getitem__(self, name: str) -> int:
        for f in self.flags:
            if name in (f.cxx, f.key):
                return f.mask
        raise KeyError(f"{self.name} has no flag {name!r}")


# --- constants and formulas -------------------------------------------------------------------


# A formula's arguments and result: ints on the host, Expr while the C++ body is traced.
Value = Any


class Expr:
    """A symbolic integer expression (what a formula's body becomes when traced)."""

    prec = 3

    def render(self, ns: str, lang: str) -> str:
        raise NotImplementedError

    def _bin(self, op: str, other: Value, swap: bool) -> Expr:
        a, b = (_expr(other), self) if swap else (self, _expr(other))
        return _Bin(op, a, b)

    def __add__(self, o: Value) -> Expr:
        return self._bin("+", o, False)

    def __radd__(self, o: Value) -> Expr:
        return self._bin("+", o, True)

    def __sub__(self, o: Value) -> Expr:
        return self._bin("-", o, False)

    def __rsub__(self, o: Value) -> Expr:
        return self._bin("-", o, True)

    def __mul__(self, o: Value) -> Expr:
        return self._bin("*", o, False)

    def __rmul__(self, o: Value) -> Expr:
        return self._bin("*", o, True)

    def __floordiv__(self, o: Value) -> Expr:
        return self._bin("//", o, False)

    def __rfloordiv__(self, o: Value) -> Expr:
        return self._bin("//", o, True)


_PREC = {"+": 1, "-": 1, "*": 2, "//": 2}


class _Bin(Expr):
    def __init__(self, op: str, a: Expr, b: Expr):
        self.op, self.a, self.b, self.prec = op, a, b, _PREC[op]

    def render(self, ns: str, lang: str) -> str:
        left = self.a.render(ns, lang)
        right = self.b.render(ns, lang)
        if self.a.prec < self.prec:
            left = f"({left})"
        # + and * are associative in unsigned arithmetic; - and / are not.
        if self.b.prec < self.prec or (self.b.prec == self.prec and self.op in ("-", "//")):
            right = f"({right})"
        op = "/" if (self.op == "//" and lang == "cxx") else self.op
        return f"{left} {op} {right}"


class _Lit(Expr):
    def __init__(self, value: int):
        self.value = value

    def render(self, ns: str, lang: str) -> str:
        return str(self.value)


class _Arg(Expr):
    def __init__(self, name: str):
        self.name = name

    def render(self, ns: str, lang: str) -> str:
        return self.name


class _Ref(Expr):
    def __init__(self, decl: Constant):
        self.decl = decl

    def render(self, ns: str, lang: str) -> str:
        return relative_name(self.decl, ns) if lang == "cxx" else _py_name(self.decl)


class _Call(Expr):
    def __init__(self, formula: Formula, args: tuple[Expr, ...]):
        self.formula, self.args = formula, args

    def render(self, ns: str, lang: str) -> str:
        name = relative_name(self.formula, ns) if lang == "cxx" else _py_name(self.formula)
        return f"{name}({', '.join(a.render(ns, lang) for a in self.args)})"


def _py_name(decl: Decl) -> str:
    return f"{decl.namespace.replace('::', '_')}_{decl.name}"


def _expr(x: object) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, Constant):
        return _Ref(x)
    if isinstance(x, int) and not isinstance(x, bool) and x >= 0:
        return _Lit(x)
    raise TypeError(f"a formula may combine only arguments, constants, formulas and non-negative ints, not {x!r}")


def relative_name(decl: Decl, ns: str) -> str:
    """``decl`` as written inside namespace ``ns`` (all namespaces sit under megamoe_rt)."""
    if decl.namespace == ns:
        return decl.name
    root = "megamoe_rt"
    rel = decl.namespace[len(root) + 2 :] if decl.namespace.startswith(root + "::") else ""
    return f"{rel}::{decl.name}" if rel else (decl.name if ns.startswith(root) else decl.qualified)


class Constant(Decl):
    """A named integer both sides use. In a formula it stands for its C++ name; anywhere
    else it behaves as its value (``int(c)``, ``c * 4``)."""

    def __init__(self, name: str, value: int, *, doc: str = "", type: Scalar = U32, hex: bool = False):
        self.name, self.value, self.doc, self.type, self.hex = name, int(value), doc, type, hex
        if not 0 <= self.value < (1 << (8 * type.size)):
            raise ValueError(f"{name} = {value} does not fit {type.cxx}")

    def __int__(self) -> int:
        return self.value

    __index__ = __int__

    def __repr__(self) -> str:
        return f"Constant({self.name}={self.value})"

    def _op(self, o: Value, fn: Callable[[Value, Value], Value], swap: bool = False) -> Value:
        if isinstance(o, Expr):
            return fn(o, _Ref(self)) if swap else fn(_Ref(self), o)
        n = int(o)
        return fn(n, self.value) if swap else fn(self.value, n)

    def __add__(self, o: Value) -> Value:
        return self._op(o, operator.add)

    def __radd__(self, o: Value) -> Value:
        return self._op(o, operator.add, True)

    def __sub__(self, o: Value) -> Value:
        return self._op(o, operator.sub)

    def __rsub__(self, o: Value) -> Value:
        return self._op(o, operator.sub, True)

    def __mul__(self, o: Value) -> Value:
        return self._op(o, operator.mul)

    def __rmul__(self, o: Value) -> Value:
        return self._op(o, operator.mul, True)

    def __floordiv__(self, o: Value) -> Value:
        return self._op(o, operator.floordiv)

    def __rfloordiv__(self, o: Value) -> Value:
        return self._op(o, operator.floordiv, True)


class Formula(Decl):
    """An integer function of named arguments, defined once as a Python function.

    Called with ints it evaluates (the host's value); traced with symbolic arguments it yields
    the expression the C++ ``constexpr`` function returns. Only ``+ - * //`` on non-negative
    values, constants and other formulas are allowed, so both evaluate alike as long as
    values stay within ``returns`` (the tests compare the two)."""

    def __init__(self, fn: Callable[..., Value], *, doc: str = "", returns: Scalar = U32):
        self.fn = fn
        self.name = fn.__name__
        self.doc = doc or inspect.getdoc(fn) or ""
        self.returns = returns
        self.args = tuple(inspect.signature(fn).parameters)

    def __call__(self, *args: Value) -> Value:
        if len(args) != len(self.args):
            raise TypeError(f"{self.name}() takes {len(self.args)} arguments ({', '.join(self.args)})")
        if any(isinstance(a, Expr) for a in args):
            return _Call(self, tuple(_expr(a) for a in args))
        out = int(self.fn(*(int(a) for a in args)))
        if not 0 <= out < (1 << (8 * self.returns.size)):
            raise OverflowError(f"{self.name}{tuple(int(a) for a in args)} = {out} does not fit {self.returns.cxx}")
        return out

    def body(self) -> Expr:
        return _expr(self.fn(*(_Arg(a) for a in self.args)))


def formula(*, doc: str = "", returns: Scalar = U32) -> Callable[[Callable[..., Value]], Formula]:
    def wrap(fn: Callable[..., Value]) -> Formula:
        return Formula(fn, doc=doc, returns=returns)

    return wrap


# --- headers ----------------------------------------------------------------------------------


class Header:
    """One generated header: ``cuda_src/interface/<name>.cuh``, inside ``namespace``.

    Items render in the order given; includes follow from what the items reference in other
    headers, plus ``includes`` for opaque types.
    """

    def __init__(
        self, name: str, namespace: str, items: Iterable[Decl], *, doc: str, module: str, includes: Iterable[str] = ()
    ):
        self.name = name
        self.namespace = namespace
        self.items = tuple(items)
        self.doc = doc
        self.module = module
        self.extra_includes = tuple(includes)
        for item in self.items:
            if item.header is not None and item.header is not self:
                raise ValueError(f"{item.name} is already declared in {item.header.name}")
            item.header = self

    @property
    def path(self) -> str:
        return f"interface/{self.name}.cuh"

    def __getitem__(self, name: str) -> Decl:
        for item in self.items:
            if item.name == name:
                return item
        raise KeyError(f"{self.path} declares no {name!r}")

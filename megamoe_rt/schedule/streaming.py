"""The chunk-ready input ring: its configuration, generation words and a step-level model of
the protocol (CPU only; the device side is cuda_src/stream/).

Producers (one per source rank) fill ring slots with token chunks; MegaMoE consumes them.
Per (source rank, slot) three 64-bit words:

- ``route_ready_gen``: ``topk_idx`` / ``topk_weights`` of the slot are published,
- ``layout_ready_gen``: ``x`` / ``x_sf`` are published,
- ``consumed_gen``: every read of the slot is done; it may be reused.

A generation is ``(epoch << 32) | sequence`` with sequence = chunk index + 1, so a value
written in an earlier call (an earlier epoch, e.g. the previous CUDA-graph replay) never
equals one expected now: no ABA across ring wrap or replay. Payloads are written before a
release-store of the ready word; consumers acquire both ready words before reading, and
release ``consumed_gen`` after their last read. A producer reuses a slot only once the
slot's ``consumed_gen`` equals what was last published there.

:class:`RingModel` executes the protocol one step at a time (each step is one store or
one load) so tests can drive arbitrary interleavings and check that no consumer reads a
payload of another generation and no producer overwrites an unconsumed slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from megamoe_rt.runtime import args

EPOCH_SHIFT = 32
SEQ_MASK = (1 << EPOCH_SHIFT) - 1


@dataclass(frozen=True)
class StreamConfig:
    """A layer's input ring: ``num_slots`` slots of ``tokens_per_slot`` tokens per rank. A call
    of T tokens is ``ceil(T / tokens_per_slot)`` chunks; chunk c holds tokens
    ``[c * tokens_per_slot, (c + 1) * tokens_per_slot)`` and lives in slot ``c % num_slots``.
    ``producer_sms``: in ``mode="fused"``, the SMs its streamed launch leaves to the producer's
    kernels (default: an eighth of the GPU's); the unfused mode's consumer shares every SM."""

    num_slots: int
    tokens_per_slot: int
    # SMs the fused mode's consumer leaves to the producer's kernels (None: an eighth of the GPU's):
    # its blocks hold their SMs for the whole call, so the producer runs on these alone.
    producer_sms: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_slots", "tokens_per_slot"):
            v = args.integer(f"StreamConfig.{name}", getattr(self, name), minimum=1)  # NumPy integers too
            object.__setattr__(self, name, v)  # a plain int in the frozen config
        if self.producer_sms is not None:
            v = args.integer("StreamConfig.producer_sms", self.producer_sms, minimum=1)
            object.__setattr__(self, "producer_sms", v)

    def consumer_sms(self, sm_count: int) -> int:
        """Blocks of the fused mode's streamed launch on a GPU of ``sm_count`` SMs: one an SM,
        leaving ``producer_sms`` (at least one) to the producer. ValueError when none is left."""
        producer = self.producer_sms if self.producer_sms is not None else max(1, sm_count // 8)
        if producer >= sm_count:
            raise ValueError(
                f"StreamConfig.producer_sms={producer}: expected fewer than the GPU's {sm_count} SMs "
                "(the layer's consumer needs at least one)"
            )
        return sm_count - producer

    def num_chunks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_slot)

    def chunk_tokens(self, num_tokens: int, chunk: int) -> int:
        """Tokens of chunk ``chunk`` in a call of ``num_tokens`` (0 past the call's end)."""
        return max(0, min(self.tokens_per_slot, num_tokens - chunk * self.tokens_per_slot))


def encode_gen(epoch: int, sequence: int) -> int:
    if not (0 <= epoch < 1 << 32 and 0 < sequence <= SEQ_MASK):
        raise ValueError(f"generation: epoch {epoch} / sequence {sequence} out of range")
    return (epoch << EPOCH_SHIFT) | sequence


def chunk_generation(epoch: int, chunk: int) -> int:
    return encode_gen(epoch, chunk + 1)


class ProtocolViolation(AssertionError):
    pass


@dataclass
class SlotState:
    route_ready: int = 0
    layout_ready: int = 0
    consumed: int = 0
    # What the slot's payloads hold: (call, chunk, generation) of their writer, or None.
    route_payload: tuple | None = None
    layout_payload: tuple | None = None


@dataclass
class RingModel:
    """One consumer (this rank's MegaMoE) and a producer per source rank."""

    num_ranks: int
    num_slots: int
    num_chunks: int
    epoch: int = 1
    gen_of: Callable[[int, int], int] = chunk_generation  # (epoch, chunk) -> generation word
    slots: list = field(default_factory=list)
    _prod: list = field(default_factory=list)  # per rank: (chunk, step)
    _cons: tuple = (0, 0)  # (chunk, step)
    reads: list = field(default_factory=list)  # (rank, chunk, route payload seen, layout payload seen)
    call: int = 0

    def __post_init__(self):
        if not self.slots:
            self.slots = [[SlotState() for _ in range(self.num_slots)] for _ in range(self.num_ranks)]
        self.start_call(self.epoch)

    def start_call(self, epoch: int) -> None:
        """A new call (or graph replay) with a new epoch over the same ring state."""
        self.epoch = epoch
        self.call += 1
        self._prod = [(0, 0) for _ in range(self.num_ranks)]
        self._cons = (0, 0)

    # Producer of rank r, chunk c, slot c % S. Steps: 0 wait slot free, 1 write route,
    # 2 publish route, 3 write layout, 4 publish layout.
    def producer_can_step(self, r: int) -> bool:
        c, step = self._prod[r]
        if c >= self.num_chunks:
            return False
        if step == 0:
            s = self.slots[r][c % self.num_slots]
            return s.consumed == s.route_ready == s.layout_ready
        return True

    def producer_step(self, r: int) -> None:
        if not self.producer_can_step(r):
            raise ProtocolViolation(f"producer {r} stepped while blocked")
        c, step = self._prod[r]
        slot = self.slots[r][c % self.num_slots]
        g = self.gen_of(self.epoch, c)
        if step in (1, 3):
            # Overwriting a payload nobody has consumed yet would lose it.
            held = slot.route_payload if step == 1 else slot.layout_payload
            if held is not None and slot.consumed != held[2]:
                raise ProtocolViolation(
                    f"producer {r} overwrote slot {c % self.num_slots} (chunk {held[1]} of "
                    f"call {held[0]}) before it was consumed"
                )
            if step == 1:
                slot.route_payload = (self.call, c, g)
            else:
                slot.layout_payload = (self.call, c, g)
        elif step == 2:
            slot.route_ready = g
        elif step == 4:
            slot.layout_ready = g
        self._prod[r] = (c + 1, 0) if step == 4 else (c, step + 1)

    # Consumer, chunk c: for each rank wait both ready words == g; then read every rank's
    # payload; then publish consumed for every rank. Steps: 0 wait, 1 read, 2 publish.
    def consumer_can_step(self) -> bool:
        c, step = self._cons
        if c >= self.num_chunks:
            return False
        if step == 0:
            g = self.gen_of(self.epoch, c)
            return all(
                self.slots[r][c % self.num_slots].route_ready == g
                and self.slots[r][c % self.num_slots].layout_ready == g
                for r in range(self.num_ranks)
            )
        return True

    def consumer_step(self) -> None:
        if not self.consumer_can_step():
            raise ProtocolViolation("consumer stepped while blocked")
        c, step = self._cons
        g = self.gen_of(self.epoch, c)
        if step == 1:
            for r in range(self.num_ranks):
                s = self.slots[r][c % self.num_slots]
                self.reads.append((r, c, s.route_payload, s.layout_payload))
                want = (self.call, c, g)
                if s.route_payload != want or s.layout_payload != want:
                    raise ProtocolViolation(
                        f"consumer read chunk {c} of rank {r} in call {self.call} but the slot "
                        f"holds {s.route_payload} / {s.layout_payload}"
                    )
        elif step == 2:
            for r in range(self.num_ranks):
                self.slots[r][c % self.num_slots].consumed = g
        self._cons = (c + 1, 0) if step == 2 else (c, step + 1)

    @property
    def done(self) -> bool:
        return self._cons[0] >= self.num_chunks and all(c >= self.num_chunks for c, _ in self._prod)

    def runnable(self) -> list[int | str]:
        """Actors that can take a step: rank ids and "consumer"."""
        out: list[int | str] = [r for r in range(self.num_ranks) if self.producer_can_step(r)]
        if self.consumer_can_step():
            out.append("consumer")
        return out

    def step(self, actor) -> None:
        if actor == "consumer":
            self.consumer_step()
        else:
            self.producer_step(actor)

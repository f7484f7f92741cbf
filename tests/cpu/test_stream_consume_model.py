"""The one-launch consumer of a streamed call (moe_stream_consume) as a CPU model: the blocks
form ``groups`` groups, block b taking chunks b % groups, b % groups + groups, ... in order at
its own pace; each counts itself done with a slot, and the block whose count reaches
``group_blocks * (chunk // slots + 1)`` releases it. Under every interleaving the producer
never refills a slot a block is still reading, every chunk of the call is read by every block
of its group, and nothing deadlocks."""

from __future__ import annotations

import random

import pytest


def kernel_target(group_blocks: int, slots: int, chunk: int) -> int:
    """moe_stream_consume's release rule: a slot's k-th use in the call is done once every block
    of a group has counted it k times."""
    return group_blocks * (chunk // slots + 1)


def run_consumer(
    chunks: int, slots: int, blocks: int, rng: random.Random, target=kernel_target, groups: int = 1
) -> None:
    assert blocks % groups == 0, "the grid is a multiple of the groups"
    group_blocks = blocks // groups
    published = [-1] * slots  # chunk whose data is in each slot (-1: none yet)
    consumed = [-1] * slots  # chunk each slot was last released for
    done = [0] * slots  # blocks done with each slot in the call (the kernel's slot_done)
    reading = [[False] * blocks for _ in range(slots)]
    nxt = [b % groups for b in range(blocks)]  # chunk each block reads next
    reads = set()  # (block, chunk) pairs read to the end
    produced = 0
    for _ in range(100_000):
        moves = []
        if produced < chunks and consumed[produced % slots] == published[produced % slots]:
            moves.append(("produce", -1))  # the slot is free: its last chunk was released (or none yet)
        for b in range(blocks):
            c = nxt[b]
            if c < chunks and not any(reading[s][b] for s in range(slots)) and published[c % slots] == c:
                moves.append(("read", b))
            for s in range(slots):
                if reading[s][b]:
                    moves.append(("finish", b))
        if not moves:
            break
        kind, b = rng.choice(moves)
        if kind == "produce":
            s = produced % slots
            assert not any(reading[s]), f"slot {s} refilled with chunk {produced} while a block reads it"
            published[s] = produced
            produced += 1
        elif kind == "read":
            reading[nxt[b] % slots][b] = True
        else:
            c = nxt[b]
            s = c % slots
            assert published[s] == c, "a block read a chunk that was not in its slot"
            reading[s][b] = False
            reads.add((b, c))
            nxt[b] += groups
            done[s] += 1
            if done[s] == target(group_blocks, slots, c):
                consumed[s] = c
    assert all(c >= chunks for c in nxt), f"stuck: blocks at chunks {nxt}, produced {produced} of {chunks}"
    assert reads == {(b, c) for c in range(chunks) for b in range(blocks) if b % groups == c % groups}
    assert all(consumed[c % slots] >= c for c in range(max(0, chunks - slots), chunks))


@pytest.mark.parametrize("seed", range(40))
def test_blocks_at_their_own_pace_release_each_slot_once_all_have_read_it(seed):
    rng = random.Random(seed)
    run_consumer(chunks=rng.randint(1, 12), slots=rng.randint(1, 4), blocks=rng.randint(1, 6), rng=rng)


@pytest.mark.parametrize("seed", range(40))
def test_groups_of_blocks_taking_chunks_in_turn_release_each_slot_once_their_group_has_read_it(seed):
    rng = random.Random(seed)
    groups = rng.randint(1, 5)
    run_consumer(
        chunks=rng.randint(1, 14),
        slots=rng.randint(1, 5),
        blocks=groups * rng.randint(1, 3),
        rng=rng,
        groups=groups,
    )


def test_groups_counted_against_the_whole_grid_never_release_a_slot():
    # Each chunk is read by one group only: a target of every block is never reached.
    with pytest.raises(AssertionError, match="stuck"):
        run_consumer(
            chunks=4, slots=2, blocks=4, rng=random.Random(1), groups=2, target=lambda g, s, c: 2 * g * (c // s + 1)
        )


def test_a_release_rule_that_forgets_earlier_uses_of_the_slot_stalls_the_producer():
    # With the first use's target for every use, a slot's second chunk is never released.
    with pytest.raises(AssertionError, match="stuck"):
        run_consumer(chunks=4, slots=1, blocks=3, rng=random.Random(0), target=lambda b, s, c: b)

"""Token windows: a long call run as consecutive calls over windows of its tokens.

A layer built with ``token_window=W`` sizes its whole buffer (pools, per-row metadata, the
combine buffer ``[K, W, H]``, the input staging) for W tokens per rank, and runs a call of T
tokens as the calls over tokens ``[c*W, min((c+1)*W, T))``. Every token's output depends on
that token's row alone (its dispatch, its rows of both GEMMs, its SwiGLU requant and the
slot-order sum of its partials), so the output is bit for bit the one-window call's.

Across ranks the windows are collective: every rank runs the same number of them, taken from
the call's ``num_tokens_bound`` (the same on every rank), and a rank whose tokens end earlier
runs its later windows with none, still serving its experts. Window c's bound is the part of
the call's bound that falls in it, so it covers every rank's tokens of that window.
"""

from __future__ import annotations

from typing import NamedTuple

from megamoe_rt.runtime import args
from megamoe_rt.schedule.arith import ceil_div


class TokenWindow(NamedTuple):
    """One window of a call: its first token, its tokens on this rank and its bound."""

    first: int
    num_tokens: int
    bound: int


def num_windows(bound: int, window: int) -> int:
    """Windows of a call with ``num_tokens_bound`` ``bound`` (at least one: an empty call is
    still a call, across ranks a collective)."""
    return max(1, ceil_div(bound, window))


def token_windows(num_tokens: int, bound: int, window: int) -> list[TokenWindow]:
    """The windows of a call of ``num_tokens`` tokens (``num_tokens <= bound``)."""
    num_tokens = args.integer("num_tokens", num_tokens, minimum=0)
    bound = args.integer("bound", bound, minimum=num_tokens)
    window = args.integer("window", window, minimum=1)
    out = []
    for c in range(num_windows(bound, window)):
        first = c * window
        out.append(
            TokenWindow(
                min(first, num_tokens),
                max(0, min(window, num_tokens - first)),
                max(0, min(window, bound - first)),
            )
        )
    return out

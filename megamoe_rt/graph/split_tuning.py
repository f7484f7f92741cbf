"""The split pipeline's tuned SM counts, cached per device and shape.

``megamoe-rt tune-split`` measures K1/K2 splits and stores the fastest here;
``MegaMoE(mode="split")`` without ``split_sms`` uses the stored split of its device and shape
(the entry with the nearest token count), else the rule of
:func:`megamoe_rt.schedule.split_sms.default_split_sms`. The file is
``$MEGAMOE_RT_CACHE/split_tuning.json``, written to a temporary name and renamed.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from megamoe_rt.jit.cache import default_cache_dir
from megamoe_rt.runtime.file_trust import read_trusted_file
from megamoe_rt.schedule.split_sms import SplitSms

FILE_NAME = "split_tuning.json"


def tuning_path(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / FILE_NAME


def shape_key(device_name: str, sm_count: int, hidden: int, intermediate: int, num_experts: int, topk: int, ranks: int):
    """Entries are keyed by everything but the token count, which is matched nearest."""
    return f"{device_name}|{sm_count}sm|H{hidden}|I{intermediate}|E{num_experts}|K{topk}|R{ranks}"


def _read(path: Path) -> dict[str, Any]:
    """The stored splits; {} where there are none or the file fails the cache's trust checks
    (its splits choose how a kernel is launched, so only this user's own file counts)."""
    blob, reason = read_trusted_file(path)
    if reason is not None:
        warnings.warn(f"megamoe_rt: ignoring the split tuning file: {reason}", UserWarning, stacklevel=3)
    if blob is None:
        return {}
    try:
        data = json.loads(blob.decode())
    except (UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def lookup(key: str, tokens: int, cache_dir: Path | None = None) -> SplitSms | None:
    """The stored split for ``key`` at the token count nearest ``tokens`` (None: none stored)."""
    entries = _read(tuning_path(cache_dir)).get(key)
    if not isinstance(entries, dict) or not entries:
        return None
    try:
        nearest = min(entries, key=lambda t: (abs(int(t) - tokens), int(t)))
        l1, l2, reduce = (int(v) for v in entries[nearest]["sms"])
    except (ValueError, KeyError, TypeError):
        return None
    return SplitSms(l1, l2, reduce)


def store(key: str, tokens: int, sms: SplitSms, time_us: float, cache_dir: Path | None = None) -> Path:
    """Record ``sms`` as the best split for ``key`` at ``tokens`` tokens per rank."""
    path = tuning_path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read(path)
    data.setdefault(key, {})[str(int(tokens))] = {"sms": list(sms.as_tuple()), "time_us": round(float(time_us), 2)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".split_tuning.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path

"""Per-group generation caps drawn from a length distribution (`config.length_caps`): benchmarks use them,
with the stop token disabled, to give a random model the completion-length tail of a real task."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


def length_cap_fn(spec: str) -> Callable[[int], int]:
    """Group id -> generation cap from "lognormal:median=M,p99=P,max=N[,seed=S]" (benchmarks: with the
    stop token disabled, completion lengths then follow that distribution exactly).

    Raises:
      ValueError: naming what is wrong with `spec`.
    """
    kind, _, rest = spec.partition(":")
    if kind != "lognormal":
        raise ValueError(f"{spec!r}: only 'lognormal:median=M,p99=P,max=N[,seed=S]' is supported")
    try:
        kv = {k.strip(): float(v) for k, v in (item.split("=") for item in rest.split(",") if item)}
    except ValueError:
        raise ValueError(f"{spec!r}: expected key=value pairs after 'lognormal:'") from None
    missing = {"median", "p99", "max"} - set(kv)
    if missing or not 0 < kv.get("median", 0) <= kv.get("p99", 0):
        raise ValueError(
            f"{spec!r}: needs median, p99 and max with 0 < median <= p99 (missing {sorted(missing)})"
        )
    median, max_len, seed = kv["median"], int(kv["max"]), int(kv.get("seed", 0))
    sigma = math.log(kv["p99"] / median) / 2.3263478740408408  # z of the 99th percentile

    def cap(group_id: int) -> int:
        rng = np.random.default_rng((seed, group_id))
        return int(np.clip(round(median * math.exp(sigma * rng.standard_normal())), 1, max_len))

    return cap

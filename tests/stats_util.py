"""A chi-square goodness-of-fit check without scipy (Wilson-Hilferty quantile approximation)."""

import math
from typing import Dict, Hashable


def chi_square_rejects(counts: Dict[Hashable, int], probs: Dict[Hashable, float], z: float = 3.29) -> bool:
    """True when ``counts`` are unlikely (p < ~5e-4 one-sided, z = 3.29) under ``probs``.

    Cells whose expected count is below 5 are pooled into one.
    """
    n = sum(counts.values())
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for key in set(probs) | set(counts):
        exp, obs = probs.get(key, 0.0) * n, counts.get(key, 0)
        if exp < 5:
            pooled_obs, pooled_exp = pooled_obs + obs, pooled_exp + exp
            continue
        stat += (obs - exp) ** 2 / exp
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        df += 1
    df = max(df, 1)
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical

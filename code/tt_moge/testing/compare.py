"""Comparing two answers of the same model to the same photo that took different routes (the API, the server, the
CLI, the native or the torch host path): masks identical, floats within a few units in the last place.

Why not bit for bit: the host's two paths differ by a few ulp where the photo is resized (ATen's bilinear kernel
orders its arithmetic by the number of stacked channels; the perspective-correct resize takes reciprocals before
and after), and a model's float sums depend on torch's thread count at its load. A few ulp is far below anything
a user can see, and far above nothing: a request answered with another's maps, or a different option, fails by
millions of ulp."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

__all__ = ["ULP_LIMIT", "max_ulps", "assert_same_maps"]

ULP_LIMIT = 8  # the host paths' documented agreement (tt_moge.native)


def max_ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in units in the last place between two float32 arrays with the same inf pattern."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32, (a.shape, a.dtype, b.shape, b.dtype)
    assert np.array_equal(np.isfinite(a), np.isfinite(b)), "inf pattern differs"
    fin = np.isfinite(a)
    assert fin.any(), "nothing finite to compare"
    ia, ib = a[fin].view(np.int32).astype(np.int64), b[fin].view(np.int32).astype(np.int64)
    # the sign-magnitude ints onto one monotonic line, so that -0.0 and +0.0 are 0 apart
    ia, ib = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia), np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int(np.abs(ia - ib).max())


def assert_same_maps(
    want: Any,
    got: Any,
    names: Iterable[str] = ("depth", "points", "normal"),
    ulp_limit: int = ULP_LIMIT,
    label: str = "",
) -> None:
    """`got` is `want` (MoGeOutput-like objects, or dicts of arrays): masks identical, each float map of `names`
    within `ulp_limit` ulp (absent in both is equal). The comparison is not vacuous: some pixels are valid and
    some are not."""

    def get(x: Any, name: str) -> Any:
        return x.get(name) if isinstance(x, dict) else getattr(x, name, None)

    mask_want, mask_got = np.asarray(get(want, "mask")).astype(bool), np.asarray(get(got, "mask")).astype(bool)
    assert np.array_equal(mask_want, mask_got), f"{label} mask differs"
    assert 0.0 < mask_want.mean() < 1.0, f"{label} valid share {mask_want.mean():.3f}: the comparison is trivial"
    for name in names:
        a, b = get(want, name), get(got, name)
        if a is None or b is None:
            assert a is None and b is None, f"{label} {name}: present in only one"
            continue
        ulps = max_ulps(a, b)
        assert ulps <= ulp_limit, f"{label} {name}: {ulps} ulp apart (limit {ulp_limit})"

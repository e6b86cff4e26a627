"""Merge the views' distance maps into one panorama distance map: the least-squares fit of log-distance
gradients that upstream MoGe's `merge_panorama_depth` solves, solved fast, then put in metres.

The objective (upstream's, term for term): every view's log distance is resampled onto the panorama grid; on
each grid edge (horizontal edges wrap around the seam) the log-distance differences of the views that see both
ends are averaged, and so is the 5-point Laplacian of the views that see all five pixels (rows clamp at the
poles, columns wrap). The panorama's log distance x minimises

    sum over edges with data (x_p - x_q - mean difference)^2 + sum over pixels with data (Lx_p - mean Laplacian)^2

(upstream counts the vertical edges of column 0 twice, an artefact of its seam padding; we keep that weight so
that the minimiser is the same). This is a sparse least-squares problem; its normal equations are a
symmetric positive semi-definite system of 13-point stencils on the grid (the Laplacian term squared) that is
singular only by one constant per connected region. Upstream solves the rectangular system with `lsmr`
started from its own solution at half the size, and stops early (at 1920x960 its answer is a few per cent
off the minimiser in the low frequencies: see docs/panorama.md). We solve the normal equations with conjugate
gradients preconditioned by a multigrid V-cycle of the gradient term alone (2 x 2 aggregation with exact
Galerkin coarse operators, written here for the grid: pyamg's algebraic setup alone costs more than our whole
solve at this size), from the views' own mean log distance, until the relative residual is 1e-5.

The constant: gradients fix log distance only up to one offset per connected region (upstream's scale is
whatever its solver's start gives). We take it from the views' own metric distances: each region's offset is
the median, over every (pixel, view) pair of the region where the view is valid, of (view log distance -
fitted log distance). So the panorama is in metres like a photo's output, and a view whose metric scale is off
moves it only as much as a median lets it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["MergeData", "MergeResult", "warp_views", "normal_matrix", "solve_log_distance", "metric_offsets",
           "merge_distance_maps"]


@dataclass
class MergeData:
    """The views resampled onto a W x H panorama grid and averaged (see the module docstring).

    grad_x (H, W): mean log-distance difference x[i, j] - x[i, j + 1] (column W - 1 pairs with column 0);
    grad_x_weight (H, W): 1 where some view sees both ends, else 0. grad_y (H - 1, W) and grad_y_weight: the
    same for x[i, j] - x[i + 1, j] (weight 2 on column 0, see the module docstring). laplacian (H, W): mean
    5-point Laplacian; laplacian_weight (H, W). log_sum / log_count (H, W): the sum and number of the valid
    views' log distances at each pixel (for the constant). mask (H, W): some view is valid there."""

    width: int
    height: int
    grad_x: np.ndarray
    grad_x_weight: np.ndarray
    grad_y: np.ndarray
    grad_y_weight: np.ndarray
    laplacian: np.ndarray
    laplacian_weight: np.ndarray
    log_views: list  # per view: (rows slice, (h, w) log distance or None, (h, w) valid mask)
    mask: np.ndarray


def _project(directions: np.ndarray, camera, size: int) -> tuple:
    """Panorama directions -> (view pixel coordinates (..., 2) float32, in-view mask) for a square view."""
    cam = directions @ camera.rotation.T.astype(directions.dtype)
    z = cam[..., 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        half = np.tan(np.radians(camera.fov_deg) / 2.0)
        u = (cam[..., 0] / z / half + 1.0) * 0.5
        v = (cam[..., 1] / z / half + 1.0) * 0.5
    inside = (z > 0) & (u > 0) & (u < 1) & (v > 0) & (v < 1)
    pixels = np.stack([np.clip(u, 0, 1) * size - 0.5, np.clip(v, 0, 1) * size - 0.5], axis=-1)
    return pixels.astype(np.float32), inside


def _rows_seen(camera, width: int, height: int) -> slice:
    """The panorama rows a view can reach (its field of view around its forward direction), with a margin."""
    lat_f = np.arcsin(np.clip(-camera.forward[1], -1, 1))
    reach = np.arctan(np.tan(np.radians(camera.fov_deg) / 2.0) * np.sqrt(2.0))  # the corner's angle
    top, bottom = min(np.pi / 2, lat_f + reach), max(-np.pi / 2, lat_f - reach)
    i0 = max(0, int(np.floor((0.5 - top / np.pi) * height)) - 2)
    i1 = min(height, int(np.ceil((0.5 - bottom / np.pi) * height)) + 2)
    return slice(i0, i1)


def warp_views(distance_maps: Sequence[np.ndarray], masks: Sequence[np.ndarray], cameras: Sequence,
               width: int, height: int) -> MergeData:
    """Resample every view's log distance and mask onto the panorama grid and average the gradients and
    Laplacians of the views (upstream's sampling: bilinear distance, nearest mask, a view counts where the
    pixel projects strictly inside it)."""
    import cv2

    from .geometry import panorama_directions

    directions = panorama_directions(width, height, dtype=np.float32)
    gx_sum = np.zeros((height, width), np.float32)
    gx_n = np.zeros((height, width), np.float32)
    gy_sum = np.zeros((height - 1, width), np.float32)
    gy_n = np.zeros((height - 1, width), np.float32)
    lap_sum = np.zeros((height, width), np.float32)
    lap_n = np.zeros((height, width), np.float32)
    mask_any = np.zeros((height, width), bool)
    log_views = []
    for distance, valid, camera in zip(distance_maps, masks, cameras):
        size = distance.shape[0]
        rows = _rows_seen(camera, width, height)
        pixels, inside = _project(directions[rows], camera, size)
        with np.errstate(divide="ignore", invalid="ignore"):
            log_d = np.log(np.asarray(distance, np.float32))
        log_d = np.where(np.isfinite(log_d), log_d, 0.0).astype(np.float32)
        m_view = np.asarray(valid, bool) & np.isfinite(np.log(np.maximum(distance, 0)))  # noqa: invalid <= 0 distances
        log_p = cv2.remap(log_d, pixels[..., 0], pixels[..., 1], cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
        m_p = inside & (cv2.remap(m_view.astype(np.uint8), pixels[..., 0], pixels[..., 1], cv2.INTER_NEAREST,
                                  borderMode=cv2.BORDER_REPLICATE) > 0)
        log_p = np.where(m_p, log_p, 0.0).astype(np.float32)
        log_views.append((rows, log_p, m_p))
        mask_any[rows] |= m_p
        r0, r1 = rows.start, rows.stop
        # horizontal edges (wrapping at the seam)
        right, m_right = np.roll(log_p, -1, axis=1), np.roll(m_p, -1, axis=1)
        mx = m_p & m_right
        gx_sum[rows] += np.where(mx, log_p - right, 0.0)
        gx_n[rows] += mx
        # vertical edges inside these rows
        my = m_p[:-1] & m_p[1:]
        gy_sum[r0:r1 - 1] += np.where(my, log_p[:-1] - log_p[1:], 0.0)
        gy_n[r0:r1 - 1] += my
        # Laplacian (rows clamp at the poles; this view's rows never reach a pole unless the slice does)
        up = np.concatenate([log_p[:1], log_p[:-1]]) if r0 == 0 else np.concatenate([np.zeros_like(log_p[:1]), log_p[:-1]])
        down = np.concatenate([log_p[1:], log_p[-1:]]) if r1 == height else np.concatenate([log_p[1:], np.zeros_like(log_p[:1])])
        m_up = np.concatenate([m_p[:1], m_p[:-1]]) if r0 == 0 else np.concatenate([np.zeros_like(m_p[:1]), m_p[:-1]])
        m_down = np.concatenate([m_p[1:], m_p[-1:]]) if r1 == height else np.concatenate([m_p[1:], np.zeros_like(m_p[:1])])
        left, m_left = np.roll(log_p, 1, axis=1), np.roll(m_p, 1, axis=1)
        ml = m_p & m_up & m_down & m_left & m_right
        lap_sum[rows] += np.where(ml, up + down + left + right - 4.0 * log_p, 0.0)
        lap_n[rows] += ml
    grad_y_weight = (gy_n > 0).astype(np.float32)
    grad_y_weight[:, 0] *= 2.0
    return MergeData(
        width=width, height=height,
        grad_x=gx_sum / np.maximum(gx_n, 1), grad_x_weight=(gx_n > 0).astype(np.float32),
        grad_y=gy_sum / np.maximum(gy_n, 1), grad_y_weight=grad_y_weight,
        laplacian=lap_sum / np.maximum(lap_n, 1), laplacian_weight=(lap_n > 0).astype(np.float32),
        log_views=log_views, mask=mask_any,
    )


# ------------------------------------------------------------------------------------------ the system
def _shift_left(x: np.ndarray) -> np.ndarray:
    """x[:, j + 1] at column j (wrapping): the right neighbour."""
    return np.concatenate([x[:, 1:], x[:, :1]], axis=1)


def _shift_right(x: np.ndarray) -> np.ndarray:
    """x[:, j - 1] at column j (wrapping): the left neighbour."""
    return np.concatenate([x[:, -1:], x[:, :-1]], axis=1)


def _laplacian(x: np.ndarray) -> np.ndarray:
    """The 5-point Laplacian, columns wrapping, rows clamped at the poles (symmetric, = -(graph Laplacian))."""
    out = _shift_left(x)
    out += _shift_right(x)
    out[1:] += x[:-1]
    out[0] += x[0]
    out[:-1] += x[1:]
    out[-1] += x[-1]
    out -= 4.0 * x
    return out


def _graph_laplacian(wx: np.ndarray, wy: np.ndarray, x: np.ndarray) -> np.ndarray:
    """D^T diag(w) D x for the grid's edges: horizontal weights wx (H, W) (edge j -> j + 1, wrapping), vertical
    weights wy (H - 1, W)."""
    ex = wx * (x - _shift_left(x))
    out = ex - _shift_right(ex)
    ey = wy * (x[:-1] - x[1:])
    out[:-1] += ey
    out[1:] -= ey
    return out


class _NormalEquations:
    """M x = rhs, the normal equations of the objective, applied matrix-free: M = D^T A D + L B L."""

    def __init__(self, data: MergeData, dtype=np.float32):
        self.wx = data.grad_x_weight.astype(dtype)
        self.wy = data.grad_y_weight.astype(dtype)
        self.b = data.laplacian_weight.astype(dtype)
        ex, ey = self.wx * data.grad_x, self.wy * data.grad_y
        rhs = ex - _shift_right(ex)
        rhs[:-1] += ey
        rhs[1:] -= ey
        self.rhs = (rhs + _laplacian(self.b * data.laplacian)).astype(dtype)
        self.degree = self.wx + _shift_right(self.wx)  # diag of D^T A D
        self.degree[:-1] += self.wy
        self.degree[1:] += self.wy
        self.has_equation = (self.degree > 0) | (self.b > 0)

    def __matmul__(self, x: np.ndarray) -> np.ndarray:
        out = _graph_laplacian(self.wx, self.wy, x)
        out += _laplacian(self.b * _laplacian(x))
        return out


def normal_matrix(data: MergeData):
    """(M, rhs): the normal equations as a scipy CSR matrix (float64) and vector, assembled explicitly: the
    reference the matrix-free operator is tested against, for small grids."""
    from scipy.sparse import csr_matrix, diags, vstack

    h, w = data.height, data.width
    idx = np.arange(h * w).reshape(h, w)
    right, left = _shift_left(idx), _shift_right(idx)
    up, down = np.concatenate([idx[:1], idx[:-1]]), np.concatenate([idx[1:], idx[-1:]])
    n_x, n_y = h * w, (h - 1) * w
    cols = np.concatenate([np.stack([idx.ravel(), right.ravel()], 1).ravel(),
                           np.stack([idx[:-1].ravel(), idx[1:].ravel()], 1).ravel()])
    d = csr_matrix((np.tile([1.0, -1.0], n_x + n_y), cols, np.arange(0, 2 * (n_x + n_y) + 1, 2)), shape=(n_x + n_y, h * w))
    cols = np.stack([idx, up, down, left, right], -1).ravel()
    lap = csr_matrix((np.tile([-4.0, 1.0, 1.0, 1.0, 1.0], h * w), cols, np.arange(0, 5 * h * w + 1, 5)), shape=(h * w, h * w))
    lap.sum_duplicates()
    e = vstack([d, lap], format="csr")
    weights = np.concatenate([data.grad_x_weight.ravel(), data.grad_y_weight.ravel(), data.laplacian_weight.ravel()]).astype(np.float64)
    targets = np.concatenate([data.grad_x.ravel(), data.grad_y.ravel(), data.laplacian.ravel()]).astype(np.float64)
    m = (e.T @ diags(weights) @ e).tocsr()
    return m, e.T @ (weights * targets)


# ------------------------------------------------------------------------------------ the preconditioner
class _Level:
    """One level of the multigrid hierarchy of the weighted graph Laplacian K = D^T A D (+ a small diagonal)."""

    def __init__(self, wx: np.ndarray, wy: np.ndarray, diagonal: np.ndarray):
        self.wx, self.wy, self.diagonal = wx, wy, diagonal
        degree = wx + _shift_right(wx) + diagonal
        degree[:-1] += wy
        degree[1:] += wy
        self.inv_degree = np.where(degree > 0, 1.0 / np.where(degree > 0, degree, 1.0), 0.0).astype(wx.dtype)
        self.solve_matrix = None  # the coarsest level: its pseudo-inverse

    @property
    def shape(self) -> tuple:
        return self.wx.shape

    def apply(self, x: np.ndarray) -> np.ndarray:
        out = _graph_laplacian(self.wx, self.wy, x)
        out += self.diagonal * x
        return out

    def coarsen(self) -> "_Level":
        """The Galerkin operator P^T K P for P = piecewise constant on 2 x 2 blocks: again a graph Laplacian,
        whose edge weights are the sums of the fine edges between two blocks (odd sizes: padded with nothing)."""
        h, w = self.shape
        hc, wc = (h + 1) // 2, (w + 1) // 2
        wx, wy, diagonal = (_pad(a, 2 * hc, 2 * wc) for a in (self.wx, self.wy, self.diagonal))
        if w % 2:  # the wrap edge (w - 1 -> 0) now ends on a padding column: move it to the padded column
            wx[:, 2 * wc - 1] = wx[:, w - 1]
            wx[:, w - 1] = 0
        cwx = wx[0::2, 1::2] + wx[1::2, 1::2]
        cwy = (wy[1::2, 0::2] + wy[1::2, 1::2])[:hc - 1]
        cdiag = diagonal[0::2, 0::2] + diagonal[0::2, 1::2] + diagonal[1::2, 0::2] + diagonal[1::2, 1::2]
        return _Level(cwx, cwy, cdiag)


def _pad(a: np.ndarray, h: int, w: int) -> np.ndarray:
    out = np.zeros((h, w), a.dtype)
    out[:a.shape[0], :a.shape[1]] = a
    return out


def _restrict(r: np.ndarray, shape: tuple) -> np.ndarray:
    hc, wc = shape
    p = _pad(r, 2 * hc, 2 * wc) if r.shape != (2 * hc, 2 * wc) else r
    return p[0::2, 0::2] + p[0::2, 1::2] + p[1::2, 0::2] + p[1::2, 1::2]


def _prolong(e: np.ndarray, shape: tuple) -> np.ndarray:
    return np.repeat(np.repeat(e, 2, axis=0), 2, axis=1)[:shape[0], :shape[1]]


class _Multigrid:
    """A symmetric V-cycle for K: damped Jacobi smoothing, 2 x 2 aggregation with exact Galerkin coarse
    operators, an over-corrected coarse correction (the usual remedy for piecewise-constant interpolation),
    a pseudo-inverse on the coarsest grid. Used as the preconditioner of M (see `solve_log_distance`)."""

    OMEGA = 0.8  # Jacobi damping
    OVER = 2.0  # coarse-correction scaling
    COARSEST = 600  # unknowns at most on the coarsest level

    def __init__(self, wx: np.ndarray, wy: np.ndarray, diagonal: np.ndarray):
        self.levels = [_Level(wx, wy, diagonal)]
        while self.levels[-1].wx.size > self.COARSEST and min(self.levels[-1].shape) > 2:
            self.levels.append(self.levels[-1].coarsen())
        last = self.levels[-1]
        h, w = last.shape
        n = h * w
        dense = np.zeros((n, n))
        for k in range(n):  # the coarsest operator column by column (a few hundred tiny applications)
            unit = np.zeros(n, last.wx.dtype)
            unit[k] = 1.0
            dense[:, k] = last.apply(unit.reshape(h, w)).ravel()
        last.solve_matrix = np.linalg.pinv(dense, hermitian=True).astype(last.wx.dtype)

    def __call__(self, b: np.ndarray, k: int = 0) -> np.ndarray:
        level = self.levels[k]
        if level.solve_matrix is not None:
            return (level.solve_matrix @ b.ravel()).reshape(b.shape)
        x = self.OMEGA * level.inv_degree * b
        coarse = self.levels[k + 1].shape
        x += self.OVER * _prolong(self(_restrict(b - level.apply(x), coarse), k + 1), level.shape)
        x += self.OMEGA * level.inv_degree * (b - level.apply(x))
        return x


def solve_log_distance(data: MergeData, x0: np.ndarray, rtol: float = 1e-5, maxiter: int = 500) -> tuple:
    """Minimise the objective from x0 (H, W): conjugate gradients on the normal equations M x = rhs,
    preconditioned by a multigrid V-cycle of the gradient term K = D^T A D alone. Where a view sees the
    Laplacian of a pixel it sees that pixel's four edges, so L B L <= 8 K: the preconditioned spectrum lies in
    [1, 9] whatever the grid size, and the V-cycle keeps that cost per iteration linear. Stops when
    |rhs - M x| <= rtol |rhs|. Returns (x, iterations). Pixels without any equation keep their x0."""
    system = _NormalEquations(data)
    tiny = np.float32(1e-4)  # makes K definite (M's null space, a constant per region, is CG's business)
    precondition = _Multigrid(system.wx, system.wy, np.where(system.has_equation, tiny, np.float32(1.0)).astype(np.float32))
    x = np.array(x0, dtype=np.float32)
    r = system.rhs - system @ x
    r[~system.has_equation] = 0.0
    stop = rtol * float(np.linalg.norm(system.rhs))
    z = precondition(r)
    z[~system.has_equation] = 0.0
    p = z.copy()
    rz = float(np.vdot(r, z))
    for iteration in range(maxiter):
        if float(np.linalg.norm(r)) <= stop or rz == 0.0:
            return x, iteration
        q = system @ p
        alpha = rz / float(np.vdot(p, q))
        x += np.float32(alpha) * p
        r -= np.float32(alpha) * q
        z = precondition(r)
        z[~system.has_equation] = 0.0
        rz, rz_old = float(np.vdot(r, z)), rz
        p *= np.float32(rz / rz_old)
        p += z
    return x, maxiter


# ---------------------------------------------------------------------------------------- the metric offset
def _regions(data: MergeData) -> tuple:
    """(labels (H, W) int, count): the connected regions of pixels that take part in a gradient equation
    (4-neighbours, joined across the seam where an edge crosses it); 0 = in no gradient equation."""
    from scipy import ndimage

    wx, wy = data.grad_x_weight > 0, data.grad_y_weight > 0
    linked = wx | _shift_right(wx)
    linked[:-1] |= wy
    linked[1:] |= wy
    labels, count = ndimage.label(linked)
    seam = np.nonzero(wx[:, -1])[0]
    if count > 1 and seam.size:
        parent = np.arange(count + 1)

        def root(a: int) -> int:
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        for a, b in set(zip(labels[seam, -1].tolist(), labels[seam, 0].tolist())):
            ra, rb = root(a), root(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
        roots = np.array([root(a) for a in range(count + 1)])
        _, compact = np.unique(roots, return_inverse=True)
        labels = compact[labels]
        count = int(compact.max())
    return labels, count


def metric_offsets(data: MergeData, x: np.ndarray, stride: int = 4) -> np.ndarray:
    """(H, W) offsets to add to x: per connected region, the median of (view log distance - x) over the
    (pixel, view) pairs where the view is valid (every `stride`-th row and column: the same median, less work);
    0 outside the regions."""
    labels, count = _regions(data)
    offsets = np.zeros(count + 1, np.float64)
    if count == 0:
        return np.zeros_like(x)
    keys, values = [], []
    for rows, log_p, valid in data.log_views:
        sub = (slice(None, None, stride), slice(None, None, stride))
        lab = labels[rows][sub]
        use = valid[sub] & (lab > 0)
        keys.append(lab[use])
        values.append(log_p[sub][use] - x[rows][sub][use])
    keys, values = np.concatenate(keys), np.concatenate(values).astype(np.float64)
    if keys.size:
        order = np.lexsort((values, keys))
        keys, values = keys[order], values[order]
        starts = np.searchsorted(keys, np.arange(1, count + 1), side="left")
        ends = np.searchsorted(keys, np.arange(1, count + 1), side="right")
        for k, (s, e) in enumerate(zip(starts, ends), start=1):
            if e > s:
                offsets[k] = 0.5 * (values[s + (e - s - 1) // 2] + values[s + (e - s) // 2])
    return offsets[labels].astype(x.dtype)


# ------------------------------------------------------------------------------------------- the merge
@dataclass
class MergeResult:
    """distance (H, W) float32 metres (meaningful where mask), mask (H, W) bool, iterations of the solve,
    seconds per step ("warp", "solve", "offset")."""

    distance: np.ndarray
    mask: np.ndarray
    iterations: int
    seconds: dict


def merge_distance_maps(distance_maps: Sequence[np.ndarray], masks: Sequence[np.ndarray], cameras: Sequence,
                        width: int, height: int, rtol: float = 1e-5) -> MergeResult:
    """The views' distance maps (each (s, s), metres) and validity masks -> the panorama's distance map at
    W x H (see the module docstring). `rtol`: the solve's relative residual."""
    import time

    if not (len(distance_maps) == len(masks) == len(cameras)) or not len(cameras):
        raise ValueError(f"distance_maps, masks and cameras: one of each per view, got {len(distance_maps)}, "
                         f"{len(masks)} and {len(cameras)}")
    t0 = time.perf_counter()
    data = warp_views(distance_maps, masks, cameras, width, height)
    total = np.zeros((height, width), np.float32)
    count = np.zeros((height, width), np.float32)
    for rows, log_p, valid in data.log_views:
        total[rows] += log_p * valid
        count[rows] += valid
    x0 = total / np.maximum(count, 1.0)  # the views' own (metric) log distance: a start near the answer
    t1 = time.perf_counter()
    x, iterations = solve_log_distance(data, x0, rtol)
    t2 = time.perf_counter()
    x += metric_offsets(data, x)
    t3 = time.perf_counter()
    distance = np.exp(x).astype(np.float32)
    return MergeResult(distance, data.mask, iterations, {"warp": t1 - t0, "solve": t2 - t1, "offset": t3 - t2})

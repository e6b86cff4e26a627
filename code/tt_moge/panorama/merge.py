"""Merge the views' distance maps into one panorama distance map: the least-squares fit of log-distance
gradients that upstream MoGe's `merge_panorama_depth` solves, solved to its minimiser, then put in metres.

The objective (upstream's, term for term): every view's log distance is resampled onto the panorama grid; on
each grid edge (horizontal edges wrap around the seam) the log-distance differences of the views that see both
ends are averaged, and so is the 5-point Laplacian of the views that see all five pixels (rows clamp at the
poles, columns wrap). The panorama's log distance x minimises

    sum over edges with data (x_p - x_q - mean difference)^2 + sum over pixels with data (Lx_p - mean Laplacian)^2

(upstream counts the vertical edges of column 0 twice, an artefact of its seam padding; we keep that weight so
that the objective is the same). This is a sparse least-squares problem; its normal equations M x = rhs are a
symmetric positive semi-definite system of 13-point stencils on the grid (the Laplacian term squared) that is
singular by one constant per connected region of the edges. Upstream solves the rectangular system with
`lsmr` started from its own solution at half the size, and stops early (at 1920x960 its answer is a few per
cent off the minimiser in the low frequencies: see docs/panorama.md). We solve the normal equations with
conjugate gradients preconditioned by an aggregation multigrid V-cycle of the gradient term alone (written
here for the grid: pyamg's algebraic setup alone costs more than our whole solve at this size), until the
relative residual |rhs - M x| / |rhs|, computed in float64, is 1e-6; `solve_log_distance` says why it
converges on every input. The merge's result carries the iterations, that residual and whether it got there;
a RuntimeWarning says when it did not.

The constant: gradients fix log distance only up to one offset per connected region (upstream's scale is
whatever its solver's start gives). We take it from the views' own metric distances: each region's offset is
the median, over every (pixel, view) pair of the region where the view is valid, of (view log distance -
fitted log distance). So the panorama is in metres like a photo's output, and a view whose metric scale is off
moves it only as much as a median lets it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

__all__ = [
    "MergeData",
    "MergeResult",
    "SolveResult",
    "warp_views",
    "normal_matrix",
    "solve_log_distance",
    "metric_offsets",
    "merge_distance_maps",
]


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

    def mean_log_distance(self) -> np.ndarray:
        """(H, W) float32: the valid views' mean log distance at each pixel (0 where none is valid): the
        answer where a pixel is in no equation."""
        total = np.zeros((self.height, self.width), np.float32)
        count = np.zeros((self.height, self.width), np.float32)
        for rows, log_p, valid in self.log_views:
            total[rows] += log_p * valid
            count[rows] += valid
        return total / np.maximum(count, 1.0)

    @functools.cached_property
    def regions(self) -> tuple:
        """(labels (H, W) int, count): the connected regions of the gradient equations (`_regions`)."""
        return _regions(self)


def _project(directions: np.ndarray, camera, size: int) -> tuple:
    """Panorama directions -> (view pixel column, row (...) float32, contiguous as cv2.remap takes them;
    in-view mask) for a square view. In float32 throughout (the coordinates' own precision, at half the
    memory traffic), each camera axis a matrix-vector product of its own (contiguous planes)."""
    rotation = camera.rotation.astype(directions.dtype)
    z = directions @ rotation[2]
    inside = z > 0
    planes = []
    with np.errstate(divide="ignore", invalid="ignore"):  # z = 0: inf and nan, outside the view
        scale = np.reciprocal(z, out=z)
        scale *= np.float32(0.5 / np.tan(np.radians(camera.fov_deg) / 2.0))
        for axis in (0, 1):  # u, v in (0, 1) across the view, then its pixel coordinate
            t = directions @ rotation[axis]
            t *= scale
            t += np.float32(0.5)
            inside &= (t > 0) & (t < 1)
            np.clip(t, 0, 1, out=t)
            t *= np.float32(size)
            t -= np.float32(0.5)
            planes.append(t)
    return planes[0], planes[1], inside


def _rows_seen(camera, width: int, height: int) -> slice:
    """The panorama rows a view can reach (its field of view around its forward direction), with a margin."""
    lat_f = np.arcsin(np.clip(-camera.forward[1], -1, 1))
    reach = np.arctan(np.tan(np.radians(camera.fov_deg) / 2.0) * np.sqrt(2.0))  # the corner's angle
    top, bottom = min(np.pi / 2, lat_f + reach), max(-np.pi / 2, lat_f - reach)
    i0 = max(0, int(np.floor((0.5 - top / np.pi) * height)) - 2)
    i1 = min(height, int(np.ceil((0.5 - bottom / np.pi) * height)) + 2)
    return slice(i0, i1)


def warp_views(
    distance_maps: Sequence[np.ndarray], masks: Sequence[np.ndarray], cameras: Sequence, width: int, height: int
) -> MergeData:
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
        column, row, inside = _project(directions[rows], camera, size)
        with np.errstate(divide="ignore", invalid="ignore"):
            log_d = np.log(np.asarray(distance, np.float32))
        log_d = np.where(np.isfinite(log_d), log_d, 0.0).astype(np.float32)
        m_view = np.asarray(valid, bool) & np.isfinite(np.log(np.maximum(distance, 0)))  # invalid: <= 0 distances
        log_p = cv2.remap(log_d, column, row, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
        m_p = inside & (
            cv2.remap(m_view.astype(np.uint8), column, row, cv2.INTER_NEAREST, borderMode=cv2.BORDER_REPLICATE) > 0
        )
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
        gy_sum[r0 : r1 - 1] += np.where(my, log_p[:-1] - log_p[1:], 0.0)
        gy_n[r0 : r1 - 1] += my
        # Laplacian (rows clamp at the poles; this view's rows never reach a pole unless the slice does)
        up = (
            np.concatenate([log_p[:1], log_p[:-1]])
            if r0 == 0
            else np.concatenate([np.zeros_like(log_p[:1]), log_p[:-1]])
        )
        down = (
            np.concatenate([log_p[1:], log_p[-1:]])
            if r1 == height
            else np.concatenate([log_p[1:], np.zeros_like(log_p[:1])])
        )
        m_up = np.concatenate([m_p[:1], m_p[:-1]]) if r0 == 0 else np.concatenate([np.zeros_like(m_p[:1]), m_p[:-1]])
        m_down = (
            np.concatenate([m_p[1:], m_p[-1:]]) if r1 == height else np.concatenate([m_p[1:], np.zeros_like(m_p[:1])])
        )
        left, m_left = np.roll(log_p, 1, axis=1), np.roll(m_p, 1, axis=1)
        ml = m_p & m_up & m_down & m_left & m_right
        lap_sum[rows] += np.where(ml, up + down + left + right - 4.0 * log_p, 0.0)
        lap_n[rows] += ml
    grad_y_weight = (gy_n > 0).astype(np.float32)
    grad_y_weight[:, 0] *= 2.0
    return MergeData(
        width=width,
        height=height,
        grad_x=gx_sum / np.maximum(gx_n, 1),
        grad_x_weight=(gx_n > 0).astype(np.float32),
        grad_y=gy_sum / np.maximum(gy_n, 1),
        grad_y_weight=grad_y_weight,
        laplacian=lap_sum / np.maximum(lap_n, 1),
        laplacian_weight=(lap_n > 0).astype(np.float32),
        log_views=log_views,
        mask=mask_any,
    )


# ------------------------------------------------------------------------------------------ the system
# The operators below write into preallocated buffers: the solve is memory-bound, and on a 1920x960 grid a
# stencil's temporaries and wrap-around copies (and the page faults of fresh arrays) cost as much again.
def _shift_left(x: np.ndarray) -> np.ndarray:
    """x[:, j + 1] at column j (wrapping): the right neighbour."""
    return np.concatenate([x[:, 1:], x[:, :1]], axis=1)


def _shift_right(x: np.ndarray) -> np.ndarray:
    """x[:, j - 1] at column j (wrapping): the left neighbour."""
    return np.concatenate([x[:, -1:], x[:, :-1]], axis=1)


def _laplacian(x: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """The 5-point Laplacian, columns wrapping, rows clamped at the poles (symmetric, = -(graph Laplacian)),
    into `out` (a new array if None; not x)."""
    out = np.multiply(x, -4.0, out=out)
    out[:, :-1] += x[:, 1:]
    out[:, -1] += x[:, 0]
    out[:, 1:] += x[:, :-1]
    out[:, 0] += x[:, -1]
    out[1:] += x[:-1]
    out[:-1] += x[1:]
    out[0] += x[0]
    out[-1] += x[-1]
    return out


class _GraphLaplacian:
    """K x = D^T diag(w) D x for the grid's edges: horizontal weights wx (H, W) (edge j -> j + 1, wrapping),
    vertical weights wy (H - 1, W); degree (H, W): the diagonal of K, each pixel's sum of edge weights.
    Applied with its own buffers, one pair per input dtype (each call writes them before reading them, so
    callers may share one operator)."""

    def __init__(self, wx: np.ndarray, wy: np.ndarray):
        self.wx, self.wy = wx, wy
        self.degree = wx + _shift_right(wx)
        self.degree[:-1] += wy
        self.degree[1:] += wy
        self._buffers: dict = {}

    @property
    def shape(self) -> tuple:
        return self.wx.shape

    def __call__(self, x: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        if x.dtype not in self._buffers:
            h, w = self.shape
            self._buffers[x.dtype] = (np.empty((h, w), x.dtype), np.empty((h - 1, w), x.dtype))
        ex, ey = self._buffers[x.dtype]
        if out is None:
            out = np.empty_like(x)
        np.subtract(x[:, :-1], x[:, 1:], out=ex[:, :-1])  # edge fluxes w (x_p - x_q)
        np.subtract(x[:, -1], x[:, 0], out=ex[:, -1])
        ex *= self.wx
        np.subtract(ex[:, 1:], ex[:, :-1], out=out[:, 1:])
        np.subtract(ex[:, 0], ex[:, -1], out=out[:, 0])
        np.subtract(x[:-1], x[1:], out=ey)
        ey *= self.wy
        out[:-1] += ey
        out[1:] -= ey
        return out


class _NormalEquations:
    """M x = rhs, the normal equations of the objective, applied matrix-free: M = D^T A D + L B L. The
    weights are `dtype` (float32 for CG); `system @ x` computes in x's dtype (float64 for true residuals);
    rhs is float64."""

    def __init__(self, data: MergeData, dtype=np.float32):
        self.wx = data.grad_x_weight.astype(dtype)
        self.wy = data.grad_y_weight.astype(dtype)
        self.b = data.laplacian_weight.astype(dtype)
        self.gradient_term = _GraphLaplacian(self.wx, self.wy)
        ex = data.grad_x_weight.astype(np.float64) * data.grad_x
        ey = data.grad_y_weight.astype(np.float64) * data.grad_y
        rhs = ex - _shift_right(ex)
        rhs[:-1] += ey
        rhs[1:] -= ey
        self.rhs = rhs + _laplacian(data.laplacian_weight.astype(np.float64) * data.laplacian)
        self.degree = self.gradient_term.degree  # diag of D^T A D
        self.has_equation = (self.degree > 0) | (self.b > 0)
        self._buffers: dict = {}

    def __matmul__(self, x: np.ndarray) -> np.ndarray:
        return self.apply(x, np.empty_like(x))

    def apply(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out = M x (in x's dtype)."""
        if x.dtype not in self._buffers:
            self._buffers[x.dtype] = (np.empty(x.shape, x.dtype), np.empty(x.shape, x.dtype))
        lx, llx = self._buffers[x.dtype]
        self.gradient_term(x, out=out)
        _laplacian(x, out=lx)
        lx *= self.b
        out += _laplacian(lx, out=llx)
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
    cols = np.concatenate(
        [np.stack([idx.ravel(), right.ravel()], 1).ravel(), np.stack([idx[:-1].ravel(), idx[1:].ravel()], 1).ravel()]
    )
    d = csr_matrix(
        (np.tile([1.0, -1.0], n_x + n_y), cols, np.arange(0, 2 * (n_x + n_y) + 1, 2)), shape=(n_x + n_y, h * w)
    )
    cols = np.stack([idx, up, down, left, right], -1).ravel()
    lap = csr_matrix(
        (np.tile([-4.0, 1.0, 1.0, 1.0, 1.0], h * w), cols, np.arange(0, 5 * h * w + 1, 5)), shape=(h * w, h * w)
    )
    lap.sum_duplicates()
    e = vstack([d, lap], format="csr")
    weights = np.concatenate(
        [data.grad_x_weight.ravel(), data.grad_y_weight.ravel(), data.laplacian_weight.ravel()]
    ).astype(np.float64)
    targets = np.concatenate([data.grad_x.ravel(), data.grad_y.ravel(), data.laplacian.ravel()]).astype(np.float64)
    m = (e.T @ diags(weights) @ e).tocsr()
    return m, e.T @ (weights * targets)


# ------------------------------------------------------------------------------------ the preconditioner
def _block_components() -> np.ndarray:
    """(16, 4) int8: for each pattern of the 4 edges inside a 2 x 2 block (bit 0: a-b, 1: c-d, 2: a-c,
    3: b-d, for the pixels a b / c d), the connected component of each pixel a, b, c, d (0, 1, ...)."""
    table = np.zeros((16, 4), np.int8)
    for pattern in range(16):
        parent = list(range(4))

        def root(i: int) -> int:
            while parent[i] != i:
                i = parent[i]
            return i

        for bit, (u, v) in enumerate([(0, 1), (2, 3), (0, 2), (1, 3)]):
            if pattern >> bit & 1:
                parent[root(u)] = root(v)
        first: dict = {}
        for i in range(4):
            table[pattern, i] = first.setdefault(root(i), len(first))
    return table


_BLOCK_COMPONENTS = _block_components()


def _block_aggregates(wx: np.ndarray, wy: np.ndarray, linked: np.ndarray) -> tuple:
    """The first coarsening: each 2 x 2 block's pixels split into the parts that its own edges connect.
    Returns (aggregate of each pixel (H * W,) intp, -1 for pixels in no edge; count; (count, 2) block
    coordinates of each aggregate). A block cut by holes into pieces gives one aggregate per piece: one
    aggregate for pixels that only a long way round connects would tie them together in the coarse space,
    and on masks full of small holes (salt and pepper) that made the old V-cycle need ~10 times the steps."""
    h, w = wx.shape
    hc, wc = (h + 1) // 2, (w + 1) // 2
    ex, ey, lk = (np.zeros((2 * hc, 2 * wc), bool) for _ in range(3))
    ex[:h, :w], ey[: h - 1, :w], lk[:h, :w] = wx > 0, wy > 0, linked
    if w % 2:  # the seam's edge (w - 1 -> 0) is not inside the last block, whose second column is padding
        ex[:, w - 1] = False
    pattern = ex[0::2, 0::2] * 1 + ex[1::2, 0::2] * 2 + ey[0::2, 0::2] * 4 + ey[0::2, 1::2] * 8
    component = _BLOCK_COMPONENTS[pattern].reshape(-1, 4)  # (blocks, pixel a b c d) -> its part
    corners = [(0, 0), (0, 1), (1, 0), (1, 1)]
    pixel_linked = np.stack([lk[i::2, j::2].ravel() for i, j in corners], -1)
    blocks = np.arange(hc * wc)
    used = np.zeros((hc * wc, 4), bool)  # (block, part): a part with some pixel in an edge
    for k in range(4):
        used[blocks[pixel_linked[:, k]], component[pixel_linked[:, k], k]] = True
    ids = np.cumsum(used.ravel()).reshape(-1, 4) - 1
    aggregate = np.full((2 * hc, 2 * wc), -1, np.intp)
    for k, (i, j) in enumerate(corners):
        aggregate[i::2, j::2] = np.where(pixel_linked[:, k], ids[blocks, component[:, k]], -1).reshape(hc, wc)
    block_of = np.nonzero(used)[0]
    coords = np.stack([block_of // wc, block_of % wc], -1)
    return aggregate[:h, :w].ravel(), int(used.sum()), coords


class _SparseLaplacian:
    """A graph Laplacian K = diag(degree) - A on any graph (the coarse levels), A a symmetric float32 CSR
    adjacency; coords (n, 2): each node's block coordinates at this level (for the next coarsening)."""

    def __init__(self, adjacency, coords: np.ndarray):
        self.adjacency = adjacency
        self.degree = np.asarray(adjacency.sum(axis=1), dtype=np.float32).ravel()
        self.coords = coords
        self.size = adjacency.shape[0]

    def __call__(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        np.multiply(self.degree, x, out=out)
        out -= self.adjacency @ x
        return out

    def coarse_aggregates(self, adjacency) -> tuple:
        """The next coarsening: the nodes of each 2 x 2 group of blocks split into the parts that the edges
        among them connect; nodes with no edge left (a whole region inside one block: M's null space) join
        no aggregate. `adjacency`: this level's, as COO. Returns (aggregate of each node, -1 for none;
        count; coords of each aggregate)."""
        from scipy.sparse import csr_matrix
        from scipy.sparse.csgraph import connected_components

        group = (self.coords[:, 0] // 2) * (1 << 31) + self.coords[:, 1] // 2
        inside = group[adjacency.row] == group[adjacency.col]
        graph = csr_matrix(
            (np.ones(int(inside.sum()), np.int8), (adjacency.row[inside], adjacency.col[inside])),
            shape=(self.size, self.size),
        )
        _, part = connected_components(graph, directed=False)
        alive = self.degree > 0
        used = np.zeros(self.size + 1, bool)
        used[part[alive]] = True
        ids = np.cumsum(used) - 1
        aggregate = np.where(alive, ids[part], -1).astype(np.intp)
        count = int(used.sum())
        coords = np.zeros((count, 2), self.coords.dtype)
        coords[aggregate[alive]] = self.coords[alive] // 2
        return aggregate, count, coords


def _galerkin(a: np.ndarray, b: np.ndarray, weights: np.ndarray, count: int):
    """The adjacency of P^T K P for P = the aggregates' indicator vectors, from the fine edges between two
    aggregates (each edge once: a[k] != b[k] its ends' aggregates, weights[k] > 0 its weight): two
    aggregates are joined by the sum of the weights of the fine edges between them."""
    from scipy.sparse import coo_matrix

    upper = coo_matrix((weights.astype(np.float32), (np.minimum(a, b), np.maximum(a, b))), shape=(count, count)).tocsr()
    upper.sum_duplicates()
    return (upper + upper.T).tocsr()


def _grid_edges(aggregate: np.ndarray, wx: np.ndarray, wy: np.ndarray) -> tuple:
    """The grid's edges (horizontal ones wrapping) between two aggregates, as `_galerkin` takes them, read
    off the grid without index arrays (an edge with weight has both ends in aggregates)."""
    grid = aggregate.reshape(wx.shape)
    right = _shift_left(grid)
    across, down = (wx > 0) & (grid != right), (wy > 0) & (grid[:-1] != grid[1:])
    return (
        np.concatenate([grid[across], grid[:-1][down]]),
        np.concatenate([right[across], grid[1:][down]]),
        np.concatenate([wx[across], wy[down]]),
    )


def _coarse_edges(aggregate: np.ndarray, edges) -> tuple:
    """A coarse level's edges (its adjacency as COO; each edge once) between two of the next level's
    aggregates, as `_galerkin` takes them."""
    a, b = aggregate[edges.row], aggregate[edges.col]
    keep = (edges.row < edges.col) & (a != b) & (a >= 0) & (b >= 0)
    return a[keep], b[keep], edges.data[keep]


class _Transfer:
    """P (fine -> coarse aggregates) as restriction r -> P^T r (a CSR product) and prolongation x += P e
    (a gather; nodes in no aggregate read the zero appended to e)."""

    def __init__(self, aggregate: np.ndarray, count: int):
        from scipy.sparse import csr_matrix

        member = np.flatnonzero(aggregate >= 0)
        self.restriction = csr_matrix(
            (np.ones(member.size, np.float32), (aggregate[member], member)), shape=(count, aggregate.size)
        )
        self.index = np.where(aggregate >= 0, aggregate, count)
        self._extended = np.zeros(count + 1, np.float32)
        self._gathered = np.empty(aggregate.size, np.float32)

    def restrict(self, r: np.ndarray) -> np.ndarray:
        return self.restriction @ r.ravel()

    def prolong_add(self, x: np.ndarray, e: np.ndarray, scale: float) -> None:
        np.multiply(e, np.float32(scale), out=self._extended[:-1])
        np.take(self._extended, self.index, out=self._gathered, mode="clip")
        x += self._gathered.reshape(x.shape)


class _Multigrid:
    """A symmetric V-cycle for K (positive semi-definite: the same damped Jacobi step before and after the
    coarse correction), aggregation multigrid: aggregates are the connected parts of 2 x 2 blocks (of
    pixels, then of aggregates: `_block_aggregates`, `_SparseLaplacian.coarse_aggregates`), coarse operators
    exact Galerkin products (graph Laplacians again), the coarse correction over-corrected (the usual remedy
    for piecewise-constant interpolation), the pseudo-inverse on the coarsest level. The finest level runs on
    the grid (`fine`: the system's own `_GraphLaplacian`, whose buffers the two share), the coarse ones as
    sparse matrices. K's null space, one constant per region, is left to the caller (`_RegionMeans`); no
    diagonal shift regularises it (the old 1e-4 shift gave those constants a gain of 1e4: see
    `solve_log_distance`). Used as the preconditioner of M; the result of a call lives in a buffer that the
    next call overwrites."""

    OMEGA = 0.85  # Jacobi damping: omega * lambda_max(D^-1 K) <= 1.7 < 2 keeps each step a contraction
    OVER = 2.2  # coarse-correction scaling (with OMEGA: the fewest steps on room, model and holes views)
    COARSEST = 300  # nodes at most on the coarsest level (its pseudo-inverse is dense)
    RCOND = 1e-6  # the coarsest pseudo-inverse drops eigenvalues below this times the largest (the null space)

    def __init__(self, fine: _GraphLaplacian):
        wx, wy = fine.wx, fine.wy
        self.levels: list = [fine]
        self.transfers: list = []
        if wx.size > self.COARSEST:
            aggregate, count, coords = _block_aggregates(wx, wy, fine.degree > 0)
            ends = _grid_edges(aggregate, wx, wy)
            while count > 0:
                self.transfers.append(_Transfer(aggregate, count))
                coarse = _SparseLaplacian(_galerkin(*ends, count), coords)
                self.levels.append(coarse)
                if count <= self.COARSEST:
                    break
                edges = coarse.adjacency.tocoo()
                aggregate, count, coords = coarse.coarse_aggregates(edges)
                ends = _coarse_edges(aggregate, edges)
        self.smooth = []
        for level in self.levels[:-1]:
            d = level.degree
            self.smooth.append(np.where(d > 0, self.OMEGA / np.where(d > 0, d, 1), 0).astype(np.float32))
        self._x = [np.empty_like(s) for s in self.smooth]
        self._work = [np.empty_like(s) for s in self.smooth]
        # the coarsest level's nodes with an edge (at most COARSEST: a level whose next has no aggregate has
        # no edge at all): its pseudo-inverse, 0 on the others (their rows of K are 0)
        last = self.levels[-1]
        self._alive = np.flatnonzero(last.degree > 0)
        self.coarsest = np.linalg.pinv(self._dense(last, self._alive), rcond=self.RCOND, hermitian=True).astype(
            np.float32
        )

    @staticmethod
    def _dense(level, nodes: np.ndarray) -> np.ndarray:
        """The coarsest operator among `nodes` as a dense float64 matrix."""
        if isinstance(level, _SparseLaplacian):
            block = level.adjacency[nodes][:, nodes].toarray().astype(np.float64)
            return np.diag(level.degree[nodes].astype(np.float64)) - block
        h, w = level.shape
        dense = np.zeros((nodes.size, nodes.size))
        for column, k in enumerate(nodes):  # a grid small enough to be the coarsest: column by column
            unit = np.zeros(h * w)
            unit[k] = 1.0
            dense[:, column] = level(unit.reshape(h, w)).ravel()[nodes]
        return dense

    def __call__(self, b: np.ndarray, k: int = 0) -> np.ndarray:
        """B b (float32), in this level's result buffer (shape of b)."""
        if k == len(self.levels) - 1:
            out = np.zeros(b.size, b.dtype)
            out[self._alive] = self.coarsest @ b.ravel()[self._alive]
            return out.reshape(b.shape)
        apply, smooth, x, work = self.levels[k], self.smooth[k], self._x[k], self._work[k]
        transfer = self.transfers[k]
        np.multiply(smooth, b, out=x)
        np.subtract(b, apply(x, out=work), out=work)
        transfer.prolong_add(x, self(transfer.restrict(work), k + 1), self.OVER)
        np.subtract(b, apply(x, out=work), out=work)
        work *= smooth
        x += work
        return x


class _RegionMeans:
    """Removes each connected region's mean from a vector: the projection onto the orthogonal complement of
    M's null space (one constant per region, see `_regions`). Pixels in no region are set to 0."""

    def __init__(self, labels: np.ndarray, count: int):
        self.labels, self.count = labels, count
        self.weight = (labels > 0).astype(np.float32)
        self.sizes = np.bincount(labels.ravel(), minlength=count + 1).astype(np.float64)

    def __call__(self, v: np.ndarray) -> np.ndarray:
        """v (H, W), changed in place and returned."""
        if self.count == 1:  # the usual case: one region, one mean
            v -= v.dtype.type(float(np.dot(v.ravel(), self.weight.ravel())) / self.sizes[1])
        elif self.count > 1:
            means = np.bincount(self.labels.ravel(), v.ravel().astype(np.float64), self.count + 1) / np.maximum(
                self.sizes, 1
            )
            v -= means[self.labels].astype(v.dtype)
        v *= self.weight
        return v


@dataclass
class SolveResult:
    """x (H, W) float64 log distance; iterations: CG steps; residual: the final relative residual
    |rhs - M x| / |rhs| of the normal equations, computed in float64 (0 when rhs = 0: then x0's constant per
    region is the answer); converged: residual <= rtol."""

    x: np.ndarray
    iterations: int
    residual: float
    converged: bool


RELIABLE = 1e-3  # the recursive residual is replaced by the true one each time it falls this much


def _check_solve_options(rtol: float, maxiter: int) -> None:
    if not rtol > 0:  # also refuses nan
        raise ValueError(f"rtol: a positive relative residual, got {rtol!r}")
    if isinstance(maxiter, bool) or not (isinstance(maxiter, (int, np.integer)) and maxiter >= 0):
        raise ValueError(f"maxiter: a count of CG steps >= 0, got {maxiter!r}")


def solve_log_distance(data: MergeData, x0: np.ndarray, rtol: float = 1e-6, maxiter: int = 500) -> SolveResult:
    """Minimise the objective from x0 (H, W): conjugate gradients on the normal equations M x = rhs,
    preconditioned by a multigrid V-cycle of the gradient term K = D^T A D alone. Where a view sees the
    Laplacian of a pixel it sees that pixel's four edges, so L B L <= 8 K: the preconditioned spectrum lies
    within [1, 9] times the V-cycle's own, whatever the grid size, and each step costs linear time.

    What makes it converge on every input (issue #23):
    * M is singular by one constant per connected region. Round-off puts a little of those constants into
      every residual; a preconditioner that amplifies them (the old V-cycle of K + 1e-4 I did, by 1e4, and
      any V-cycle of K does by up to the inverse of its smallest coarse eigenvalues) turns them into search
      directions that M maps to nothing, and CG diverged. Here every residual has its region means removed
      (`_RegionMeans`) before the V-cycle sees it, and the V-cycle has no shift. (The directions may still
      carry constants of a normal size, which M and the residuals ignore; `metric_offsets` sets each
      region's constant afterwards.)
    * Mixed precision with reliable updates: the products and the V-cycle run in float32 (half the memory
      traffic), x in float64, and the recursive float32 residual is replaced by the true one, rhs - M x in
      float64, each time it has fallen by RELIABLE and before stopping. Float32 alone drifts from the true
      residual near 1e-4, and cannot hold x: a float32 x rounds to 1e-7, which M's stencil turns into a
      residual of ~1e-3 |rhs| at 1920x960 (and M d in float32 is as inaccurate for a smooth correction d,
      so the replacement has to be float64).
    * Flexible CG: each step is the exact line search along its direction (alpha = r.p / p.Mp) and each new
      direction is made M-orthogonal to the last explicitly (beta = -z.Mp / p.Mp), which absorbs the
      float32 V-cycle's slight asymmetry and the residual replacements.
    * The V-cycle's aggregates follow the edges (`_block_aggregates`): on masks full of small holes the old
      2 x 2 blocks tied together pixels that only a long way round connects, and the solve took thousands
      of steps at 1920x960 (see `_Multigrid`).

    Stops when the float64 |rhs - M x| <= rtol |rhs| (converged), after maxiter steps, or when a step finds
    no descent left (round-off: not converged). Pixels without any equation keep their x0."""
    _check_solve_options(rtol, maxiter)
    if np.shape(x0) != (data.height, data.width):
        raise ValueError(f"x0: the start, a ({data.height}, {data.width}) array, got shape {np.shape(x0)}")
    system = _NormalEquations(data)
    project = _RegionMeans(*data.regions)
    x = np.array(x0, dtype=np.float64)
    norm_rhs = float(np.linalg.norm(system.rhs))
    if norm_rhs == 0.0:  # M x = 0: the constants per region are the minimisers; keep x0's
        x -= project(x.copy())
        return SolveResult(x, 0, 0.0, True)
    precondition = _Multigrid(system.gradient_term)
    r64 = np.empty_like(x)
    q = np.empty(x.shape, np.float32)
    step = np.empty_like(q)
    stop = rtol * norm_rhs

    def true_residual() -> float:
        """r = rhs - M x from float64 (projected); returns its norm."""
        np.subtract(system.rhs, system.apply(x, out=r64), out=r64)
        project(r64)
        np.copyto(r, r64)
        return float(np.linalg.norm(r64))

    r = np.empty(x.shape, np.float32)
    norm_r = replaced = true_residual()
    exact = True  # r is the true residual
    p = precondition(r).copy()
    iteration = 0
    while True:
        if norm_r <= stop and not exact:  # the recursive residual says so: ask the true one
            norm_r = replaced = true_residual()
            exact = True
        if norm_r <= stop or iteration >= maxiter:
            break
        system.apply(p, out=q)
        pq = float(np.vdot(p, q))
        if not pq > 0.0:  # no descent left in float32
            break
        alpha = np.float32(float(np.vdot(r, p)) / pq)  # the exact line search along p, whatever r was
        x += np.multiply(p, alpha, out=step)
        r -= np.multiply(q, alpha, out=step)
        project(r)  # the round-off of this step in M's null space, which the V-cycle would amplify
        norm_r, exact = float(np.linalg.norm(r)), False
        iteration += 1
        if stop < norm_r <= RELIABLE * replaced:
            norm_r = replaced = true_residual()
            exact = True
        z = precondition(r)
        beta = np.float32(-float(np.vdot(z, q)) / pq)  # the next direction M-orthogonal to this one
        p *= beta
        p += z
    if not exact:
        norm_r = true_residual()
    residual = norm_r / norm_rhs
    return SolveResult(x, iteration, residual, residual <= rtol)


# ---------------------------------------------------------------------------------------- the metric offset
def _regions(data: MergeData) -> tuple:
    """(labels (H, W) int, count): the connected components of the graph whose edges are the gradient
    equations (edges with weight > 0, the seam's included): M's null space is one constant on each. 0 = in
    no gradient equation (such a pixel is in no equation at all: a Laplacian's pixel has its four edges).

    Two neighbouring pixels that each take part in some equation are not joined unless the edge between
    them is an equation itself, so the labelling runs on a grid of twice the resolution, where the pixels sit
    at even (row, column) and each edge between them: (2i, 2j + 1) the edge j -> j + 1 (the last column holds
    the seam's), (2i + 1, 2j) the edge i -> i + 1; 4-connected components there are the graph's."""
    from scipy import ndimage

    h, w = data.height, data.width
    wx, wy = data.grad_x_weight > 0, data.grad_y_weight > 0
    linked = wx | _shift_right(wx)
    linked[:-1] |= wy
    linked[1:] |= wy
    fine = np.zeros((2 * h - 1, 2 * w), bool)
    fine[0::2, 0::2] = linked
    fine[0::2, 1::2] = wx
    fine[1::2, 0::2] = wy
    fine_labels, count = ndimage.label(fine)
    labels = fine_labels[0::2, 0::2]
    seam = np.nonzero(wx[:, -1])[0]  # the seam's edges join their label (at the last column) to column 0's
    if count > 1 and seam.size:
        parent = np.arange(count + 1)

        def root(a: int) -> int:
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        for a, b in set(zip(fine_labels[2 * seam, -1].tolist(), labels[seam, 0].tolist())):
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
    labels, count = data.regions
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
    """distance (H, W) float32 metres (meaningful where mask), mask (H, W) bool; the solve's CG iterations,
    final relative residual and whether it reached rtol (`SolveResult`); seconds per step ("warp", "solve",
    "offset")."""

    distance: np.ndarray
    mask: np.ndarray
    iterations: int
    residual: float
    converged: bool
    seconds: dict


def merge_distance_maps(
    distance_maps: Sequence[np.ndarray],
    masks: Sequence[np.ndarray],
    cameras: Sequence,
    width: int,
    height: int,
    rtol: float = 1e-6,
    maxiter: int = 500,
) -> MergeResult:
    """The views' distance maps (each (s, s), metres) and validity masks -> the panorama's distance map at
    W x H (see the module docstring). `rtol`: the solve's relative residual; `maxiter`: its CG steps at most.
    A RuntimeWarning when the solve stops short of rtol (the result then says converged=False)."""
    import time
    import warnings

    if not (len(distance_maps) == len(masks) == len(cameras)) or not len(cameras):
        raise ValueError(
            f"distance_maps, masks and cameras: one of each per view, got {len(distance_maps)}, "
            f"{len(masks)} and {len(cameras)}"
        )
    _check_solve_options(rtol, maxiter)  # before the warp's work
    t0 = time.perf_counter()
    data = warp_views(distance_maps, masks, cameras, width, height)
    t1 = time.perf_counter()
    # start from 0 on the regions (their constants are metric_offsets' business): the views' mean has the
    # jumps between views in it, a residual 20-40 times |rhs| that costs 2-5 more steps at 1920x960;
    # pixels in no equation keep the views' mean, which is their answer
    x0 = np.where(data.regions[0] > 0, np.float32(0), data.mean_log_distance())
    solved = solve_log_distance(data, x0, rtol, maxiter)
    if not solved.converged:
        warnings.warn(
            f"panorama merge: the least-squares solve stopped at a relative residual of "
            f"{solved.residual:.2e} after {solved.iterations} CG iterations, short of rtol={rtol:g}; "
            f"the distances may be off the objective's minimiser",
            RuntimeWarning,
            stacklevel=2,
        )
    t2 = time.perf_counter()
    x = solved.x + metric_offsets(data, solved.x)
    t3 = time.perf_counter()
    distance = np.exp(x).astype(np.float32)
    return MergeResult(
        distance,
        data.mask,
        solved.iterations,
        solved.residual,
        solved.converged,
        {"warp": t1 - t0, "solve": t2 - t1, "offset": t3 - t2},
    )

"""A bundle adjustment over a few keyframes of a chain: their poses and scales and the 3D points of the features
they share, fitted to where each keyframe sees each feature (its image position) and to how far (its depth).

Why: a keyframe link fitted between two frames' points, or by `solvePnP` against the reference's points, takes
the reference's depth as exact. A real network's depth errors are smooth across the frame (a few percent that
bend a whole wall, not per-pixel noise), so such a fit's pose moves with them: on the 150-frame walk of
tests/test_video_long.py with the stand-in's 3 % smooth warp, a 29 cm link was off by 9 cm on average, and the
chain's depth drifted by 5 % (docs/video.md). The image positions are not moved by a depth error; the depths of
several frames, each bent its own way, average. So here each feature is one point in the world, seen by every
keyframe of the window that follows it: its reprojection error in each (PIXEL_STD pixels) and its depth's log
ratio to each keyframe's own depth there (DEPTH_STD) are the residuals, and the poses are where both agree.

Unknowns: each free keyframe's similarity (raw points -> world, as in posegraph.py: a rotation vector, a
translation and a log scale, corrections to its estimate) and each point's world position. The oldest keyframe of
the window is held (the window's gauge: its pose and its scale are the pose graph's). A keyframe's scale prior
(the model's metric scale, posegraph.PRIOR_STD per frame hanging on it) enters as in the pose graph. Solved by
Levenberg-Marquardt (`levenberg_marquardt`) on an analytic sparse Jacobian (an observation touches one keyframe and
one point), the points eliminated by the Schur complement, with a robust (Cauchy) loss at LOSS_SCALE spreads, until
a step gains less than TOLERANCE of the cost (ITERATIONS at most). The spreads themselves are
measured: the window is solved with PIXEL_STD and DEPTH_STD, then again with the median absolute residuals it
left (ROUNDS), so that exact depths hold the poses as a 3D fit would and bent ones leave them to the image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .posegraph import Similarity, skew

__all__ = ["PIXEL_STD", "DEPTH_STD", "View", "adjust", "levenberg_marquardt"]

PIXEL_STD = 0.5  # the first solve's spread of a feature's position (pixels of the shrunk tracking image)
DEPTH_STD = 0.05  # ... of a keyframe's depth at a feature, in log
LOSS_SCALE = 3.0  # residuals beyond this many spreads weigh less (a slipped track, an occlusion)
MIN_PIXEL_STD, MIN_DEPTH_STD = 0.05, 0.001  # the measured spreads' floors
ROUNDS = 2  # solved, its spreads measured, solved again with them
ITERATIONS = 20  # Levenberg-Marquardt steps per round at most
TOLERANCE = 1e-3  # ... until a step lowers the cost by less than this share of it
MIN_VIEWS = 2  # a point seen by fewer keyframes of the window does not enter


@dataclass
class View:
    """A keyframe as the adjustment sees it: its pixel intrinsics (those of `pixels`), its features' ids (M,),
    their positions (M, 2) (pixel centres at +0.5), its own raw depth at each (M,) (NaN where it has none: a
    feature carried by a fit), its similarity (raw -> world), whether it is held, and its scale prior (weight,
    weighted target log scale) as the pose graph folds it (weight 0: none)."""

    k: np.ndarray
    ids: np.ndarray
    pixels: np.ndarray
    depth: np.ndarray
    estimate: Similarity
    held: bool = False
    prior: tuple = (0.0, 0.0)


def _points(views: list) -> tuple:
    """(ids of the points seen by at least MIN_VIEWS views, one with a depth; their first world position: lifted
    by the first view that has a depth for them; (view, point, pixel, log depth) of each observation)."""
    ids = np.concatenate([v.ids for v in views])
    unique, counts = np.unique(ids, return_counts=True)
    has_depth = np.unique(np.concatenate([v.ids[np.isfinite(v.depth)] for v in views]))
    keep = unique[(counts >= MIN_VIEWS) & np.isin(unique, has_depth)]
    start = np.full((len(keep), 3), np.nan)
    obs_view, obs_point, obs_pixel, obs_depth = [], [], [], []
    for n, v in enumerate(views):
        where = np.isin(v.ids, keep)
        point = np.searchsorted(keep, v.ids[where])
        pixel, depth = v.pixels[where], v.depth[where]
        obs_view.append(np.full(len(point), n))
        obs_point.append(point)
        obs_pixel.append(pixel)
        obs_depth.append(np.log(np.where(depth > 0, depth, np.nan)))
        fresh = np.isfinite(depth) & np.isnan(start[point, 0])
        if fresh.any():
            k = np.asarray(v.k, np.float64)
            rays = np.stack(
                [(pixel[fresh, 0] - k[0, 2]) / k[0, 0], (pixel[fresh, 1] - k[1, 2]) / k[1, 1], np.ones(fresh.sum())],
                axis=1,
            )
            raw = rays * depth[fresh, None]
            s = v.estimate
            start[point[fresh]] = s.scale * raw @ s.rotation.T + s.translation
    cat = np.concatenate
    return keep, start, (cat(obs_view), cat(obs_point), cat(obs_pixel), cat(obs_depth))


def adjust(views: list, iterations: int = ITERATIONS) -> Optional[dict]:
    """Solve the window `views` (the oldest first; at least one held). Returns {"estimates": [Similarity per
    view], "points": number, "observations": number, "cost_before", "cost_after"}, or None when too little is
    shared to adjust (fewer than 3 points per free view)."""
    from scipy.sparse import coo_matrix
    from scipy.spatial.transform import Rotation

    free = [n for n, v in enumerate(views) if not v.held]
    if not free or len(free) == len(views):
        return None
    ids, start, (o_view, o_point, o_pixel, o_logz) = _points(views)
    if len(ids) < 3 * len(free):
        return None
    n_free, n_points = len(free), len(ids)
    column = np.full(len(views), -1)
    column[free] = np.arange(n_free)
    base_r = np.stack([v.estimate.rotation for v in views])
    base_c = np.stack([v.estimate.translation for v in views])
    base_l = np.log([v.estimate.scale for v in views])
    ks = np.stack([np.asarray(v.k, np.float64) for v in views])
    with_depth = np.isfinite(o_logz)
    depth_rows = np.flatnonzero(with_depth)
    weights = np.array([v.prior[0] for v in views])
    priors = np.array([n for n in free if weights[n] > 0], int)
    p_w = np.sqrt(weights[priors])
    p_t = np.array([views[n].prior[1] / weights[n] for n in priors])

    def unpack(x: np.ndarray) -> tuple:
        delta = x[: 7 * n_free].reshape(-1, 7)
        r, c, lg = base_r.copy(), base_c.copy(), base_l.copy()
        r[free] = Rotation.from_rotvec(delta[:, :3]).as_matrix() @ base_r[free]
        c[free] = base_c[free] + delta[:, 3:6]
        lg[free] = base_l[free] + delta[:, 6]
        return r, c, lg, start + x[7 * n_free :].reshape(-1, 3)

    stds = [PIXEL_STD, DEPTH_STD]

    def residuals(x: np.ndarray) -> np.ndarray:
        pixel, depth = errors(x)
        lg = unpack(x)[2]
        return np.concatenate([pixel / stds[0], depth / stds[1], p_w * (lg[priors] - p_t)])

    def errors(x: np.ndarray) -> tuple:
        r, c, lg, points = unpack(x)
        cam = np.einsum("nji,nj->ni", r[o_view], points[o_point] - c[o_view])  # R^T (X - c): world-scale camera
        z = np.maximum(cam[:, 2], 1e-6)
        k = ks[o_view]
        u = k[:, 0, 0] * cam[:, 0] / z + k[:, 0, 2]
        v = k[:, 1, 1] * cam[:, 1] / z + k[:, 1, 2]
        pixel = (np.stack([u, v], axis=1) - o_pixel).ravel()
        depth = np.log(z[depth_rows]) - lg[o_view[depth_rows]] - o_logz[depth_rows]
        return pixel, depth

    n_obs, n_depth = len(o_view), len(depth_rows)
    obs_col = column[o_view]
    on = obs_col >= 0  # observations of a free view
    shape = (2 * n_obs + n_depth + len(priors), 7 * n_free + 3 * n_points)

    def jacobian(x: np.ndarray):
        """d residuals / d unknowns, analytic: cam = R^T (X - c), a view's rotation corrected on the left
        (exp(e) R: d cam / d e = R^T [X - c]x, the small-angle form, as in posegraph.py)."""
        r, c, _, points = unpack(x)
        rt = np.transpose(r[o_view], (0, 2, 1))
        w = points[o_point] - c[o_view]
        cam = np.einsum("nij,nj->ni", rt, w)
        z = np.maximum(cam[:, 2], 1e-6)
        k = ks[o_view]
        d_pixel = np.zeros((n_obs, 2, 3))  # d (u, v) / d cam
        d_pixel[:, 0, 0], d_pixel[:, 0, 2] = k[:, 0, 0] / z, -k[:, 0, 0] * cam[:, 0] / z**2
        d_pixel[:, 1, 1], d_pixel[:, 1, 2] = k[:, 1, 1] / z, -k[:, 1, 1] * cam[:, 1] / z**2
        d_pixel /= stds[0]
        d_depth = np.zeros((n_depth, 1, 3))
        d_depth[:, 0, 2] = 1.0 / (z[depth_rows] * stds[1])
        d_cam_rot = rt @ skew(w)  # d cam / d rotation correction
        rows_i, cols_i, vals = [], [], []

        def put(rows: np.ndarray, cols: np.ndarray, block: np.ndarray) -> None:
            rows_i.append(np.broadcast_to(rows[:, :, None], block.shape).ravel())
            cols_i.append(np.broadcast_to(cols[:, None, :], block.shape).ravel())
            vals.append(block.ravel())

        for first, obs, d in ((0, np.arange(n_obs), d_pixel), (2 * n_obs, depth_rows, d_depth)):
            m = d.shape[1]
            rows = (first + m * np.arange(len(obs)) if m == 2 else first + np.arange(len(obs)))[:, None] + np.arange(m)
            point_cols = 7 * n_free + 3 * o_point[obs][:, None] + np.arange(3)
            put(rows, point_cols, d @ rt[obs])
            free_obs = on[obs]
            view_cols = 7 * obs_col[obs][free_obs][:, None] + np.arange(7)
            block = np.zeros((int(free_obs.sum()), m, 7))
            block[:, :, :3] = d[free_obs] @ d_cam_rot[obs][free_obs]
            block[:, :, 3:6] = -(d[free_obs] @ rt[obs][free_obs])
            if m == 1:
                block[:, 0, 6] = -1.0 / stds[1]
            put(rows[free_obs], view_cols, block)
        if len(priors):
            rows_i.append(2 * n_obs + n_depth + np.arange(len(priors)))
            cols_i.append(7 * column[priors] + 6)
            vals.append(p_w)
        return coo_matrix((np.concatenate(vals), (np.concatenate(rows_i), np.concatenate(cols_i))), shape).tocsr()

    x = np.zeros(7 * n_free + 3 * n_points)
    before = float(np.sum(residuals(x) ** 2))
    for _ in range(ROUNDS):
        x, cost = levenberg_marquardt(residuals, jacobian, x, 7 * n_free, iterations)
        pixel, depth = errors(x)
        stds[0] = max(1.4826 * float(np.median(np.abs(pixel))), MIN_PIXEL_STD)
        stds[1] = max(1.4826 * float(np.median(np.abs(depth - np.median(depth)))), MIN_DEPTH_STD)
    r, c, lg, _ = unpack(x)
    estimates = [Similarity(float(np.exp(lg[n])), r[n], c[n]) for n in range(len(views))]
    return {
        "estimates": estimates,
        "points": n_points,
        "observations": len(o_view),
        "cost_before": before,
        "cost_after": cost,
        "stds": tuple(stds),
    }


def _robust(r: np.ndarray, scale: float = LOSS_SCALE) -> tuple:
    """(the Cauchy cost sum c^2 log(1 + (r / c)^2) of residuals `r` in spreads, c = LOSS_SCALE; each residual's
    weight in the reweighted normal equations, 1 / (1 + (r / c)^2))."""
    ratio = (r / scale) ** 2
    return float(scale**2 * np.sum(np.log1p(ratio))), 1.0 / (1.0 + ratio)


def _schur(jac, weight: np.ndarray, r: np.ndarray, split: int):
    """The reweighted normal equations of a sparse Jacobian whose unknowns after `split` are points (three each,
    each residual touching at most one point) -> a function of the damping that returns the step, the points
    eliminated by the Schur complement (the keyframes' system is small and dense, each point's 3x3 block is
    inverted alone)."""
    jac = jac.tocsr()
    weighted = jac.multiply(weight[:, None]).tocsr()
    views, points = jac[:, :split], jac[:, split:].tocoo()
    m = (jac.shape[1] - split) // 3
    per_row = np.zeros((jac.shape[0], 3))
    point_of = np.full(jac.shape[0], -1)
    per_row[points.row, points.col % 3] = points.data
    point_of[points.row] = points.col // 3
    has = point_of >= 0
    blocks = np.zeros((m, 3, 3))
    np.add.at(blocks, point_of[has], weight[has, None, None] * per_row[has, :, None] * per_row[has, None, :])
    h_vv = (views.T @ weighted[:, :split]).toarray()
    h_vp = (views.T @ weighted[:, split:]).toarray().reshape(split, m, 3)
    gradient = weighted.T @ r
    g_v, g_p = gradient[:split], gradient[split:].reshape(m, 3)

    def step(damping: float) -> np.ndarray:
        damped = blocks + damping * np.einsum("mii->mi", blocks)[:, :, None] * np.eye(3)
        inverse = np.linalg.inv(damped + 1e-12 * np.eye(3))
        through = np.einsum("vmi,mij->vmj", h_vp, inverse)
        schur = h_vv + damping * np.diag(np.diag(h_vv)) - np.einsum("vmj,umj->vu", through, h_vp)
        step_v = np.linalg.solve(schur, -g_v + np.einsum("vmj,mj->v", through, g_p))
        step_p = np.einsum("mij,mj->mi", inverse, -g_p - np.einsum("vmi,v->mi", h_vp, step_v))
        return np.concatenate([step_v, step_p.ravel()])

    return step


def _dense(jac: np.ndarray, weight: np.ndarray, r: np.ndarray):
    """The reweighted normal equations of a dense Jacobian (a single pose: `registration.joint_pose`) -> a
    function of the damping that returns the step."""
    weighted = jac * weight[:, None]
    normal, gradient = jac.T @ weighted, weighted.T @ r

    def step(damping: float) -> np.ndarray:
        return np.linalg.solve(normal + damping * np.diag(np.diag(normal)) + 1e-12 * np.eye(len(normal)), -gradient)

    return step


def levenberg_marquardt(
    residuals,
    jacobian,
    x: np.ndarray,
    split: int,
    iterations: int,
    loss_scale: float = LOSS_SCALE,
    tolerance: float = TOLERANCE,
) -> tuple:
    """(x, its robust cost) after Levenberg-Marquardt on the reweighted normal equations (the Cauchy loss at
    `loss_scale`, residuals in spreads), until a step lowers the cost by less than `tolerance` of it. `jacobian`
    returns a sparse matrix whose unknowns after `split` are points (`_schur`), or an array (`_dense`). Why not
    scipy's least_squares: its trust region on LSMR took over a hundred evaluations to bring a window of six
    keyframes started 5 cm off back to the truth (tests/test_video_bundle.py), a step of this a few; on one pose
    its overhead per call was most of a frame's registration."""
    r = residuals(x)
    cost, weight = _robust(r, loss_scale)
    damping = 1e-3
    for _ in range(iterations):
        jac = jacobian(x)
        step = _dense(jac, weight, r) if isinstance(jac, np.ndarray) else _schur(jac, weight, r, split)
        while True:
            trial = x + step(damping)
            r_trial = residuals(trial)
            cost_trial, weight_trial = _robust(r_trial, loss_scale)
            if np.isfinite(cost_trial) and cost_trial < cost:
                break
            damping *= 4.0
            if damping > 1e8:
                return x, cost
        done = cost - cost_trial < tolerance * cost
        x, r, cost, weight, damping = trial, r_trial, cost_trial, weight_trial, max(damping / 3.0, 1e-7)
        if done:
            break
    return x, cost

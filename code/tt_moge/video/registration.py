"""Frame-to-frame registration: image features matched between frames, lifted to 3D through each frame's depth,
and a robust similarity fit between the two point sets.

Features and matches (OpenCV): Shi-Tomasi corners (`goodFeaturesToTrack`) of the reference frame, followed into
the current frame by pyramidal Lucas-Kanade (`calcOpticalFlowPyrLK`), which matches each corner to a sub-pixel
position; both frames are grey and shrunk so that their longer side is TRACK_SIDE pixels (the cost stays flat
from 720p to 4K). A brute-force descriptor matcher (ORB + Hamming) measured several times slower here for the
same number of matches, with pixel-quantised positions (docs/video.md).

Lifting (`lift`): a feature's depth is read bilinearly from the frame's depth map where its 3x3 neighbourhood is
valid and spans at most DEPTH_EDGE_RTOL of the depth (not on a depth edge, where a neighbour may belong to the
other surface); the 3D point is depth x K^-1 [u, v, 1] (OpenCV camera axes).

Fit (`fit_similarity`): X_current = s R X_reference + t by RANSAC over random triples (Umeyama's closed form, all
hypotheses at once), inliers by the 3D residual relative to the depth, then a weighted Umeyama refit on the
inliers (weights 1 / depth^2: a monocular model's depth error grows with the depth), repeated until the inlier
set is stable. The reference's points are already consistent (the clip's scale), so s is the current frame's
scale relative to the clip (1 / s makes it consistent) and (R, t / s) the rigid motion.

Pose (`posed`): a followed fit's pose and scale are then solved again on the image positions and this frame's
depths together (`joint_pose`), from the 3D fit and, where that leaves the points off their tracks (or there is
none), from a PnP seed (`image_fit`): a real network's smooth depth errors move a pose fitted on depths alone.

Checks (`Registration.ok`): at least MIN_INLIERS inliers, an inlier share of at least MIN_INLIER_RATIO, a scale
inside SCALE_RANGE and a residual (root mean square of the inliers' residuals / depth) of at most MAX_RESIDUAL.
A frame that fails them is flagged; the reference stays, and the next frame is tracked from it.

Relocalisation (`Tracker._relocalise`): when the tracks cannot follow a frame (a jump, or failed frames while the
camera moved on), ORB descriptors matched between the reference and the frame give a first fit; the reference's
tracks are followed by KLT from where that fit puts them, and the result must pass the checks above and be
confirmed by the two frames seen through it (`_agreement`: depth, and grey levels, which see a shift along a
floor or a wall that the depth hardly sees). Every tracks' fit is put to that confirmation too: tracks can lock
onto a repeated pattern (across a jump, or a fast pan over a checkered floor) and pass the checks above. Where a
fit is not confirmed, or the tracks are lost, the fits against the reference and against the older keyframes
with the most descriptor matches are compared, and the one whose grey levels agree best is kept: a symmetric
pattern can confirm a wrong fit against one frame while a frame that saw more of the scene confirms the right
one better, and a camera that comes back to where it was is found by the keyframe that saw the place
(`Tracker._relocalised`). A tracks' fit with no failed frame between that is not confirmed still stays when no
other fit is, as it did before the confirmation was asked of it.

`Tracker` keeps the reference: its shrunk grey image and its features with their consistent 3D points. After a
good fit the current frame becomes the reference: its inlier tracks are kept and new corners fill the image
where tracks are missing; it is also kept as a keyframe when fewer than KEYFRAME_OVERLAP of the last keyframe's
features are among its own (at most MAX_KEYFRAMES, thinned out over the clip). Each feature has an id it keeps
while it is followed (`Tracker.features`), so a feature seen in several references is one track: the
calibration's focal search (selfcal.py) reads tracks over several frames.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..constants import DEPTH_EDGE_RTOL
from .bundle import levenberg_marquardt
from .posegraph import information, skew

__all__ = [
    "TRACK_SIDE",
    "TRACK_POINTS",
    "MIN_INLIERS",
    "MIN_INLIER_RATIO",
    "SCALE_RANGE",
    "MAX_RESIDUAL",
    "Registration",
    "Tracker",
    "shrink_grey",
    "lift",
    "umeyama",
    "fit_similarity",
    "joint_pose",
    "dense_scale",
]

TRACK_SIDE = 640  # features are found and followed on the frame shrunk to this longer side (pixels)
TRACK_POINTS = 300  # features kept per reference frame
_REFILL = 0.4  # new corners are looked for when fewer than this share of TRACK_POINTS are left
_MIN_DISTANCE = 8  # pixels (shrunk image) between features
_LK = dict(winSize=(15, 15), maxLevel=3, criteria=(3, 20, 0.03))  # cv2.TERM_CRITERIA_COUNT | EPS
ORB_FEATURES = 1500  # relocalisation: ORB keypoints per frame (shrunk image)
ORB_RATIO = 0.8  # relocalisation: a descriptor match is kept when its distance is below this share of the 2nd best
GUESS_INLIERS, GUESS_INLIER_RATIO = 12, 0.15  # relocalisation: the descriptor fit is only a guess, checked after
MIN_AGREEMENT = 0.6  # confirmation: the share of the reference's view whose depth this frame must confirm
AGREEMENT_RTOL = 0.05  # ... within this share of the depth
DENSE_SCALE_RTOL = 0.15  # dense_scale: the pixels whose depths agree within this share are the same surface
MIN_CORRELATION = 0.8  # confirmation: the correlation of the grey levels the fit puts on each other
KEYFRAME_OVERLAP = 0.5  # a reference is kept as a keyframe when fewer than this share of the last one's
# features are among its own
MAX_KEYFRAMES = 32  # keyframes kept at most (about 1.5 MB each at 1080p)
KEYFRAME_TRIES = 3  # relocalisation against older keyframes: the ones with the most descriptor matches tried
LOOP_GAP = 60  # loop closure: keyframes at least this many frames older than a new one are looked for in it
LOOP_EVERY = 10  # ... and by a frame this many frames after the last search, made a keyframe when it finds one
LOOP_TRIES = 2  # ... the ones whose thumbnails correlate best with it (at least LOOP_THUMB_CORRELATION)
LOOP_THUMB_CORRELATION = 0.5
_LOOP_THUMB = (32, 24)  # the thumbnail a keyframe is first compared on (grey, zero mean, unit norm)
INLIER_RTOL = 0.03  # RANSAC: a match is an inlier when its 3D residual is below this share of its depth
INLIER_SIGMAS = 3.0  # the refit's threshold: this many robust standard deviations of the inliers' residuals,
MIN_INLIER_RTOL = 0.002  # but at least this share of the depth (and at most INLIER_RTOL)
RANSAC_TRIALS = 64
MIN_INLIERS = 20
MIN_INLIER_RATIO = 0.3
SCALE_RANGE = (0.5, 2.0)  # a frame-to-frame scale change outside this is a failed fit, not a real one
MAX_RESIDUAL = 0.02  # root mean square of the inliers' residuals / depth


@dataclass
class Registration:
    """The fit of one frame against its reference: X_this = scale * rotation @ X_reference + translation (metres
    of the clip). ok: the fit passed the checks (else `reason` says which failed); matches: features followed
    into this frame with a depth in both; inliers, inlier_ratio = inliers / matches; residual: root mean square
    of the inliers' residuals / depth; relocalised: the tracks could not follow this frame (or their fit was not
    confirmed), and it was found again by descriptor matches (the fit is that of the reference's tracks followed
    from where those matches put them: `Tracker._relocalise`); reference: the number of the frame it was fitted against
    (the last registered frame, or an older keyframe: `Tracker`)."""

    ok: bool
    scale: float = math.nan
    rotation: Optional[np.ndarray] = None
    translation: Optional[np.ndarray] = None
    matches: int = 0
    inliers: int = 0
    inlier_ratio: float = 0.0
    residual: float = math.nan
    reason: Optional[str] = None
    relocalised: bool = False
    reference: Optional[int] = None
    correlation: float = math.nan  # of the grey levels the fit puts on each other, where it was checked (`_agreement`)
    information: Optional[np.ndarray] = field(default=None, repr=False)  # (7, 7): posegraph.information of the fit

    def record(self) -> dict:
        """The JSON-ready numbers of this fit."""

        def finite(x: float) -> Optional[float]:
            return round(float(x), 6) if math.isfinite(x) else None

        return {
            "registered": bool(self.ok),
            "matches": int(self.matches),
            "inliers": int(self.inliers),
            "inlier_ratio": round(float(self.inlier_ratio), 4),
            "residual": finite(self.residual),
            "relative_scale": finite(self.scale),
            "relocalised": bool(self.relocalised),
            "reference": self.reference,
            "error": self.reason,
        }


def _seen_through(
    reference: tuple, current: tuple, reg: Registration, samples: int, hidden_rtol: float = AGREEMENT_RTOL
) -> tuple:
    """The reference's pixels (a grid of about `samples`) moved by the fit into the current camera, those that land
    in its view where it sees a surface and are not hidden behind it (a point farther than the current depth by
    more than `hidden_rtol` may be occluded; one nearer contradicts it) -> (their rows and columns in the
    reference, in the current frame, their depth moved there (`ahead`, the current frame's units), the current
    frame's depth there, and the number of grid pixels the reference sees). `reference`: (depth, mask, pixel
    intrinsics, offset, scale, ...); `current`: (depth, mask, pixel intrinsics, offset, ...)."""
    depth, mask, k, offset, scale = reference[:5]
    h, w = depth.shape
    step = max(1, int(math.sqrt(h * w / samples)))
    rows, cols = np.mgrid[step // 2 : h : step, step // 2 : w : step]
    z = depth[rows, cols].astype(np.float64) + offset
    seen = mask[rows, cols] & np.isfinite(z) & (z > 0)
    rows, cols, z = rows[seen], cols[seen], z[seen]
    pixels = np.stack([cols + 0.5, rows + 0.5, np.ones(len(z))], axis=1)
    points = (pixels @ np.linalg.inv(np.asarray(k, np.float64)).T) * (z * scale)[:, None]
    moved = reg.scale * points @ reg.rotation.T + reg.translation
    depth2, mask2, k2, offset2 = current[:4]
    h2, w2 = depth2.shape
    with np.errstate(divide="ignore", invalid="ignore"):
        pixels = moved @ np.asarray(k2, np.float64).T
        col, row = np.floor(pixels[:, 0] / pixels[:, 2]), np.floor(pixels[:, 1] / pixels[:, 2])
    inside = (moved[:, 2] > 0) & (col >= 0) & (col < w2) & (row >= 0) & (row < h2)
    col, row, ahead = col[inside].astype(np.intp), row[inside].astype(np.intp), moved[inside, 2]
    there = depth2[row, col].astype(np.float64) + offset2
    judged = mask2[row, col] & np.isfinite(there) & (there > 0)
    judged[judged] = ahead[judged] <= there[judged] * (1 + hidden_rtol)  # else hidden: no evidence either way
    return rows[inside][judged], cols[inside][judged], row[judged], col[judged], ahead[judged], there[judged], len(z)


def dense_scale(reference: tuple, current: tuple, reg: Registration, samples: int = 4096) -> Registration:
    """`reg` with its scale read from the two depth maps rather than from the features: the reference's depth moved
    by the fit into this frame against this frame's depth, the median of their ratio over the pixels where they
    agree within DENSE_SCALE_RTOL (the rest are other surfaces or occlusions); rotation and translation stay (the
    translation scaled with it). Why: a real network's errors are smooth (a wall bent, the far field too near),
    and over a few tens of features a smooth error does not average out as per-pixel noise does; over the whole
    overlap of the two views it does, nearly (the stand-in's warp of 3 %: tests/test_video_long.py). Left as it
    was where fewer than a tenth of the grid agrees."""
    if not reg.ok or reg.rotation is None:
        return reg
    *_, ahead, there, count = _seen_through(reference, current, reg, samples, DENSE_SCALE_RTOL)
    ratio = there / ahead
    near = np.abs(ratio - 1) <= DENSE_SCALE_RTOL
    if near.sum() < max(MIN_INLIERS, 0.1 * count):
        return reg
    factor = float(np.median(ratio[near]))
    return dataclasses.replace(reg, scale=reg.scale * factor, translation=reg.translation * factor)


def _agreement(reference: tuple, current: tuple, reg: Registration, samples: int = 2500) -> tuple:
    """How well the current frame confirms the reference seen through the fit (`_seen_through`) -> (the share of
    the pixels it sees whose depth agrees within AGREEMENT_RTOL, the correlation of their grey levels in the two
    frames). Depth alone hardly sees a shift along a floor or a wall; the grey levels do. `reference`: (depth,
    mask, pixel intrinsics, offset, scale, grey); `current`: (depth, mask, pixel intrinsics, offset, grey); the
    grey images may be shrunk copies of the frames."""
    grey, grey2 = reference[5], current[4]
    h, w = reference[0].shape
    h2, w2 = current[0].shape
    rows, cols, row, col, ahead, there, count = _seen_through(reference, current, reg, samples)
    if len(ahead) < max(3, 0.05 * count):
        return 0.0, 0.0
    agree = np.abs(ahead - there) <= AGREEMENT_RTOL * there

    def level(image: np.ndarray, r: np.ndarray, c: np.ndarray, shape: tuple) -> np.ndarray:
        rr = np.minimum((r + 0.5) * image.shape[0] / shape[0], image.shape[0] - 1).astype(np.intp)
        cc = np.minimum((c + 0.5) * image.shape[1] / shape[1], image.shape[1] - 1).astype(np.intp)
        return image[rr, cc].astype(np.float64)

    a = level(grey, rows, cols, (h, w))
    b = level(grey2, row, col, (h2, w2))
    spread = a.std() * b.std()
    correlation = float(np.mean((a - a.mean()) * (b - b.mean())) / spread) if spread > 0 else 0.0
    return float(agree.mean()), correlation


def _shrunk(shape: tuple, depth: np.ndarray, mask: np.ndarray, k_pixels: np.ndarray) -> tuple:
    """(depth, mask, pixel intrinsics) of a frame at the size (h, w) of its shrunk grey image, nearest-neighbour
    (no depth mixed across an edge): what relocalisation keeps of the reference. A copy in any case, and a small
    one: callers may scale their depth in place afterwards."""
    import cv2

    sy, sx = depth.shape[0] / shape[0], depth.shape[1] / shape[1]
    k = np.diag([1.0 / sx, 1.0 / sy, 1.0]) @ np.asarray(k_pixels, np.float64)  # centres at +0.5 in both
    size = (shape[1], shape[0])
    small = cv2.resize(np.ascontiguousarray(depth, np.float32), size, interpolation=cv2.INTER_NEAREST)
    return small, cv2.resize(mask.astype(np.uint8), size, interpolation=cv2.INTER_NEAREST).astype(bool), k


def _full(tracks: np.ndarray, small: tuple, shape: tuple) -> np.ndarray:
    """Positions in an image shrunk to `small` (h, w) -> pixel positions at `shape` (H, W) (centres at +0.5)."""
    sy, sx = shape[0] / small[0], shape[1] / small[1]
    return np.stack([(tracks[:, 0] + 0.5) * sx, (tracks[:, 1] + 0.5) * sy], axis=1).astype(np.float64)


def _orb(grey: np.ndarray) -> tuple:
    """ORB keypoints of a shrunk grey frame: (positions (N, 2) float32, shrunk-image pixels, descriptors)."""
    import cv2

    keypoints, descriptors = cv2.ORB_create(nfeatures=ORB_FEATURES).detectAndCompute(grey, None)
    return np.array([k.pt for k in keypoints], np.float32).reshape(-1, 2), descriptors


def shrink_grey(rgb: np.ndarray, side: int = TRACK_SIDE) -> np.ndarray:
    """(h, w) uint8 grey image of an (H, W, 3) RGB frame, its longer side shrunk to at most `side`."""
    import cv2

    if rgb.dtype != np.uint8:
        rgb = np.rint(np.clip(rgb, 0.0, 1.0) * 255.0).astype(np.uint8)
    grey = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2GRAY)
    h, w = grey.shape
    shrink = side / max(h, w)
    if shrink >= 1.0:
        return grey
    return cv2.resize(grey, (max(1, round(w * shrink)), max(1, round(h * shrink))), interpolation=cv2.INTER_AREA)


_TAPS = np.arange(-1, 3)  # the 4x4 pixels around a position: floor(x) - 1 ... floor(x) + 2
_PLANE = np.stack(  # [1, dx, dy] of those 16 pixels, from the middle of the four inner ones
    [np.ones(16), np.tile(_TAPS - 0.5, 4), np.repeat(_TAPS - 0.5, 4)], axis=1
)
_PLANE_FIT = np.linalg.pinv(_PLANE)  # (3, 16): least-squares plane coefficients of 16 values
_INNER = np.array([5, 6, 9, 10])  # the 2x2 pixels around the position among the 16
LIFT_STRAY = 2  # pixels of the rim of the 4x4 that may be off the plane (noise), left out of a second fit


def lift(
    pixels: np.ndarray, depth: np.ndarray, mask: np.ndarray, intrinsics_pixels: np.ndarray, offset: float = 0.0
) -> np.ndarray:
    """(N, 3) camera-space points of full-resolution pixel positions (N, 2) (centres at +0.5) through the depth
    map (+ `offset` metres), NaN where there is no usable depth. `intrinsics_pixels` (3, 3) in pixels of the
    depth map.

    A plane is fitted (least squares) to the inverse depth of the 4x4 pixels around the position, and the depth
    is the plane's at the position: inverse depth is linear across a planar surface, so a plane's depth is exact,
    and pixel noise averages out. The position has no usable depth unless those 16 pixels are valid and finite
    and none is off the plane by more than DEPTH_EDGE_RTOL of the inverse depth: on a depth edge the 16 pixels
    hold two surfaces, and the feature may belong to either. Up to LIFT_STRAY pixels of the patch's rim may be
    off (the 2x2 around the position may not): they are left out and the plane fitted again to the others, which
    must then all be on it. A noisy depth map (per-pixel noise of 2 %, the stand-in's) otherwise loses about half
    its features to this test; an edge puts at least four pixels, or the inner ones, off the plane."""
    n = len(pixels)
    out = np.full((n, 3), np.nan)
    h, w = depth.shape
    if n == 0 or h < 4 or w < 4:
        return out
    x, y = pixels[:, 0] - 0.5, pixels[:, 1] - 0.5  # in pixel-centre coordinates
    x0 = np.clip(np.floor(x).astype(np.intp), 1, w - 3)
    y0 = np.clip(np.floor(y).astype(np.intp), 1, h - 3)
    rows, cols = (y0[:, None] + _TAPS)[:, :, None], (x0[:, None] + _TAPS)[:, None, :]
    patch = (depth[rows, cols].astype(np.float64) + offset).reshape(n, 16)
    good = mask[rows, cols].reshape(n, 16).all(axis=1) & np.isfinite(patch).all(axis=1) & (patch > 0).all(axis=1)
    inverse = 1.0 / np.where(good[:, None], patch, 1.0)
    plane = inverse @ _PLANE_FIT.T  # (n, 3): inverse depth at the middle, per pixel across, per pixel down
    off = np.abs(inverse - plane @ _PLANE.T) > DEPTH_EDGE_RTOL * plane[:, :1]
    # a few stray pixels (noise) on the rim of the patch are left out and the plane fitted again; a depth edge
    # puts more of them off the plane, or one of the 2x2 around the position
    stray = off.any(axis=1) & (off.sum(axis=1) <= LIFT_STRAY) & ~off[:, _INNER].any(axis=1) & good
    if stray.any():
        weights = (~off[stray]).astype(np.float64)
        normal = np.einsum("nk,ki,kj->nij", weights, _PLANE, _PLANE)
        plane[stray] = np.linalg.solve(normal, np.einsum("nk,ki->ni", weights * inverse[stray], _PLANE)[..., None])[
            ..., 0
        ]
        off[stray] = (np.abs(inverse[stray] - plane[stray] @ _PLANE.T) > DEPTH_EDGE_RTOL * plane[stray, :1]) & (
            weights > 0
        )
    good &= ~off.any(axis=1)
    q = plane[:, 0] + plane[:, 1] * (x - x0 - 0.5) + plane[:, 2] * (y - y0 - 0.5)
    good &= q > 0
    fx, fy, cx, cy = (float(intrinsics_pixels[i, j]) for i, j in ((0, 0), (1, 1), (0, 2), (1, 2)))
    u, v, z = pixels[good, 0], pixels[good, 1], 1.0 / q[good]
    out[good] = np.stack([(u - cx) / fx * z, (v - cy) / fy * z, z], axis=1)
    return out


def _lift_or_nearest(
    pixels: np.ndarray, depth: np.ndarray, mask: np.ndarray, intrinsics_pixels: np.ndarray, offset: float = 0.0
) -> np.ndarray:
    """`lift`, and where it finds no plane, the depth of the pixel the position falls in (NaN where invalid)."""
    out = lift(pixels, depth, mask, intrinsics_pixels, offset)
    none = ~np.isfinite(out).all(axis=1)
    if none.any():
        h, w = depth.shape
        col = np.clip(np.floor(pixels[none, 0]).astype(np.intp), 0, w - 1)
        row = np.clip(np.floor(pixels[none, 1]).astype(np.intp), 0, h - 1)
        z = np.where(mask[row, col], depth[row, col].astype(np.float64) + offset, np.nan)
        z = np.where(z > 0, z, np.nan)
        k = np.asarray(intrinsics_pixels, np.float64)
        out[none] = np.stack(
            [(pixels[none, 0] - k[0, 2]) / k[0, 0] * z, (pixels[none, 1] - k[1, 2]) / k[1, 1] * z, z], axis=1
        )
    return out


def umeyama(src: np.ndarray, dst: np.ndarray, weights: Optional[np.ndarray] = None, symmetric: bool = False) -> tuple:
    """The similarity (s, R, t) minimising sum w |dst - (s R src + t)|^2 (Umeyama 1991). src, dst (..., N, 3):
    leading dimensions are separate problems (RANSAC's hypotheses), solved at once.

    `symmetric`: the scale is the ratio of the two sets' spreads, sqrt(sum w |dst - mean|^2 / sum w |src - mean|^2)
    (Horn 1987's symmetric scale: the geometric mean of the fit of dst on src and of src on dst). The forward fit's
    scale is low by the share of src's spread that is noise (errors in variables); with the same relative noise in
    both sets, as two frames of one model have, the ratio of the spreads has none of that bias."""
    w = np.ones(src.shape[:-1]) if weights is None else np.broadcast_to(weights, src.shape[:-1])
    w = w / w.sum(axis=-1, keepdims=True)
    mu_s = (w[..., None] * src).sum(axis=-2)
    mu_d = (w[..., None] * dst).sum(axis=-2)
    a, b = src - mu_s[..., None, :], dst - mu_d[..., None, :]
    cov = np.einsum("...n,...ni,...nj->...ij", w, b, a)
    u, sigma, vt = np.linalg.svd(cov)
    d = np.ones(sigma.shape)
    d[..., 2] = np.sign(np.linalg.det(u) * np.linalg.det(vt))
    rotation = u @ (d[..., :, None] * vt)
    var = (w * (a * a).sum(axis=-1)).sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        if symmetric:
            scale = np.sqrt((w * (b * b).sum(axis=-1)).sum(axis=-1) / var)
        else:
            scale = (sigma * d).sum(axis=-1) / var
    translation = mu_d - scale[..., None] * np.einsum("...ij,...j->...i", rotation, mu_s)
    return scale, rotation, translation


def _residual(src: np.ndarray, dst: np.ndarray, scale, rotation, translation) -> np.ndarray:
    """|dst - (s R src + t)| / dst's depth, per hypothesis and point: (K, N) for K hypotheses."""
    moved = scale[:, None, None] * (rotation @ src.T) + translation[:, :, None]  # (K, 3, N)
    diff = dst.T[None] - moved
    return np.sqrt((diff * diff).sum(axis=1)) / dst[None, :, 2]


def fit_similarity(src: np.ndarray, dst: np.ndarray, seed: int = 0) -> tuple:
    """RANSAC + weighted refit of X_dst = s R X_src + t on matched 3D points (N, 3) (dst's z > 0).
    Returns (scale, rotation, translation, inlier mask); scale is NaN when there is no fit."""
    n = len(src)
    none = (math.nan, None, None, np.zeros(n, bool))
    if n < 3:
        return none
    rng = np.random.default_rng(seed)
    triples = rng.integers(0, n, (RANSAC_TRIALS, 3))
    distinct = (triples[:, 0] != triples[:, 1]) & (triples[:, 0] != triples[:, 2]) & (triples[:, 1] != triples[:, 2])
    scale, rotation, translation = umeyama(src[triples[distinct]], dst[triples[distinct]])
    usable = np.isfinite(scale) & (scale > 0)
    if not usable.any():
        return none
    scale, rotation, translation = scale[usable], rotation[usable], translation[usable]
    best = int((_residual(src, dst, scale, rotation, translation) < INLIER_RTOL).sum(axis=1).argmax())
    fit = (scale[best : best + 1], rotation[best : best + 1], translation[best : best + 1])
    residual = _residual(src, dst, *fit)[0]
    inliers = residual < INLIER_RTOL
    for _ in range(4):  # refit on the inliers, with a threshold from their own spread, until they stop changing
        if inliers.sum() < 3:
            break
        weights = 1.0 / np.abs(dst[inliers, 2] * src[inliers, 2])  # 1 / depth^2, alike in both frames
        s, r, t = umeyama(src[inliers], dst[inliers], weights, symmetric=True)
        if not (np.isfinite(s) and s > 0):
            break
        fit = (np.array([s]), r[None], t[None])
        residual = _residual(src, dst, *fit)[0]
        spread = 1.4826 * float(np.median(residual[inliers]))  # a robust standard deviation of the inliers
        again = residual < min(INLIER_RTOL, max(MIN_INLIER_RTOL, INLIER_SIGMAS * spread))
        if np.array_equal(again, inliers):
            break
        inliers = again
    return float(fit[0][0]), fit[1][0], fit[2][0], inliers


def _check(
    src: np.ndarray, dst: np.ndarray, seed: int, least: int = MIN_INLIERS, share: float = MIN_INLIER_RATIO
) -> tuple:
    """(Registration, inlier mask) of the fit of matched points, with the checks applied: at least `least`
    inliers, an inlier share of at least `share` (lower for relocalisation's first guess, which is checked later)."""
    matches = len(src)
    if matches < least:
        reason = f"too few features followed into this frame with a depth ({matches} < {least})"
        return Registration(False, matches=matches, reason=reason), np.zeros(matches, bool)
    scale, rotation, translation, inliers = fit_similarity(src, dst, seed)
    count = int(inliers.sum())
    residual = math.nan
    if count >= 3 and rotation is not None:
        res = _residual(src[inliers], dst[inliers], np.array([scale]), rotation[None], translation[None])[0]
        residual = float(np.sqrt(np.mean(res * res)))
    reg = Registration(True, scale, rotation, translation, matches, count, count / matches, residual)
    if count >= 3 and rotation is not None:
        reg.information = information(dst[inliers], residual)
    if count < least:
        reg.ok, reg.reason = False, f"too few inliers ({count} < {least})"
    elif reg.inlier_ratio < share:
        reg.ok, reg.reason = False, f"inlier share {reg.inlier_ratio:.2f} < {share}"
    elif not SCALE_RANGE[0] <= scale <= SCALE_RANGE[1]:
        reg.ok, reg.reason = False, f"scale change {scale:.3f} outside {SCALE_RANGE}"
    elif not residual <= MAX_RESIDUAL:
        reg.ok, reg.reason = False, f"residual {residual:.4f} of the depth > {MAX_RESIDUAL}"
    return reg, inliers


RETRACK_PIXELS = 2.0  # a feature followed again from the keyframe must land this near its chained track
POSE_PIXELS_MIN = 6  # a pose from image positions: points at least (PnP needs 4; a few more for noise)
POSE_SCALE_RTOL = 0.05  # joint_pose: its scale may differ from its seed's by at most this (else the seed stays)
POSE_MAX_TURN_DEG = 5.0  # joint_pose: only a seed that turns the camera by at most this much (degrees) is refined


PNP_PIXELS = 2.0  # image_fit: a correspondence is an inlier when it reprojects within this (tracking pixels)


def image_fit(
    src: np.ndarray, pixels: np.ndarray, k_pixels: np.ndarray, dst: np.ndarray, small: tuple, shape: tuple
) -> Registration:
    """The fit of a frame against a reference from the image positions alone, a seed for `joint_pose` (`posed`):
    the reference's points `src` (N, 3) followed to `pixels` (N, 2) in this frame (full resolution, centres at
    +0.5), by `cv2.solvePnPRansac` (EPnP hypotheses, inliers within PNP_PIXELS of the tracking image `small`
    (h, w), `shape` the frame's); its scale the median ratio of this frame's own depth (`dst`, NaN where none) to
    the placed points'. Why: where the two frames' depths disagree by more than a 3D fit admits (a real network's
    smooth errors bend each frame its own way, several percent: the stand-in's warp of tests/test_video_long.py),
    the 3D fit finds too few inliers, or passes on a few whose errors agree, with a pose far off; the image
    positions are not bent. Its residual (for the pose graph's information) is the spread of the log depth ratio
    over the inliers with a depth here."""
    import cv2

    matches = len(src)
    if matches < MIN_INLIERS:
        return Registration(False, matches=matches, reason=f"too few features for an image fit ({matches})")
    src, pixels, k = (np.ascontiguousarray(a, np.float64) for a in (src, pixels, k_pixels))
    threshold = PNP_PIXELS * shape[1] / small[1]
    ok, rvec, tvec, index = cv2.solvePnPRansac(
        src, pixels, k, None, iterationsCount=RANSAC_TRIALS * 2, reprojectionError=threshold, flags=cv2.SOLVEPNP_EPNP
    )
    if not ok or index is None or len(index) < MIN_INLIERS:
        return Registration(False, matches=matches, reason="no image fit")
    good = np.zeros(matches, bool)
    good[index.ravel()] = True
    rotation, translation = cv2.Rodrigues(rvec)[0], tvec.ravel()
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.log(dst[good, 2] / (src[good] @ rotation[2] + translation[2]))
    ratio = ratio[np.isfinite(ratio)]
    if len(ratio) < POSE_PIXELS_MIN:
        return Registration(False, matches=matches, reason="too few depths under the image fit's inliers")
    scale = float(np.exp(np.median(ratio)))
    count = int(good.sum())
    residual = 1.4826 * float(np.median(np.abs(ratio - np.median(ratio))))
    reg = Registration(True, scale, rotation, scale * translation, matches, count, count / matches, residual)
    if not SCALE_RANGE[0] <= scale <= SCALE_RANGE[1] or reg.inlier_ratio < MIN_INLIER_RATIO:
        return Registration(False, matches=matches, reason="image fit out of range")
    reg.information = information(scale * src[good] @ rotation.T + reg.translation, residual)
    return reg


JOINT_ROUNDS = 2  # joint_pose: solved, its spreads measured, solved again with them
JOINT_PIXEL_STD, JOINT_DEPTH_STD = 1.0, 0.02  # ... the first solve's spreads (tracking pixels; log depth)
MIN_JOINT_PIXEL_STD, MIN_JOINT_DEPTH_STD = 0.05, 0.001  # ... their floors
JOINT_ITERATIONS = 15  # ... Levenberg-Marquardt steps per solve at most
JOINT_TOLERANCE = 1e-6  # ... until a step lowers the cost by less than this share of it
JOINT_LOSS_SCALE = 3.0  # ... residuals beyond this many spreads weigh less (Cauchy)
SETTLED_PIXELS = 0.5  # posed: a link whose points land within this (median, tracking pixels) of where they were
# followed is not looked for again from an image seed


def joint_pose(
    reg: Registration, src: np.ndarray, pixels: np.ndarray, k_pixels: np.ndarray, dst: np.ndarray, ratio: float = 1.0
) -> Registration:
    """`reg` refined on both what this frame sees of the keyframe's points `src` (N, 3): where they are in the
    image (`pixels` (N, 2), full resolution, centres at +0.5) and how far (`dst` (N, 3), this frame's own points,
    NaN where it has no depth), each weighed by its own spread as the fit finds it (the median absolute residual
    after a first solve, then solved again; `ratio`: full-resolution pixels per tracking pixel, the unit of the
    pixel spreads JOINT_PIXEL_STD and MIN_JOINT_PIXEL_STD).

    Why both: a pose from the image positions alone is loose along what a narrow view leaves loose (a turn and a
    sideways step project alike), and `solvePnP` started from a 3D fit stopped near it there (the refinement
    before this one); a
    pose from the depths alone is moved by their errors. Where the depths are good (per-pixel noise only) their
    spread is small and they hold the pose along the loose directions; where they are bent (a real network's
    smooth errors: the stand-in's warp of tests/test_video_long.py) their spread is large and the image positions
    hold it. A Cauchy loss leaves the few wrong tracks out. The unknowns: a rotation correction on the left, the
    translation and the log scale (this frame's depth / the placed points'), by Levenberg-Marquardt
    (`bundle.levenberg_marquardt`) with an analytic Jacobian. Only a fit that turns by at most POSE_MAX_TURN_DEG
    is refined (wider turns came out worse refined on the image: docs/video.md); one whose scale moves by more than
    POSE_SCALE_RTOL is left as it was."""
    import cv2

    if not reg.ok or reg.rotation is None or len(src) < POSE_PIXELS_MIN:
        return reg
    turn = math.degrees(math.acos(min(1.0, max(-1.0, (float(np.trace(reg.rotation)) - 1.0) / 2.0))))
    if turn > POSE_MAX_TURN_DEG:
        return reg
    src, pixels, k = (np.asarray(a, np.float64) for a in (src, pixels, k_pixels))
    has = np.isfinite(dst).all(axis=1) & (dst[:, 2] > 0)
    log_z = np.log(dst[has, 2])
    base = np.asarray(reg.rotation, np.float64)
    fx, fy = k[0, 0], k[1, 1]
    n, m = len(src), int(has.sum())
    pixel_floor = MIN_JOINT_PIXEL_STD * ratio
    stds = [JOINT_PIXEL_STD * ratio, JOINT_DEPTH_STD]  # full-resolution pixels; log depth

    def placed(x: np.ndarray) -> tuple:
        turned = src @ (cv2.Rodrigues(x[:3])[0] @ base).T
        q = turned + x[3:6]
        return turned, q, np.maximum(q[:, 2], 1e-9)

    def errors(x: np.ndarray) -> tuple:
        _, q, z = placed(x)
        u = np.stack([fx * q[:, 0] / z + k[0, 2], fy * q[:, 1] / z + k[1, 2]], axis=1) - pixels
        return u.ravel(), log_z - x[6] - np.log(z[has])

    def residuals(x: np.ndarray) -> np.ndarray:
        u, d = errors(x)
        return np.concatenate([u / stds[0], d / stds[1]])

    def jacobian(x: np.ndarray) -> np.ndarray:
        turned, q, z = placed(x)
        d_q = np.zeros((n, 3, 3))  # d (u, v, log z) / d q
        d_q[:, 0, 0], d_q[:, 0, 2] = fx / z, -fx * q[:, 0] / z**2
        d_q[:, 1, 1], d_q[:, 1, 2] = fy / z, -fy * q[:, 1] / z**2
        d_q[:, 2, 2] = 1.0 / z
        d_x = np.zeros((n, 3, 7))  # d q / d x: -[R P]x for the rotation, the identity for the translation
        d_x[:, :, :3] = -skew(turned)
        d_x[:, :, 3:6] = np.eye(3)
        full = d_q @ d_x
        pixel = full[:, :2].reshape(-1, 7) / stds[0]
        depth = -full[has, 2] / stds[1]
        depth[:, 6] = -1.0 / stds[1]
        return np.concatenate([pixel, depth])

    x = np.concatenate([np.zeros(3), np.asarray(reg.translation, np.float64) / reg.scale, [math.log(reg.scale)]])
    for _ in range(JOINT_ROUNDS):
        x, _ = levenberg_marquardt(residuals, jacobian, x, 7, JOINT_ITERATIONS, JOINT_LOSS_SCALE, JOINT_TOLERANCE)
        u, d = errors(x)
        stds[0] = max(1.4826 * float(np.median(np.abs(u))), pixel_floor)
        if m:
            stds[1] = max(1.4826 * float(np.median(np.abs(d - np.median(d)))), MIN_JOINT_DEPTH_STD)
    scale = math.exp(x[6])
    if not (np.isfinite(x).all() and abs(scale / reg.scale - 1) <= POSE_SCALE_RTOL):
        return reg
    rotation = cv2.Rodrigues(x[:3])[0] @ base
    return dataclasses.replace(reg, scale=scale, rotation=rotation, translation=scale * x[3:6])


def _reprojections(reg: Registration, src: np.ndarray, pixels: np.ndarray, k_pixels: np.ndarray) -> np.ndarray:
    """(N,) the distances (pixels) between the points `src` placed by the fit and where they were followed (inf
    behind the camera)."""
    q = src @ reg.rotation.T + reg.translation / reg.scale
    k = np.asarray(k_pixels, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.stack([k[0, 0] * q[:, 0] / q[:, 2] + k[0, 2], k[1, 1] * q[:, 1] / q[:, 2] + k[1, 2]], axis=1)
    error = np.linalg.norm(u - pixels, axis=1)
    return np.where(np.isfinite(error) & (q[:, 2] > 0), error, np.inf)


def posed(
    fit: Registration,
    src: np.ndarray,
    pixels: np.ndarray,
    k_pixels: np.ndarray,
    dst: np.ndarray,
    small: tuple,
    shape: tuple,
) -> Registration:
    """The pose of a link between a reference's points `src` (N, 3) and this frame (where they were followed,
    `pixels` (N, 2), full resolution; its own points `dst` (N, 3), NaN where it has no depth), from its 3D fit
    `fit` (it may have failed): `joint_pose` from that fit; where it leaves the points more than SETTLED_PIXELS
    (tracking pixels, `small` the tracking image's (h, w), `shape` the frame's) off where they were followed, or
    there is no 3D fit, `joint_pose` from an image seed (`image_fit`) as well, and of the two the one whose points
    land nearer (median). Why: under smooth depth errors a 3D fit can pass its checks on a few tens of points
    whose errors happen to agree, with a pose 15-30 cm off on the 150-frame walk of tests/test_video_long.py; the
    joint fit keeps its scale near its seed's, so it cannot leave such a seed, and the image's seed is not bent.
    `fit` itself (failed or not) where neither gives a pose."""
    ratio = shape[1] / small[1]  # full-resolution pixels per tracking pixel

    def scored(seed: Registration) -> tuple:  # (the median distance its points land from their tracks, the fit)
        refined = joint_pose(seed, src, pixels, k_pixels, dst, ratio)
        return float(np.median(_reprojections(refined, src, pixels, k_pixels))), refined

    candidates = [scored(fit)] if fit.ok else []
    if not candidates or candidates[0][0] > SETTLED_PIXELS * ratio:
        seed = image_fit(src, pixels, k_pixels, dst, small, shape)
        if seed.ok:
            candidates.append(scored(seed))
    return min(candidates, key=lambda c: c[0])[1] if candidates else fit


@dataclass
class _Kept:
    """What a fit keeps of this frame's features for when it becomes the reference: shrunk-image positions (N, 2),
    points (N, 3) in its camera (its own depth's where `lifted`, else carried there by the fit from the
    reference's), ids."""

    tracks: np.ndarray
    xyz: np.ndarray
    ids: np.ndarray
    lifted: np.ndarray


class _Reference:
    """A frame the registration fits against: its shrunk grey image, its features (shrunk-image positions, their
    consistent 3D points in its camera axes, ids), its geometry at the grey image's size with the offset and
    scale its points were lifted with (`_shrunk`; relocalisation lifts its descriptor keypoints with it), its ORB
    keypoints (kept from its own relocalisation, else found when first needed) and its frame number (the
    Tracker's count: 0 for `start`)."""

    def __init__(self, frame: int, grey: np.ndarray, tracks, xyz, ids, geometry: tuple, keypoints=None, lifted=None):
        self.frame, self.grey, self.tracks, self.xyz, self.ids, self.geometry = frame, grey, tracks, xyz, ids, geometry
        self.lifted = np.ones(len(ids), bool) if lifted is None else lifted  # points of its own depth (not carried)
        self._keypoints: Optional[tuple] = keypoints
        self._thumb: Optional[np.ndarray] = None

    @property
    def thumb(self) -> np.ndarray:
        """The grey image shrunk to _LOOP_THUMB, zero mean and unit norm (loop-closure candidates)."""
        if self._thumb is None:
            import cv2

            small = cv2.resize(self.grey, _LOOP_THUMB, interpolation=cv2.INTER_AREA).astype(np.float64).ravel()
            small -= small.mean()
            self._thumb = small / max(float(np.linalg.norm(small)), 1e-9)
        return self._thumb

    @property
    def keypoints(self) -> tuple:
        if self._keypoints is None:
            self._keypoints = _orb(self.grey)
        return self._keypoints


class Tracker:
    """The reference frame of the registration chain and the features followed from it.

    `start` makes a frame the reference (the first frame of a clip); `register` fits a frame against the
    reference; `advance` makes the registered frame the new reference. Geometry comes in as each frame's depth,
    mask and pixel intrinsics (its own, or the clip's), with `offset` metres added to the depth. Frames are
    numbered in the order they come (`start`'s number, 0 by default, then one per `register`); a Registration
    names the frame it was fitted against (`reference`): the last registered one, or, when the frame could not be
    found there, an older keyframe (`keyframes`: a reference is kept as one when fewer than KEYFRAME_OVERLAP of the
    last keyframe's features are still followed)."""

    def __init__(self, side: int = TRACK_SIDE, points: int = TRACK_POINTS, seed: int = 0):
        self.side, self.points, self.seed = side, points, seed
        self.ref: Optional[_Reference] = None
        self.keyframes: list = []  # older references, searched by descriptors when the last one fails
        self._pending: Optional[tuple] = None  # what `register` found, for `advance`
        self._next_id = 0
        self._frame = -1  # the number of the last frame seen
        self.loops: list = []  # the loop closures of the last keyframe `advance` made (Registrations)
        self._tries = 0  # frames registered against this reference so far (more than 1: failed frames between)
        self._since_loop_search = 0  # frames since loop closures were last looked for

    @property
    def started(self) -> bool:
        return self.ref is not None

    @property
    def grey(self) -> Optional[np.ndarray]:
        """The reference's shrunk grey image."""
        return None if self.ref is None else self.ref.grey

    def _full(self, tracks: np.ndarray, shape: tuple) -> np.ndarray:
        return _full(tracks, self.grey.shape, shape)

    def _fill(self, grey: np.ndarray, tracks: np.ndarray) -> np.ndarray:
        """`tracks` plus new corners of `grey` away from them, up to `self.points` in all."""
        import cv2

        want = self.points - len(tracks)
        if len(tracks) >= _REFILL * self.points:
            return tracks
        # no new corner in a cell of _MIN_DISTANCE pixels that holds a track, nor in the cells around it
        h, w = grey.shape
        cells = np.ones((h // _MIN_DISTANCE + 3, w // _MIN_DISTANCE + 3), bool)
        if len(tracks):
            cx = np.clip(tracks[:, 0] // _MIN_DISTANCE, 0, cells.shape[1] - 3).astype(np.intp)
            cy = np.clip(tracks[:, 1] // _MIN_DISTANCE, 0, cells.shape[0] - 3).astype(np.intp)
            for dy in (0, 1, 2):
                for dx in (0, 1, 2):
                    cells[cy + dy, cx + dx] = False
        free = np.repeat(np.repeat(cells[1:-1, 1:-1], _MIN_DISTANCE, 0), _MIN_DISTANCE, 1)[:h, :w]
        free = np.ascontiguousarray(np.pad(free, ((0, max(0, h - free.shape[0])), (0, max(0, w - free.shape[1])))))
        corners = cv2.goodFeaturesToTrack(grey, want, 0.01, _MIN_DISTANCE, mask=free.astype(np.uint8), blockSize=5)
        if corners is None:
            return tracks
        return np.concatenate([tracks, corners.reshape(-1, 2).astype(np.float32)])

    def start(
        self, rgb: np.ndarray, depth: np.ndarray, mask: np.ndarray, k_pixels: np.ndarray, offset=0.0, scale=1.0, frame=0
    ):
        """Make this frame the reference (numbered `frame`: 0 for a clip's first; a new chain's first frame keeps
        its number in the clip), the first of a new chain: no keyframe of an earlier one is searched. Its points
        are its depth's x `scale` (the clip's scale)."""
        grey = shrink_grey(rgb, self.side)
        tracks = self._fill(grey, np.zeros((0, 2), np.float32))
        xyz = lift(_full(tracks, grey.shape, depth.shape), depth, mask, k_pixels, offset) * scale
        keep = np.isfinite(xyz).all(axis=1)
        geometry = (*_shrunk(grey.shape, depth, mask, k_pixels), offset, scale)
        self._frame, self._pending, self._tries = frame, None, 0
        self.ref = _Reference(frame, grey, tracks[keep], xyz[keep], self._new_ids(len(tracks))[keep], geometry)
        self.keyframes = [self.ref]

    def _new_ids(self, count: int) -> np.ndarray:
        self._next_id += count
        return np.arange(self._next_id - count, self._next_id)

    def features(self, shape: tuple) -> tuple:
        """(ids (N,), full-resolution pixel positions (N, 2), centres at +0.5) of the reference's features, for a
        frame of `shape` (H, W): a feature keeps its id while it is followed, so the positions of one id in
        successive references are one track (the calibration's focal search reads them, calibrate.py)."""
        return self.ref.ids, self._full(self.ref.tracks, shape)

    def register(
        self, rgb: np.ndarray, depth: np.ndarray, mask: np.ndarray, k_pixels: np.ndarray, offset=0.0, frame=None
    ):
        """The fit of this frame (its depth as the model gave it, + offset) against the reference, else (the
        frame was not found there) against the keyframe that finds it. `frame`: its number, where frames this
        tracker did not see came between (they count as failed frames: a jump); default the next."""
        grey = shrink_grey(rgb, self.side)
        if grey.shape != self.grey.shape:
            raise ValueError(f"frame of {grey.shape[::-1]} (shrunk) against a reference of {self.grey.shape[::-1]}")
        gap = 1 if frame is None else frame - self._frame
        if gap < 1:
            raise ValueError(f"frame {frame} registered after frame {self._frame}: frames come in order")
        self._pending = None
        self._frame += gap
        self._tries += gap
        ref = self.ref
        if len(ref.tracks) == 0:
            return Registration(False, reason="the reference frame has no feature with a depth")
        frame = (grey, depth, mask, k_pixels, offset)
        reg, kept = self._follow(ref, frame)
        checked = self._confirmed(ref, dataclasses.replace(reg), frame) if reg.ok else reg
        keypoints = None  # this frame's ORB keypoints, where they were found: kept for when it is a reference
        if checked.ok and self._tries == 1:
            reg = self._against_keyframe(checked, kept, frame)
        else:  # lost, a jump (failed frames between), or a fit the two frames do not confirm: candidates compared
            reg, kept, keypoints = self._relocalised(ref, frame, reg, checked, kept)
            if not reg.ok:
                return reg
        self._pending = (grey, kept, depth.shape, depth, mask, k_pixels, offset, keypoints)
        return reg

    def _against_keyframe(self, reg: Registration, kept: "_Kept", frame: tuple) -> Registration:
        """The fit of this frame against the last keyframe instead of the reference, on the features followed from
        the one to the other, where it passes the checks: the scale and the pose then chain from keyframe to
        keyframe, not from frame to frame, and the few links of a long clip drift less than its many (each fit's
        error is about the same whatever the frames between).

        The features are followed again from the keyframe's image into this frame (Lucas-Kanade from where the
        frame-to-frame tracks put them): a track chained through every frame drifts as a random walk (0.17 px
        after one frame of the 200x150 loop of tests/test_video_long.py, 0.64 px after 19, some by 7 px), one
        measured against the keyframe does not. `kept` is updated with these positions (and their depth here),
        so the next frame starts from them. The pose is then solved on the image positions and the depths (`posed`)."""
        import cv2

        keyframe = self.keyframes[-1] if self.keyframes else None
        if keyframe is None or keyframe is self.ref:
            return reg
        grey, depth, mask, k_pixels, offset = frame
        common, here, there = np.intersect1d(kept.ids, keyframe.ids, assume_unique=True, return_indices=True)
        if len(common) < MIN_INLIERS:
            return reg
        start = keyframe.tracks[there].reshape(-1, 1, 2)
        guess = kept.tracks[here].astype(np.float32).reshape(-1, 1, 2).copy()
        moved, status, _ = cv2.calcOpticalFlowPyrLK(
            keyframe.grey, grey, start, guess, flags=cv2.OPTFLOW_USE_INITIAL_FLOW, **_LK
        )
        moved = moved.reshape(-1, 2)
        # the two trackings agree (else the feature is dropped: one of them slipped)
        agree = (status.ravel() == 1) & (np.linalg.norm(moved - kept.tracks[here], axis=1) <= RETRACK_PIXELS)
        xyz = lift(self._full(moved, depth.shape), depth, mask, k_pixels, offset)
        lifted = agree & np.isfinite(xyz).all(axis=1)
        mine = keyframe.lifted[there] & agree  # its own points, not those carried there by a fit
        both = mine & lifted
        src = keyframe.xyz[there]
        pixels = self._full(moved[mine], depth.shape)
        seed, _ = _check(src[mine & both], xyz[mine & both], self.seed)
        fit = posed(seed, src[mine], pixels, k_pixels, xyz[mine], grey.shape, depth.shape)
        if not fit.ok:
            return reg
        fit = dense_scale(keyframe.geometry, (depth, mask, k_pixels, offset), fit)
        if not self._confirmed(keyframe, dataclasses.replace(fit), frame).ok:
            return reg
        fit.reference, fit.correlation, fit.matches = keyframe.frame, reg.correlation, reg.matches
        # the kept features at their positions against the keyframe: with this frame's depth there, else carried
        xyz[~lifted] = fit.scale * src[~lifted] @ fit.rotation.T + fit.translation
        drop = np.zeros(len(kept.ids), bool)
        drop[here[~agree]] = True
        kept.tracks[here], kept.xyz[here], kept.lifted[here] = moved, xyz, lifted
        for name in ("tracks", "xyz", "ids", "lifted"):
            setattr(kept, name, getattr(kept, name)[~drop])
        return fit

    def _relocalised(self, ref: _Reference, frame: tuple, reg: Registration, checked: Registration, kept) -> tuple:
        """A frame the tracks could not follow, one after failed frames (a jump), or one whose tracks' fit the
        two frames seen through it do not confirm (`checked`: `reg` through `_confirmed`): the tracks can lock onto
        a repeated pattern and pass the fit's own checks. The fits that the frames confirm among the tracks' own,
        `_relocalise` against the reference and against the keyframes with the most descriptor matches; the one
        whose grey levels agree best. A scene with a symmetric pattern (a checkered floor turned by 90 degrees
        looks the same) can confirm a wrong fit against one frame while another frame, which saw more of the
        scene, confirms the right one better. A tracks' fit with no failed frame between (steady) that passed its
        own checks stays, unconfirmed, when no fit is confirmed: so that a scene whose depth or grey levels agree
        less than the bars loses no frame it registered before the check."""
        candidates = []  # (confirmed, Registration, kept)
        if reg.ok and (checked.ok or self._tries == 1):
            candidates.append((checked.ok, checked if checked.ok else reg, kept))
        keypoints = _orb(frame[0])
        own = self._relocalise(ref, frame, keypoints)
        candidates += [(True, *own)] if own[0].ok else []
        for older, matches in self._ranked_keyframes(keypoints):
            found = self._relocalise(older, frame, keypoints, matches)
            candidates += [(True, *found)] if found[0].ok else []
        if not candidates:  # the tracks' fit failed (its reason says why), or was refused by _confirmed
            checked.reason = f"{checked.reason}; not relocalised either: {own[0].reason}"
            return checked, None, keypoints
        _, reg, kept = max(candidates, key=lambda c: (c[0], c[1].correlation))
        return reg, kept, keypoints

    def _follow(self, ref: _Reference, frame: tuple, guess: Optional[np.ndarray] = None) -> tuple:
        """(Registration, (positions, points, ids) of its inliers) from `ref`'s tracks followed into `frame` (grey,
        depth, mask, k_pixels, offset) by pyramidal Lucas-Kanade, from where they were or from `guess` (their
        predicted positions)."""
        import cv2

        grey, depth, mask, k_pixels, offset = frame
        start = ref.tracks.reshape(-1, 1, 2)
        if guess is None:
            moved, status, _ = cv2.calcOpticalFlowPyrLK(ref.grey, grey, start, None, **_LK)
        else:
            moved = guess.astype(np.float32).reshape(-1, 1, 2).copy()
            flags = cv2.OPTFLOW_USE_INITIAL_FLOW
            moved, status, _ = cv2.calcOpticalFlowPyrLK(ref.grey, grey, start, moved, flags=flags, **_LK)
        moved = moved.reshape(-1, 2)
        h, w = grey.shape
        ok = (status.ravel() == 1) & (moved[:, 0] >= 0) & (moved[:, 0] <= w - 1)
        ok &= (moved[:, 1] >= 0) & (moved[:, 1] <= h - 1)
        xyz = np.full((len(moved), 3), np.nan)
        xyz[ok] = lift(self._full(moved[ok], depth.shape), depth, mask, k_pixels, offset)
        idx = np.flatnonzero(ok)
        moved, xyz, src, ids = moved[idx], xyz[idx], ref.xyz[idx], ref.ids[idx]
        lifted = np.isfinite(xyz).all(axis=1)
        reg, inliers = _check(src[lifted], xyz[lifted], self.seed)
        reg.reference = ref.frame
        seed = ~lifted
        seed[lifted] = inliers
        good = None
        if (
            guess is None
        ):  # followed: posed (a relocalised fit, from a descriptor guess across a jump, keeps its 3D pose)
            pixels = self._full(moved, depth.shape)
            fit = posed(reg, src, pixels, k_pixels, xyz, grey.shape, depth.shape)
            if fit.ok and fit is not reg:
                error = _reprojections(fit, src, pixels, k_pixels)
                if not reg.ok:  # the image's pose: the depths this frame keeps for its points are those it places
                    placed = fit.scale * src[lifted] @ fit.rotation.T + fit.translation
                    inliers = np.linalg.norm(placed - xyz[lifted], axis=1) / xyz[lifted, 2] <= 2 * INLIER_RTOL
                    seed = ~lifted
                    seed[lifted] = inliers
                good = error <= 3.0 * 1.4826 * float(np.median(error[seed])) + 1e-6
                reg = dataclasses.replace(fit, reference=ref.frame)
        good = seed if good is None else good  # not refined: the 3D fit's inliers and the tracks without a depth
        lifted[lifted] = inliers  # a depth the 3D fit refused is not this point's (noise, a smooth error)
        # tracks followed without a (usable) depth here go on with their point carried by the fit: a feature is
        # not lost to one frame's depth, so keyframes last as long as their features stay in view
        carried = good & ~lifted
        if reg.rotation is not None and carried.any():
            xyz[carried] = reg.scale * src[carried] @ reg.rotation.T + reg.translation
        else:
            good = good & lifted
        return reg, _Kept(moved[good], xyz[good], ids[good], lifted[good])

    @staticmethod
    def _matches(ref: _Reference, keypoints: tuple) -> list:
        """The frame's ORB keypoints matched to `ref`'s (brute force, Lowe's ratio test): (frame index, ref index)."""
        import cv2

        (ref_xy, ref_desc), (xy, desc) = ref.keypoints, keypoints
        if len(ref_xy) < 2 or len(xy) < 2:
            return []
        pairs = cv2.BFMatcher(cv2.NORM_HAMMING).knnMatch(desc, ref_desc, k=2)
        return [
            (p[0].queryIdx, p[0].trainIdx) for p in pairs if len(p) == 2 and p[0].distance < ORB_RATIO * p[1].distance
        ]

    def _relocalise(self, ref: _Reference, frame: tuple, keypoints: tuple, matches: Optional[list] = None) -> tuple:
        """`_follow` from where a fit of ORB descriptor matches (Lowe's ratio test) puts `ref`'s tracks:
        descriptors find a feature anywhere in the frame, not only near where it was. A repeated pattern (tiles,
        windows) can make a consistent set of wrong matches, so the fit must pass three checks: its own, the
        tracks followed from its prediction (sub-pixel, the usual checks), and `ref`'s depth seen through
        the fit agreeing with this frame's, in depth and in grey levels (`_agreement`)."""
        grey, depth, mask, k_pixels, offset = frame
        matches = self._matches(ref, keypoints) if matches is None else matches
        if not matches:
            return Registration(False, reason="no ORB keypoints to match", reference=ref.frame), None
        here = keypoints[0][[m[0] for m in matches]].reshape(-1, 2)
        there = ref.keypoints[0][[m[1] for m in matches]].reshape(-1, 2)
        ref_depth, ref_mask, ref_k, ref_offset, ref_scale = ref.geometry
        # a first guess only (checked by the tracks after it): a keypoint without a plane under its 4x4 pixels (a
        # corner on an edge, per-pixel noise) takes its pixel's depth, else few were left at 2 % noise (9 of 72)
        src = _lift_or_nearest(there + 0.5, ref_depth, ref_mask, ref_k, ref_offset) * ref_scale  # shrunk pixels
        dst = _lift_or_nearest(self._full(here, depth.shape), depth, mask, k_pixels, offset)
        ok = np.isfinite(src).all(axis=1) & np.isfinite(dst).all(axis=1)
        coarse, _ = _check(src[ok], dst[ok], self.seed, GUESS_INLIERS, GUESS_INLIER_RATIO)
        coarse.reference = ref.frame
        if not coarse.ok:
            coarse.reason = f"descriptor matches: {coarse.reason}"
            return coarse, None
        moved = coarse.scale * ref.xyz @ coarse.rotation.T + coarse.translation  # the tracks, this frame's camera
        pixels = moved @ np.asarray(k_pixels, np.float64).T
        with np.errstate(divide="ignore", invalid="ignore"):
            pixels = pixels[:, :2] / pixels[:, 2:3]
        sy, sx = depth.shape[0] / grey.shape[0], depth.shape[1] / grey.shape[1]
        guess = np.stack([pixels[:, 0] / sx - 0.5, pixels[:, 1] / sy - 0.5], axis=1)
        guess = np.where(np.isfinite(guess) & (moved[:, 2:3] > 0), guess, ref.tracks)
        reg, kept = self._follow(ref, frame, guess)
        reg.relocalised = True
        if not reg.ok:
            reg.reason = f"tracks from the descriptor matches' fit: {reg.reason}"
            return reg, None
        reg = self._confirmed(ref, reg, frame)
        return reg, kept if reg.ok else None

    def _loop_closures(self, frame: tuple) -> list:
        """Fits of the new keyframe (the reference now, its `frame` data) against older keyframes, LOOP_GAP frames
        back at least and sharing no followed feature with it: the LOOP_TRIES whose thumbnails correlate best with
        it, found as relocalisation finds a frame (descriptors, then the tracks, the fit's checks and the two
        frames' confirmation, `_relocalise`). A camera that comes back to where it was is seen again by a keyframe
        of then: each fit is an edge of the pose graph that closes the loop (posegraph.py)."""
        # a keyframe that still shares followed features with this frame is joined to it by the chain already:
        # only one that does not, but looks alike, closes a loop (else the nearest old keyframes crowd it out)
        older = [
            k
            for k in self.keyframes
            if k.frame <= self.ref.frame - LOOP_GAP and not np.isin(k.ids, self.ref.ids, assume_unique=True).any()
        ]
        if not older:
            return []
        thumb = self.ref.thumb
        scores = np.array([float(k.thumb @ thumb) for k in older])
        order = [i for i in np.argsort(-scores)[:LOOP_TRIES] if scores[i] >= LOOP_THUMB_CORRELATION]
        found = []
        for i in order:
            keypoints = self.ref.keypoints  # found once, kept with the keyframe
            matches = self._matches(older[i], keypoints)
            if len(matches) < GUESS_INLIERS:
                continue
            reg, _ = self._relocalise(older[i], frame, keypoints, matches)
            if reg.ok:
                found.append(reg)
        return found

    def _ranked_keyframes(self, keypoints: tuple) -> list:
        """[(keyframe, its descriptor matches)] of the keyframes other than the reference with at least
        GUESS_INLIERS matches, the KEYFRAME_TRIES with the most (the later first among equals)."""
        ranked = []
        for ref in self.keyframes:
            if ref is not self.ref:
                matches = self._matches(ref, keypoints)
                if len(matches) >= GUESS_INLIERS:
                    ranked.append((len(matches), ref.frame, ref, matches))
        ranked.sort(key=lambda r: r[:2], reverse=True)
        return [(ref, matches) for _, _, ref, matches in ranked[:KEYFRAME_TRIES]]

    def _confirmed(self, ref: _Reference, reg: Registration, frame: tuple) -> Registration:
        """`reg`, failed unless the two frames seen through it agree (`_agreement`; its grey levels' correlation
        kept in `reg.correlation`): a repeated pattern (tiles, windows) can give a consistent set of wrong matches
        that pass the fit's own checks."""
        grey, depth, mask, k_pixels, offset = frame
        share, correlation = _agreement((*ref.geometry, ref.grey), (depth, mask, k_pixels, offset, grey), reg)
        reg.correlation = correlation
        if share < MIN_AGREEMENT or correlation < MIN_CORRELATION:
            reg.ok = False
            reg.reason = (
                f"the frames seen through the fit disagree: depth agrees on {share:.2f} of the view (at least "
                f"{MIN_AGREEMENT}), grey levels correlate {correlation:.2f} (at least {MIN_CORRELATION})"
            )
        return reg

    def counters(self) -> tuple:
        """What `register` changes (the last frame seen, the frames since the reference, the fit waiting for
        `advance`): `rewind` puts them back, so that a frame run through the model again is registered again."""
        return self._frame, self._tries, self._pending

    def rewind(self, counters: tuple) -> None:
        self._frame, self._tries, self._pending = counters

    def advance(self, correction: float) -> None:
        """After a good `register`: that frame becomes the reference, its points x `correction` (1 / the fit's
        scale: consistent with the clip), its inlier tracks kept and new corners added; and a keyframe, when
        fewer than KEYFRAME_OVERLAP of the last keyframe's features are among its own."""
        grey, kept, shape, depth, mask, k_pixels, offset, keypoints = self._pending
        self._pending = None
        count = len(kept.tracks)
        tracks = self._fill(grey, kept.tracks.astype(np.float32))
        new_xyz = lift(self._full(tracks[count:], shape), depth, mask, k_pixels, offset)
        xyz = np.concatenate([kept.xyz, new_xyz]) * correction
        ids = np.concatenate([kept.ids, self._new_ids(len(tracks) - count)])
        lifted = np.concatenate([kept.lifted, np.ones(len(tracks) - count, bool)])
        keep = np.isfinite(xyz).all(axis=1)
        geometry = (*_shrunk(grey.shape, depth, mask, k_pixels), offset, correction)
        self.ref = _Reference(
            self._frame, grey, tracks[keep], xyz[keep], ids[keep], geometry, keypoints, lifted=lifted[keep]
        )
        self._tries = 0
        last = self.keyframes[-1].ids
        self.loops = []
        keyframe = len(last) == 0 or np.isin(last, self.ref.ids).sum() < KEYFRAME_OVERLAP * len(last)
        self._since_loop_search += 1
        if keyframe or self._since_loop_search >= LOOP_EVERY:  # a frame that closes a loop is made a keyframe
            self._since_loop_search = 0
            self.loops = self._loop_closures((grey, depth, mask, k_pixels, offset))
            keyframe = keyframe or bool(self.loops)
        if keyframe:
            self.keyframes.append(self.ref)
            if len(self.keyframes) > MAX_KEYFRAMES:  # thinned out over the whole clip: every other one goes
                del self.keyframes[1:-1:2]

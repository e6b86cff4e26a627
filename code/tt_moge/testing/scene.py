"""A small analytic 3D scene, ray cast with exact ground truth: the demo image and the geometry oracle.

`media/source.png` is `render(1920, 1080).image`. The same call gives the exact depth, camera-space points,
normals and validity (sky = invalid) at every pixel centre, for any camera, so host geometry (camera solve,
canvas fit, finish) can be tested against the truth rather than against another implementation.

Camera: OpenCV axes (x right, y down, z forward), pinhole, pixel (j, i) centred at (j + 0.5, i + 0.5).
Scene: a checkered ground 1.6 m below the camera, spheres, a box, a far building with windows, and sky.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["SceneRender", "render", "intrinsics_for", "DEMO_FOV_X_DEG"]

DEMO_FOV_X_DEG = 70.0
GROUND_Y = 1.6  # metres below the camera (y points down)
FAR = 120.0  # the ground ends here; beyond is sky
SPHERES = [  # centre (x, y, z) metres, radius, albedo
    ((-1.6, 0.8, 6.0), 0.8, (0.80, 0.22, 0.18)),
    ((1.1, 1.0, 4.4), 0.6, (0.20, 0.35, 0.85)),
    ((3.6, 0.2, 11.0), 1.4, (0.25, 0.70, 0.30)),
    ((-4.5, -0.6, 16.0), 2.2, (0.90, 0.75, 0.20)),
]
BOX = ((0.4, -1.4, 8.0), (2.4, GROUND_Y, 9.6), (0.62, 0.60, 0.58))  # min corner, max corner, albedo
BUILDING = (-22.0, 6.0, -7.0, 30.0)  # x from, x to, top y, front z: a facade on the plane z = 30
LIGHT = np.array([-0.45, -0.8, -0.4]) / np.linalg.norm([-0.45, -0.8, -0.4])  # direction towards the light


@dataclass
class SceneRender:
    """image (H, W, 3) uint8; depth (H, W) float64 metres (inf = sky); points (H, W, 3) camera space;
    normal (H, W, 3) unit, facing the camera (0 on sky); mask (H, W) bool (False = sky); intrinsics (3, 3) pixels;
    surface (H, W) int: which smooth surface each pixel sees (-1 sky), for telling edges from interiors."""

    image: np.ndarray
    depth: np.ndarray
    points: np.ndarray
    normal: np.ndarray
    mask: np.ndarray
    intrinsics: np.ndarray
    surface: np.ndarray


def intrinsics_for(width: int, height: int, fov_x_deg: float = DEMO_FOV_X_DEG, pixel_aspect: float = 1.0) -> np.ndarray:
    """Pixel intrinsics with the principal point at the image centre; fy = fx / pixel_aspect."""
    fx = (width / 2) / math.tan(math.radians(fov_x_deg) / 2)
    return np.array([[fx, 0.0, width / 2], [0.0, fx / pixel_aspect, height / 2], [0.0, 0.0, 1.0]])


def _hit_plane_y(d: np.ndarray, y: float) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        t = y / d[..., 1]
    t[(d[..., 1] <= 0) | (t * d[..., 2] > FAR)] = np.inf
    return t


def _hit_sphere(d: np.ndarray, centre, radius) -> np.ndarray:
    c = np.asarray(centre)
    b = d @ c
    dd = (d * d).sum(-1)
    disc = b * b - dd * (c @ c - radius * radius)
    with np.errstate(invalid="ignore"):
        t = (b - np.sqrt(disc)) / dd
    t[(disc < 0) | (t <= 0)] = np.inf
    return t


def _hit_box(d: np.ndarray, lo, hi) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = np.asarray(lo), np.asarray(hi)
    with np.errstate(divide="ignore", invalid="ignore"):
        t1, t2 = lo / d, hi / d
    t_near = np.minimum(t1, t2).max(-1)
    t_far = np.maximum(t1, t2).min(-1)
    axis = np.minimum(t1, t2).argmax(-1)
    t = np.where((t_near <= t_far) & (t_near > 0), t_near, np.inf)
    return t, axis


def _hit_building(d: np.ndarray) -> np.ndarray:
    x0, x1, top, z = BUILDING
    t = z / d[..., 2]
    p = d * t[..., None]
    inside = (p[..., 0] >= x0) & (p[..., 0] <= x1) & (p[..., 1] >= top) & (p[..., 1] <= GROUND_Y)
    return np.where(inside, t, np.inf)


def render(width: int = 1920, height: int = 1080, intrinsics: Optional[np.ndarray] = None) -> SceneRender:
    """Ray cast the scene for a pinhole camera (default: DEMO_FOV_X_DEG horizontal field of view)."""
    k = intrinsics_for(width, height) if intrinsics is None else np.asarray(intrinsics, dtype=np.float64)
    u = (np.arange(width) + 0.5 - k[0, 2]) / k[0, 0]
    v = (np.arange(height) + 0.5 - k[1, 2]) / k[1, 1]
    d = np.stack(np.broadcast_arrays(u[None, :], v[:, None], np.ones((height, width))), axis=-1)  # z = 1 rays

    candidates = [_hit_plane_y(d, GROUND_Y), _hit_building(d)]
    candidates += [_hit_sphere(d, c, r) for c, r, _ in SPHERES]
    t_box, box_axis = _hit_box(d, BOX[0], BOX[1])
    candidates.append(t_box)
    stack = np.stack(candidates)
    which = stack.argmin(0)
    t = stack.min(0)
    mask = np.isfinite(t)
    depth = np.where(mask, t, np.inf)  # rays have z = 1, so t is the depth
    points = np.where(mask[..., None], d * np.where(mask, t, 0.0)[..., None], 0.0)

    normal = np.zeros_like(d)
    albedo = np.zeros_like(d)
    ground = which == 0
    normal[ground] = (0.0, -1.0, 0.0)
    checker = (np.floor(points[..., 0]) + np.floor(points[..., 2])) % 2
    albedo[ground] = np.where(checker[ground, None] > 0, (0.55, 0.50, 0.42), (0.30, 0.27, 0.22))
    building = which == 1
    normal[building] = (0.0, 0.0, -1.0)
    windows = (np.floor(points[..., 0] * 0.8) % 2 == 0) & (np.floor(points[..., 1] * 0.7) % 2 == 1)
    albedo[building] = np.where(windows[building, None], (0.25, 0.32, 0.40), (0.70, 0.55, 0.45))
    for i, (centre, radius, colour) in enumerate(SPHERES):
        hit = which == 2 + i
        normal[hit] = (points[hit] - np.asarray(centre)) / radius
        stripes = 0.85 + 0.15 * np.sin(points[hit][:, 1] * 9.0)
        albedo[hit] = np.asarray(colour) * stripes[:, None]
    box = which == 2 + len(SPHERES)
    axis = box_axis[box]
    n = np.zeros((box.sum(), 3))
    n[np.arange(len(axis)), axis] = -np.sign(d[box][np.arange(len(axis)), axis])
    normal[box] = n
    albedo[box] = BOX[2]
    normal[~mask] = 0.0
    surface = np.where(mask, which, -1)
    surface[box] = which[box] + 1 + axis  # each face of the box is its own smooth surface

    shade = 0.25 + 0.75 * np.clip(normal @ LIGHT, 0.0, None)
    colour = albedo * shade[..., None]
    fog = 1.0 - np.exp(-np.where(mask, depth, 0.0) / 90.0)  # aerial perspective: far things fade to haze
    haze = np.array([0.72, 0.78, 0.85])
    colour = colour * (1 - fog[..., None]) + haze * fog[..., None]
    sky_t = np.clip(0.5 - v / 1.2, 0.0, 1.0)[:, None, None] * np.ones((1, width, 1))
    sky = (1 - sky_t) * haze + sky_t * np.array([0.30, 0.50, 0.85])
    sky += 0.04 * (np.sin(u[None, :] * 7.0 + 2.0 * np.sin(v[:, None] * 5.0)) * (v[:, None] < 0))[..., None]
    colour = np.where(mask[..., None], colour, sky)
    image = np.rint(np.clip(colour, 0.0, 1.0) * 255.0).astype(np.uint8)
    return SceneRender(image=image, depth=depth, points=points, normal=normal, mask=mask, intrinsics=k, surface=surface)

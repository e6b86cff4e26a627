"""A small analytic 3D scene, ray cast with exact ground truth: the demo image and the geometry oracle.

`media/source.png` is `render(1920, 1080).image`. The same call gives the exact depth, camera-space points,
normals and validity (sky = invalid) at every pixel centre, for any camera, so host geometry (camera solve,
canvas fit, finish) can be tested against the truth rather than against another implementation.

Camera: OpenCV axes (x right, y down, z forward), pinhole, pixel (j, i) centred at (j + 0.5, i + 0.5). A camera
may also move (`render(..., pose=...)`): `camera_path` is a walk through the scene with exact camera-to-world
poses, `render_path` its frames with their exact depth, the ground truth of the video path (tt_moge.video).
Scene: a checkered ground 1.6 m below the camera, spheres, a box, a far building with windows, and sky.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = [
    "SceneRender",
    "render",
    "intrinsics_for",
    "camera_path",
    "loop_path",
    "pan_path",
    "render_path",
    "compact",
    "DEMO_FOV_X_DEG",
]

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
    surface (H, W) int: which smooth surface each pixel sees (-1 sky), for telling edges from interiors.
    `compact` renders keep only the image, depth (float32), mask and intrinsics (the others None)."""

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


def _hit_plane_y(o: np.ndarray, d: np.ndarray, y: float) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (y - o[1]) / d[..., 1]
    t[~(t > 0) | (o[2] + t * d[..., 2] > FAR)] = np.inf
    return t


def _hit_sphere(o: np.ndarray, d: np.ndarray, centre, radius) -> np.ndarray:
    c = np.asarray(centre) - o
    b = d @ c
    dd = (d * d).sum(-1)
    disc = b * b - dd * (c @ c - radius * radius)
    with np.errstate(invalid="ignore"):
        t = (b - np.sqrt(disc)) / dd
    t[(disc < 0) | (t <= 0)] = np.inf
    return t


def _hit_box(o: np.ndarray, d: np.ndarray, lo, hi) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = np.asarray(lo) - o, np.asarray(hi) - o
    with np.errstate(divide="ignore", invalid="ignore"):
        t1, t2 = lo / d, hi / d
    t_near = np.minimum(t1, t2).max(-1)
    t_far = np.maximum(t1, t2).min(-1)
    axis = np.minimum(t1, t2).argmax(-1)
    t = np.where((t_near <= t_far) & (t_near > 0), t_near, np.inf)
    return t, axis


def _hit_building(o: np.ndarray, d: np.ndarray) -> np.ndarray:
    x0, x1, top, z = BUILDING
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (z - o[2]) / d[..., 2]
    p = o + d * t[..., None]
    inside = (t > 0) & (p[..., 0] >= x0) & (p[..., 0] <= x1) & (p[..., 1] >= top) & (p[..., 1] <= GROUND_Y)
    return np.where(inside, t, np.inf)


def render(
    width: int = 1920, height: int = 1080, intrinsics: Optional[np.ndarray] = None, pose: Optional[np.ndarray] = None
) -> SceneRender:
    """Ray cast the scene for a pinhole camera (default: DEMO_FOV_X_DEG horizontal field of view).

    `pose`: the camera-to-world (4, 4) rigid transform, the world being the camera of the default pose (the demo
    image's); depth, points and normals are in the camera's own axes."""
    k = intrinsics_for(width, height) if intrinsics is None else np.asarray(intrinsics, dtype=np.float64)
    u = (np.arange(width) + 0.5 - k[0, 2]) / k[0, 0]
    v = (np.arange(height) + 0.5 - k[1, 2]) / k[1, 1]
    d = np.stack(np.broadcast_arrays(u[None, :], v[:, None], np.ones((height, width))), axis=-1)  # z = 1 rays
    rotation, origin = np.eye(3), np.zeros(3)
    if pose is not None:
        pose = np.asarray(pose, dtype=np.float64)
        rotation, origin = pose[:3, :3], pose[:3, 3]
    world = d if pose is None else d @ rotation.T  # world directions; |d| and so the ray parameter t are kept
    with np.errstate(divide="ignore", invalid="ignore"):
        sky_u, sky_v = (
            (u[None, :], v[:, None]) if pose is None else (world[..., 0] / world[..., 2], world[..., 1] / world[..., 2])
        )

    candidates = [_hit_plane_y(origin, world, GROUND_Y), _hit_building(origin, world)]
    candidates += [_hit_sphere(origin, world, c, r) for c, r, _ in SPHERES]
    t_box, box_axis = _hit_box(origin, world, BOX[0], BOX[1])
    candidates.append(t_box)
    stack = np.stack(candidates)
    which = stack.argmin(0)
    t = stack.min(0)
    mask = np.isfinite(t)
    depth = np.where(mask, t, np.inf)  # rays have z = 1 in the camera, so t is the depth
    points = np.where(mask[..., None], d * np.where(mask, t, 0.0)[..., None], 0.0)  # camera axes
    world_points = (
        points if pose is None else origin + np.where(mask[..., None], world * np.where(mask, t, 0.0)[..., None], 0.0)
    )

    normal = np.zeros_like(d)
    albedo = np.zeros_like(d)
    ground = which == 0
    normal[ground] = (0.0, -1.0, 0.0)
    checker = (np.floor(world_points[..., 0]) + np.floor(world_points[..., 2])) % 2
    albedo[ground] = np.where(checker[ground, None] > 0, (0.55, 0.50, 0.42), (0.30, 0.27, 0.22))
    building = which == 1
    normal[building] = (0.0, 0.0, -1.0)
    windows = (np.floor(world_points[..., 0] * 0.8) % 2 == 0) & (np.floor(world_points[..., 1] * 0.7) % 2 == 1)
    albedo[building] = np.where(windows[building, None], (0.25, 0.32, 0.40), (0.70, 0.55, 0.45))
    for i, (centre, radius, colour) in enumerate(SPHERES):
        hit = which == 2 + i
        normal[hit] = (world_points[hit] - np.asarray(centre)) / radius
        stripes = 0.85 + 0.15 * np.sin(world_points[hit][:, 1] * 9.0)
        albedo[hit] = np.asarray(colour) * stripes[:, None]
    box = which == 2 + len(SPHERES)
    axis = box_axis[box]
    n = np.zeros((box.sum(), 3))
    n[np.arange(len(axis)), axis] = -np.sign(world[box][np.arange(len(axis)), axis])
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
    sky_t = np.clip(0.5 - sky_v / 1.2, 0.0, 1.0)[..., None] * np.ones((height, width, 1))
    sky = (1 - sky_t) * haze + sky_t * np.array([0.30, 0.50, 0.85])
    sky += 0.04 * (np.sin(sky_u * 7.0 + 2.0 * np.sin(sky_v * 5.0)) * (sky_v < 0))[..., None]
    colour = np.where(mask[..., None], colour, sky)
    image = np.rint(np.clip(colour, 0.0, 1.0) * 255.0).astype(np.uint8)
    if pose is not None:
        normal = normal @ rotation  # world -> camera axes (rotation^T n, row-wise)
    return SceneRender(image=image, depth=depth, points=points, normal=normal, mask=mask, intrinsics=k, surface=surface)


def _rotation(yaw: float, pitch: float, roll: float) -> np.ndarray:
    """Camera-to-world rotation (radians): yaw about y (down), then pitch about x, then roll about z."""
    cy, sy, cp, sp, cr, sr = np.cos(yaw), np.sin(yaw), np.cos(pitch), np.sin(pitch), np.cos(roll), np.sin(roll)
    ry = np.array([[cy, 0.0, sy], [0.0, 1.0, 0.0], [-sy, 0.0, cy]])
    rx = np.array([[1.0, 0.0, 0.0], [0.0, cp, -sp], [0.0, sp, cp]])
    rz = np.array([[cr, -sr, 0.0], [sr, cr, 0.0], [0.0, 0.0, 1.0]])
    return ry @ rx @ rz


def camera_path(frames: int, length: float = 2.4, yaw_deg: float = 12.0, turn: bool = True) -> np.ndarray:
    """(frames, 4, 4) camera-to-world poses (metres) of a walk into the scene: `length` metres forward along z,
    swaying 0.4 m sideways and 0.1 m up and down, panning up to `yaw_deg` degrees, tilting up to 3 degrees and
    rolling up to 1.5 degrees. The first pose is the identity (the demo camera); every frame sees the scene.
    `turn=False`: the same positions without any rotation (a pure translation, which does not fix the focal)."""
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    poses = np.zeros((frames, 4, 4))
    for i, s in enumerate(np.linspace(0.0, 1.0, frames)):
        yaw = math.radians(yaw_deg) * math.sin(1.5 * math.pi * s)
        pitch = math.radians(3.0) * math.sin(math.pi * s)
        roll = math.radians(1.5) * math.sin(2 * math.pi * s)
        poses[i, :3, :3] = _rotation(yaw, pitch, roll) if turn else np.eye(3)
        poses[i, :3, 3] = (0.4 * math.sin(2 * math.pi * s), -0.1 * math.sin(math.pi * s), length * s)
        poses[i, 3, 3] = 1.0
    return poses


def loop_path(frames: int, radius: float = 1.5, yaw_deg: float = 20.0) -> np.ndarray:
    """(frames, 4, 4) camera-to-world poses (metres) of a walk once round a circle of `radius` metres in front of
    the demo camera, back to where it started: the position goes (r sin a, 0.05 sin 3a, r (1 - cos a)) for a from
    0 to 2 pi (the last frame one step short of the first), the camera faces the scene (+z) turning with the
    path by up to `yaw_deg` degrees (yaw_deg sin a) and tilting by up to 2 degrees; the first pose is the
    identity. The path is 2 pi radius long: a loop whose end a drifting trajectory misses."""
    if frames < 2:
        raise ValueError(f"frames must be >= 2, got {frames}")
    poses = np.tile(np.eye(4), (frames, 1, 1))
    for i, a in enumerate(np.linspace(0.0, 2 * math.pi, frames, endpoint=False)):
        poses[i, :3, :3] = _rotation(math.radians(yaw_deg) * math.sin(a), math.radians(2.0) * math.sin(2 * a), 0.0)
        poses[i, :3, 3] = (radius * math.sin(a), 0.05 * math.sin(3 * a), radius * (1 - math.cos(a)))
    return poses


def pan_path(yaws_deg, forward: float = 0.05) -> np.ndarray:
    """(len(yaws_deg), 4, 4) camera-to-world poses (metres) of a camera panning through `yaws_deg` (degrees about
    the vertical, positive to the right) while it creeps `forward` metres a frame along z; the first pose is at
    the origin."""
    poses = np.tile(np.eye(4), (len(yaws_deg), 1, 1))
    for i, yaw in enumerate(yaws_deg):
        poses[i, :3, :3] = _rotation(math.radians(yaw), 0.0, 0.0)
        poses[i, 2, 3] = forward * i
    return poses


def render_path(
    poses: np.ndarray, width: int, height: int, intrinsics: Optional[np.ndarray] = None
) -> list[SceneRender]:
    """One render per camera-to-world pose of `poses` (N, 4, 4), all with the same intrinsics."""
    return [render(width, height, intrinsics, pose) for pose in poses]


def compact(frame: SceneRender) -> SceneRender:
    """The render as the video stand-in needs it, in about a tenth of the memory: the image, the depth as float32
    (inf on the sky), the mask and the intrinsics; points, normals and surfaces dropped (None). For clips of
    hundreds of frames (`testing.video.VideoOracle` lifts the points from the depth and has no normal then)."""
    return SceneRender(
        image=frame.image,
        depth=frame.depth.astype(np.float32),
        points=None,
        normal=None,
        mask=frame.mask,
        intrinsics=frame.intrinsics,
        surface=None,
    )

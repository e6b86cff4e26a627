"""Equirectangular geometry: pixel <-> direction, the 12 perspective views, and the split of a panorama into them.

Axes (the same as a photo's camera space, so that every export treats both alike): x right, y down, z forward,
where "forward" is the direction of the panorama's centre pixel column on the horizon. A pixel (j, i) of a W x H
panorama has its centre at longitude lon = 2 pi ((j + 0.5) / W - 0.5) (0 at the centre column, growing to the
right, +-pi at the left/right seam) and latitude lat = pi (0.5 - (i + 0.5) / H) (+pi/2 at the top row's edge);
its unit direction is (cos lat sin lon, -sin lat, cos lat cos lon).

The views are the 12 pinhole cameras that upstream MoGe uses (`moge.utils.panorama.get_panorama_cameras`): one
looking at each vertex of a regular icosahedron, 90 degrees field of view both ways, rolled so that the world's
"up" projects to the view's "up". Their order is upstream's, so view i here is view i there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "VIEW_FOV_DEG",
    "VIEW_SIZE",
    "ViewCamera",
    "view_cameras",
    "panorama_directions",
    "directions_to_pixels",
    "split_panorama",
    "check_panorama_size",
    "ASPECT_TOLERANCE",
]

VIEW_FOV_DEG = 90.0  # both ways, as upstream
VIEW_SIZE = 512  # pixels per side of a view, as upstream
_GOLDEN = (1.0 + math.sqrt(5.0)) / 2.0
# The icosahedron's vertices in a z-up world frame (upstream's), in upstream's order.
_ICOSAHEDRON_Z_UP = np.array(
    [
        [0, 1, _GOLDEN],
        [0, -1, _GOLDEN],
        [0, 1, -_GOLDEN],
        [0, -1, -_GOLDEN],
        [1, _GOLDEN, 0],
        [-1, _GOLDEN, 0],
        [1, -_GOLDEN, 0],
        [-1, -_GOLDEN, 0],
        [_GOLDEN, 0, 1],
        [_GOLDEN, 0, -1],
        [-_GOLDEN, 0, 1],
        [-_GOLDEN, 0, -1],
    ],
    dtype=np.float64,
)
# z-up world (x towards the panorama's centre column reversed, y right, z up) -> our axes: x' = y, y' = -z, z' = -x.
_Z_UP_TO_OURS = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, -1.0], [-1.0, 0.0, 0.0]])
_DOWN = np.array([0.0, 1.0, 0.0])


@dataclass(frozen=True)
class ViewCamera:
    """One perspective view: `rotation` (3, 3) maps panorama directions to view camera axes (rows: the view's
    right, down and forward in panorama axes); a square pinhole of `fov_deg` both ways."""

    rotation: np.ndarray
    fov_deg: float = VIEW_FOV_DEG

    @property
    def forward(self) -> np.ndarray:
        return self.rotation[2]

    def focal(self, size: int) -> float:
        """The focal length in pixels of a `size` x `size` view."""
        return (size / 2.0) / math.tan(math.radians(self.fov_deg) / 2.0)


def view_cameras() -> list:
    """The 12 views (see the module docstring)."""
    cameras = []
    for vertex in _ICOSAHEDRON_Z_UP @ _Z_UP_TO_OURS.T:
        forward = vertex / np.linalg.norm(vertex)
        right = np.cross(_DOWN, forward)
        right /= np.linalg.norm(right)
        down = np.cross(forward, right)
        cameras.append(ViewCamera(np.stack([right, down, forward])))
    return cameras


def panorama_directions(width: int, height: int, dtype=np.float64) -> np.ndarray:
    """(H, W, 3) unit directions of the pixel centres of a W x H panorama (module docstring)."""
    lon = (2.0 * np.pi) * ((np.arange(width, dtype=np.float64) + 0.5) / width - 0.5)
    lat = np.pi * (0.5 - (np.arange(height, dtype=np.float64) + 0.5) / height)
    cos_lat = np.cos(lat)[:, None]
    out = np.empty((height, width, 3), dtype=dtype)
    out[..., 0] = cos_lat * np.sin(lon)[None, :]
    out[..., 1] = -np.sin(lat)[:, None]
    out[..., 2] = cos_lat * np.cos(lon)[None, :]
    return out


def directions_to_pixels(directions: np.ndarray, width: int, height: int) -> np.ndarray:
    """(..., 3) directions (any length) -> (..., 2) float pixel coordinates (x, y) in a W x H panorama, integer
    at pixel centres: x in [-0.5, W - 0.5), y in [-0.5, H - 0.5]."""
    x, y, z = directions[..., 0], directions[..., 1], directions[..., 2]
    lon = np.arctan2(x, z)  # (-pi, pi]
    lat = np.arctan2(-y, np.hypot(x, z))
    px = (lon / (2.0 * np.pi) + 0.5) * width - 0.5
    px = np.where(px >= width - 0.5, px - width, px)  # lon = pi is the left edge
    py = (0.5 - lat / np.pi) * height - 0.5
    return np.stack([px, py], axis=-1)


ASPECT_TOLERANCE = 0.01  # a panorama's width / height may be off 2 by this share (a pixel or two of cropping)


def check_panorama_size(width: int, height: int, name: str = "image") -> None:
    """A panorama is equirectangular, 360 by 180 degrees: twice as wide as high (within ASPECT_TOLERANCE) and at
    least 16 x 8 pixels. Otherwise a ValueError (InputError) naming the argument."""
    from ..host.decode import InputError

    if abs(width / height - 2.0) > 2.0 * ASPECT_TOLERANCE:
        raise InputError(
            f"{name}: a panorama must be an equirectangular image twice as wide as high (360 x 180 "
            f"degrees, width / height = 2 within {ASPECT_TOLERANCE:.0%}), got {width}x{height} "
            f"(width / height = {width / height:.3f})"
        )
    if height < 8:
        raise InputError(f"{name}: a panorama must be at least 16x8 pixels, got {width}x{height}")


def _view_rays(camera: ViewCamera, size: int) -> np.ndarray:
    """(size, size, 3) directions in panorama axes of the pixel centres of a view."""
    f = camera.focal(size)
    t = (np.arange(size, dtype=np.float64) + 0.5 - size / 2.0) / f
    rays = np.stack(np.broadcast_arrays(t[None, :], t[:, None], np.ones((size, size))), axis=-1)
    return rays @ camera.rotation  # camera -> panorama axes (rotation is orthonormal)


def _wrap_pad(image: np.ndarray) -> np.ndarray:
    """One more column on each side taken from the other side (the seam), one more row on top and bottom
    repeated (the poles): bilinear samples near the seam or a pole then read real pixels, not a border."""
    padded = np.concatenate([image[:, -1:], image, image[:, :1]], axis=1)
    return np.concatenate([padded[:1], padded, padded[-1:]], axis=0)


def split_panorama(image: np.ndarray, cameras=None, size: int = VIEW_SIZE) -> list:
    """The perspective views of an equirectangular (H, 2H, C) image: [(size, size, C)] bilinear samples, one
    per camera (default `view_cameras()`), the same dtype as the image. Samples across the left/right seam wrap
    around; samples beyond the top or bottom row take that row."""
    import cv2

    height, width = image.shape[:2]
    cameras = view_cameras() if cameras is None else cameras
    padded = _wrap_pad(np.ascontiguousarray(image))
    views = []
    for camera in cameras:
        pixels = directions_to_pixels(_view_rays(camera, size), width, height) + 1.0  # +1: the padding
        pixels = pixels.astype(np.float32)
        views.append(
            cv2.remap(padded, pixels[..., 0], pixels[..., 1], cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
        )
    return views

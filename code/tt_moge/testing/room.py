"""A room of planes seen from inside, ray cast with exact ground truth: the geometry oracle of the panorama path.

A box-shaped room (four walls, floor, ceiling; axis-aligned in the panorama axes of `tt_moge.panorama`: x right,
y down, z forward) around a viewpoint at the origin that is off the room's centre, so that every wall has its
own distance. Every surface is textured (checkers of a different size and colour per plane, plus shading by
the angle of view), so that an image model sees structure everywhere.

`render_panorama(width, height)` gives the equirectangular picture and the exact distance per pixel centre;
`render_view(camera, size)` the exact distance map of one perspective view (what a perfect model would
predict for that view), and `plane_of` which plane each direction hits. `recording_upstream_lsmr()` records
the least squares that upstream's panorama merge hands to `lsmr` (its equations, to score merges on).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

__all__ = ["ROOM_PLANES", "RoomRender", "recording_upstream_lsmr", "room_distance", "render_panorama", "render_view"]

# (axis, offset, colour A, colour B, checker size m): the plane {p[axis] = offset} in metres from the viewpoint.
ROOM_PLANES = (
    (0, -2.6, (0.80, 0.55, 0.45), (0.55, 0.35, 0.30), 0.50),  # left wall
    (0, 3.4, (0.45, 0.65, 0.80), (0.25, 0.40, 0.60), 0.40),  # right wall
    (1, 1.5, (0.60, 0.55, 0.45), (0.35, 0.30, 0.25), 0.60),  # floor (y down)
    (1, -1.1, (0.90, 0.90, 0.85), (0.70, 0.70, 0.65), 0.80),  # ceiling
    (2, 4.2, (0.50, 0.75, 0.45), (0.30, 0.50, 0.25), 0.45),  # front wall
    (2, -3.1, (0.85, 0.75, 0.40), (0.60, 0.50, 0.20), 0.35),  # back wall
)


@dataclass
class RoomRender:
    """image (H, W, 3) uint8, distance (H, W) float64 metres, plane (H, W) int (index into ROOM_PLANES),
    points (H, W, 3) metres in panorama axes."""

    image: np.ndarray
    distance: np.ndarray
    plane: np.ndarray
    points: np.ndarray


def room_distance(directions: np.ndarray) -> tuple:
    """(..., 3) unit directions -> (distance (...), plane index (...)) of the first plane each ray hits."""
    best = np.full(directions.shape[:-1], np.inf)
    which = np.full(directions.shape[:-1], -1)
    for k, (axis, offset, *_) in enumerate(ROOM_PLANES):
        with np.errstate(divide="ignore", invalid="ignore"):
            t = offset / directions[..., axis]
        hit = (t > 0) & (t < best)
        best = np.where(hit, t, best)
        which = np.where(hit, k, which)
    return best, which


def _shade(directions: np.ndarray, distance: np.ndarray, plane: np.ndarray) -> np.ndarray:
    points = directions * distance[..., None]
    colour = np.zeros(directions.shape)
    for k, (axis, _, a, b, cell) in enumerate(ROOM_PLANES):
        on = plane == k
        u, v = [points[..., i] for i in range(3) if i != axis]
        checker = (np.floor(u / cell) + np.floor(v / cell)) % 2
        base = np.where(checker[..., None] > 0, np.asarray(a), np.asarray(b))
        light = 0.55 + 0.45 * np.abs(directions[..., axis])  # brighter where the wall faces the viewer
        colour[on] = (base * light[..., None])[on]
    return np.rint(np.clip(colour, 0, 1) * 255).astype(np.uint8)


def render_panorama(width: int = 1024, height: int = 512) -> RoomRender:
    """The equirectangular picture of the room and its exact geometry at every pixel centre."""
    from ..panorama.geometry import panorama_directions

    directions = panorama_directions(width, height)
    distance, plane = room_distance(directions)
    return RoomRender(_shade(directions, distance, plane), distance, plane, directions * distance[..., None])


def render_view(camera, size: int) -> np.ndarray:
    """The exact distance map (size, size) float64 of one perspective view (a `ViewCamera`) of the room."""
    f = camera.focal(size)
    t = (np.arange(size, dtype=np.float64) + 0.5 - size / 2.0) / f
    rays = np.stack(np.broadcast_arrays(t[None, :], t[:, None], np.ones((size, size))), axis=-1) @ camera.rotation
    rays /= np.linalg.norm(rays, axis=-1, keepdims=True)
    return room_distance(rays)[0]


class RoomOracle:
    """A stand-in for MoGeModel in panorama tests: `predict_many(views, ...)` answers the 12 views of
    `tt_moge.panorama.view_cameras()` (in that order, whatever their pixels) with the room's exact geometry, as a
    perfect model would: points = view rays x distance (view camera axes), mask all valid except where
    `hole(view index, distance map)` says. `scales[i]` multiplies view i's distances (a model's per-view
    metric error); `fail` is a set of view indices whose call raises."""

    def __init__(self, scales=None, hole=None, fail=()):
        self.scales, self.hole, self.fail = scales, hole, set(fail)
        self.calls = 0

    def _one(self, index: int, size: int):
        from types import SimpleNamespace

        from ..panorama.geometry import view_cameras

        camera = view_cameras()[index]
        if index in self.fail:
            raise RuntimeError(f"view {index}: the device said no")
        distance = render_view(camera, size) * (1.0 if self.scales is None else self.scales[index])
        t = (np.arange(size) + 0.5 - size / 2.0) / camera.focal(size)
        rays = np.stack(np.broadcast_arrays(t[None, :], t[:, None], np.ones((size, size))), axis=-1)
        rays /= np.linalg.norm(rays, axis=-1, keepdims=True)
        mask = np.ones((size, size), bool) if self.hole is None else ~self.hole(index, distance)
        return SimpleNamespace(points=(rays * distance[..., None]).astype(np.float32), mask=mask)

    def predict_many(self, images, **options):
        self.calls += 1
        self._next = 0  # a failing batch is retried view by view through predict(), in order
        return [self._one(i, np.asarray(img).shape[0]) for i, img in enumerate(images)]

    def predict(self, image, **options):
        index, self._next = self._next, self._next + 1
        return self._one(index, np.asarray(image).shape[0])

    def predict_panorama(self, image, **options):
        from ..panorama import predict_panorama

        return predict_panorama(self, image, **options)


@contextmanager
def recording_upstream_lsmr():
    """Within the block, upstream's `moge.utils.panorama.lsmr` (what its `merge_panorama_depth` solves with)
    also records its last call's A and b, as given, in the dict it yields ("a", "b"); costs nothing more.
    Upstream's own `lsmr` is put back on leaving, also on an error."""
    import moge.utils.panorama as upstream

    real, seen = upstream.lsmr, {}

    def recording_lsmr(a, b, **options):
        seen["a"], seen["b"] = a, b
        return real(a, b, **options)

    upstream.lsmr = recording_lsmr
    try:
        yield seen
    finally:
        upstream.lsmr = real

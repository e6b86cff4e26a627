"""The focal from tracked motion (`tt_moge.video.selfcal`) on exact synthetic tracks: points in front of a camera
that moves, projected with a known focal, so the answer is known to the last digit. Where the camera turns, the
focal comes back from a start 7 % off; where it only translates, or there is nothing to read, the start is kept
and the reason says why."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tt_moge.video.selfcal import FocalFit, TrackPair, focal_from_tracks, track_pairs

SIZE, FOCAL = (640, 480), 520.0


def _rotation(yaw: float, pitch: float) -> np.ndarray:
    cy, sy, cp, sp = math.cos(yaw), math.sin(yaw), math.cos(pitch), math.sin(pitch)
    return np.array([[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]]) @ np.array([[1, 0, 0], [0, cp, -sp], [0, sp, cp]])


def _features(turn: bool, noise: float = 0.0, frames: int = 8, seed: int = 0) -> tuple:
    """({frame: (ids, pixels, depth)}, K): 400 world points seen by a camera walking forward and sideways, turning
    2 degrees per frame (or not); pixel noise of `noise` pixels."""
    rng = np.random.default_rng(seed)
    k = np.array([[FOCAL, 0, SIZE[0] / 2], [0, FOCAL, SIZE[1] / 2], [0, 0, 1.0]])
    world = np.column_stack([rng.uniform(-4, 4, 400), rng.uniform(-3, 3, 400), rng.uniform(4, 12, 400)])
    features = {}
    for i in range(frames):
        r = _rotation(math.radians(2.0 * i), math.radians(0.5 * i)) if turn else np.eye(3)
        position = np.array([0.05 * i, 0.01 * i, 0.1 * i])
        camera = (world - position) @ r  # world -> camera: R^T (X - c)
        pixels = camera[:, :2] / camera[:, 2:3] * FOCAL + k[:2, 2] + noise * rng.standard_normal((400, 2))
        inside = (camera[:, 2] > 0.5) & (pixels >= 0).all(axis=1) & (pixels < SIZE).all(axis=1)
        features[i] = (np.flatnonzero(inside), pixels[inside], camera[inside, 2])
    return features, k


def _fit(features: dict, k: np.ndarray, start: float) -> FocalFit:
    pairs = track_pairs(features)
    return focal_from_tracks(pairs, k, lambda focal: [p.depth for p in pairs], start)


@pytest.mark.parametrize("noise,tolerance", [(0.0, 1e-3), (0.3, 3e-3)])  # exact: the parabola steps of 2 %
def test_a_turning_camera_fixes_the_focal(noise, tolerance):
    features, k = _features(turn=True, noise=noise)
    fit = _fit(features, k, FOCAL * 1.07)
    assert fit.source == "geometry" and fit.reason is None
    assert fit.focal / FOCAL == pytest.approx(1.0, abs=tolerance)
    assert fit.median == pytest.approx(FOCAL * 1.07) and fit.uncertainty <= 0.01 and fit.curvature > 0


def test_a_camera_that_only_translates_keeps_the_start():
    features, k = _features(turn=False, noise=0.1)
    fit = _fit(features, k, FOCAL * 1.07)
    assert fit.source == "median" and fit.focal == FOCAL * 1.07 and math.isnan(fit.geometry)
    assert "does not fix the focal" in fit.reason and "translates" in fit.reason
    assert fit.record()["source"] == "median" and fit.record()["geometry_fx"] is None


def test_nothing_to_read_keeps_the_start():
    k = np.array([[FOCAL, 0, 320], [0, FOCAL, 240], [0, 0, 1.0]])
    fit = focal_from_tracks([], k, lambda focal: [], FOCAL)
    assert fit.source == "median" and fit.focal == FOCAL and "no registered pair" in fit.reason
    features, _ = _features(turn=True)
    pairs = track_pairs(features)
    fit = focal_from_tracks(pairs, k, lambda focal: [np.full_like(p.depth, np.nan) for p in pairs], FOCAL)
    assert fit.source == "median" and "no registered pair" in fit.reason


def test_track_pairs_follow_ids_over_the_gaps():
    features = {
        0: (np.array([1, 2, 3] + list(range(10, 20))), np.zeros((13, 2)), np.ones(13)),
        1: (np.array([2, 3] + list(range(10, 20))), np.ones((12, 2)), np.ones(12)),
        3: (np.array(list(range(12, 20))), np.full((8, 2), 3.0), np.ones(8)),  # frame 2 failed to register
    }
    pairs = track_pairs(features, gaps=(1, 2, 3))
    assert [(p.reference, p.current, len(p.depth)) for p in pairs] == [(0, 1, 12), (1, 3, 8), (0, 3, 8)]
    assert all(isinstance(p, TrackPair) for p in pairs)
    first = pairs[0]
    assert (first.reference_pixels == 0).all() and (first.current_pixels == 1).all()

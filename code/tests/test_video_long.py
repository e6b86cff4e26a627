"""Long clips against exact truth (issue 45): a 150-frame walk through the analytic scene and a 1000-frame loop
that comes back to its start, answered by the stand-in model (`testing.video.VideoOracle`) with the errors of a
real network: a metric scale off by up to +-5 % per frame, 2 % noise along each ray, 3 % of the frame in holes,
and (where named) spatially correlated errors, a smooth warp of each frame's depth by a few percent.

Bounds (fixed by the issue before any figure was seen): over the walk, the spread of each frame's depth / true
depth within 1 %, its drift from the first frame to the last within 1 %, the trajectory within 1 % of its length
(ATE after a similarity alignment); with exact answers, ATE within 0.5 %; over the loop, its end within 1 % of
the path from its start, ATE within 1 % and memory that does not grow with the clip. The chained scale of the
registration links alone (no global step) drifts at least 5 times less than it did before the links were made
unbiased (the figure of the code before them is written down in the test).

Frames are rendered once per module, small (320x240 for the walk, 200x150 for the loop) and compact
(`tt_moge.scene.compact`: image, depth, mask), so that the module stays within its share of the CI time. At
240x180 the noisy walk's drift is 1.7 % (features and depth too coarse); at 160x120 the loop loses frames. The
loop runs here with per-pixel errors only; with the correlated ones it is `python -m perf.video.video_bench --part
long --warp 0.03` (a second 1000-frame run would double the module's time). The walk under correlated errors is
asked of five draws of the stand-in's errors and is not met on all of them (an expected failure, strict: it shows
when it is).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tt_moge.scene import camera_path, compact, loop_path, render
from tt_moge.testing.video import (
    VideoOracle,
    depth_ratio,
    path_length,
    real_errors,
    walk_figures,
)
from tt_moge.testing.video import trajectory_error as ate
from tt_moge.video import iter_video, predict_video
from tt_moge.video.registration import Tracker

WALK_FRAMES, WALK_SIZE = 150, (320, 240)
LOOP_FRAMES, LOOP_SIZE = 1000, (200, 150)  # at 160x120 too few corners are followed (frames lost before and after)
CLOUD_BYTES = 64  # a voxel's sums in the fused cloud: its key, 3 + 3 float64 sums and a count (fusion.py)
WARP = 0.03  # the correlated errors: a smooth field with a standard deviation of 3 % of the depth


@pytest.fixture(scope="module")
def walk():
    poses = camera_path(WALK_FRAMES)
    return poses, [compact(render(*WALK_SIZE, pose=pose)) for pose in poses]


@pytest.fixture(scope="module")
def loop():
    poses = loop_path(LOOP_FRAMES)
    return poses, [compact(render(*LOOP_SIZE, pose=pose)) for pose in poses]


def check_walk(clip, poses, renders) -> dict:
    """The walk's figures (`walk_figures`), all frames registered."""
    assert len(clip) == len(renders) and clip.registered.all(), clip.failures
    # the applied scale is what the frames carry (not a figure of the result alone)
    np.testing.assert_allclose(clip.scale, [f.metric_scale for f in clip.frames], rtol=1e-6)
    return walk_figures(clip, poses, renders)


def test_the_links_alone_drift_five_times_less(walk):
    """The registration's links alone (each frame fitted against its reference, the scale chained through the
    fits as ClipChain does, no global step), on the noisy walk with the true intrinsics: the chained scale's
    drift from the first frame to the last. Before the links were made unbiased it was 10.2 % (the code of
    2eaf7cb: 0.994 -> 1.095, every link's scale low by about 6e-4); the bound is a fifth of that."""
    poses, renders = walk
    model = real_errors(renders)
    k = renders[0].intrinsics
    outs = model.predict_many([r.image for r in renders], intrinsics=k)
    tracker = Tracker()
    first = outs[0]
    tracker.start(renders[0].image, first.depth, first.mask, first.intrinsics_pixels, frame=0)
    chained = [1.0]
    for i in range(1, len(renders)):
        out = outs[i]
        reg = tracker.register(renders[i].image, out.depth, out.mask, out.intrinsics_pixels, frame=i)
        assert reg.ok, (i, reg.reason)
        chained.append(1.0 / reg.scale)
        tracker.advance(chained[-1])
    ratio = np.array([c * depth_ratio(o, t) for c, o, t in zip(chained, outs, renders)])
    model_drift = abs(depth_ratio(outs[-1], renders[-1]) / depth_ratio(outs[0], renders[0]) - 1)
    assert model_drift > 0.005  # the frames' own scales differ: the chain has something to undo
    drift = abs(ratio[-1] / ratio[0] - 1)
    assert drift <= 0.102 / 5, (drift, ratio[[0, -1]])


def test_a_long_walk_keeps_one_scale_and_its_path(walk):
    """150 frames, +-5 % scale, 2 % noise, 3 % holes: spread <= 1 %, first-to-last drift <= 1 %, ATE <= 1 %."""
    poses, renders = walk
    clip = predict_video(real_errors(renders), [r.image for r in renders])
    figures = check_walk(clip, poses, renders)
    assert figures["spread"] <= 0.01 and figures["drift"] <= 0.01 and figures["ate"] <= 0.01, figures


def test_a_long_walk_with_exact_answers_is_on_the_true_path(walk):
    """150 frames of the stand-in's exact geometry (the true metric scale, no noise): ATE <= 0.5 %."""
    poses, renders = walk
    clip = predict_video(VideoOracle(renders), [r.image for r in renders])
    figures = check_walk(clip, poses, renders)
    assert figures["ate"] <= 0.005, figures


WARP_SEEDS = 5  # the warped walk is asked of this many draws of the stand-in's errors, not only the first


@pytest.mark.xfail(
    strict=True,
    reason="not met on every draw (2026-12-07, AMX Xeon, perf.video.video_bench --part walk --draws 5): spread / "
    "drift / ATE 1.05 / 0.35 / 1.01 % on the first draw, over the five 0.70-1.19 / 0.15-1.60 / 0.84-1.40 % "
    "(docs/video.md)",
)
def test_a_long_walk_holds_under_correlated_errors(walk):
    """The walk's errors plus a smooth warp of each frame's depth (3 %): the same bounds, on each of WARP_SEEDS
    draws of the stand-in's errors (its scale errors, noise, holes and warps): the first draw met them at one point
    of the third pass and the others did not all, so one draw is not the proof."""
    poses, renders = walk
    for draw in range(WARP_SEEDS):
        clip = predict_video(real_errors(renders, draw, warp=WARP), [r.image for r in renders])
        figures = check_walk(clip, poses, renders)
        assert figures["spread"] <= 0.01 and figures["drift"] <= 0.01 and figures["ate"] <= 0.01, (draw, figures)


def resident_mb() -> float:
    """The process's resident memory (MB), from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory read from /proc")
def test_a_thousand_frame_loop_closes(loop):
    """1000 frames once round a 9.4 m loop back to the start, streamed (iter_video keeps no frame), with the
    walk's per-pixel errors: after the global step the end is within 1 % of the path from the start, ATE <= 1 %,
    and memory does not grow with the clip beyond what is bounded without it: the resident memory, read every 25
    frames from frame 250 on and after the result, stays within CLOUD_BYTES of the fused cloud's (its voxels and
    at most fusion.MERGE_EVERY pending sums, twice: a merge copies them) plus 4 kB a frame (its record and a few
    numbers) and 8 MB of the allocator's slack of its value at frame 250. One frame's maps at 200x150 are about
    0.6 MB: a clip that kept them would grow by 450 MB over the frames measured. (Resident memory rather than
    tracemalloc, which doubled the run's 26 s.)"""
    from tt_moge.video.fusion import MERGE_EVERY

    poses, renders = loop
    model = real_errors(renders, has_normal=False)
    stream = iter_video(model, (r.image for r in renders))
    early, late = None, 0.0
    for frame in stream:
        if frame.index == 250:
            early = resident_mb()
        elif frame.index > 250 and frame.index % 25 == 0:
            late = max(late, resident_mb())
    clip = stream.result
    late = max(late, resident_mb())
    assert len(clip) == LOOP_FRAMES and clip.registered.all(), [f for f in clip.failures if f][:3]
    length = clip.path_length
    assert 0.5 * path_length(poses) < length < 2 * path_length(poses)  # a path, at about the true scale
    closure = np.linalg.norm(clip.poses[-1, :3, 3] - clip.poses[0, :3, 3]) / length
    error = ate(clip.poses, poses)
    assert closure <= 0.01 and error <= 0.01, (closure, error)
    cloud_mb = 2 * CLOUD_BYTES * (len(clip.cloud_points) + MERGE_EVERY) / 1e6
    allowance = cloud_mb + 4e-3 * (LOOP_FRAMES - 250) + 8.0
    assert early is not None and late <= early + allowance, (early, late, allowance)

"""The video path's cost: the host work it adds per frame (registration, consistency, fusion), and frames/s of a
whole clip beside plain `predict_many` on the same frames.

1. host: the analytic walk (`tt_moge.scene.camera_path`) rendered at --size (1920x1080 by default), its
   frames' outputs made by the stand-in model (`tt_moge.testing.video.VideoOracle`, the camera given, so no
   time goes to a network), then `video.predict.ClipChain.step` on each frame, timed alone: what the video
   path adds to every frame on top of the model's own call (`tt_moge.video.registration`: shrink to 640 px,
   KLT, lift, RANSAC; the scale applied to depth and points; the voxel cloud). Alternated, frame by frame, with
   the model's own host post-processing of the same frame (`host.postprocess`: solve + finish at that size),
   for scale. Wall and CPU milliseconds (of the process, OpenCV's and the native library's threads included;
   nothing else runs in it meanwhile), median over the frames (the first, which only starts the chain, left
   out), with the split into register / scale / fuse (wall).
2. calibration: what the calibration pass costs once per clip (per `window`), on --calibration-frames frames of
   the walk at --size with the stand-in's per-frame focal errors (uniform +-10 %): `calibrate.calibrate` timed
   whole, less the model's `predict_many` (timed inside it), with the focal search from the tracked motion
   (`selfcal.focal_from_tracks`: the part added by the self-calibration, with the second registration pass of
   the calibration frames that it triggers when the geometry's focal is used) timed alone; the focal found
   against the truth. It runs only on the calibration frames; part 1 is unchanged by it.
3. clip: a random-weight checkpoint (tiny-vits-normal) on the CPU over --clip-frames frames of the walk at
   --clip-size: `model.predict_many(frames)` against `model.predict_video(frames)` (its calibration frames
   forwarded once, finished twice), the same through `testing.video.PredictOnly` (the model seen with
   `predict_many` only: its calibration frames run through it twice, as before the forwards were kept; the same
   arrays) and `predict_video(frames, intrinsics=K)`, calls alternated --repeats times; frames/s (wall) and frames
   per CPU second of the process (which moves less with other jobs' load on a shared machine) and their ratios.
   On the CPU the forward dominates; on a Tenstorrent chip or a GPU the host work of part 1 is what must stay
   below the device's time per frame.

4. relocalise: what one registration costs when the tracks are lost (`registration.Tracker.register`, timed
   alone on a fresh reference each time, exact depth at --size, median of --repeats x 4): the next frame of the
   walk (the tracks follow it), a textureless frame (the tracks and then the descriptor search fail), the frame
   12 on after one failed frame (the tracks' fit refused or failed, the frame found again by descriptors), and a
   camera back where it was (a pan right to 40 degrees in 8-degree steps, a failed frame, then 30 degrees left:
   nothing of the last frame's view; the fits against the last frame and the keyframes compared).

5. gaps (not in "both"): the walk (24 frames at --size) through the stand-in model with the tests' errors (metric
   scale +-15 %, focal +-10 %, shifts, noise, holes), with runs of textureless frames of several lengths: the share
   of the frames after each run that register, which are relocalised, and the largest camera position error
   against the truth over the registered frames (after a similarity alignment): a wrong registration would show
   there. New chains are off here (`new_chain_after=0`): a frame that is not found stays flagged.

6. cuts (not in "both"): the clip part's model over --clip-frames frames at --clip-size: half the walk, then a cut
   to the pan (in inverted grey levels) through a 50 degree lens. `predict_video` with `calibrate_chains` (each
   chain calibrated on its own frames: the frames from the new chain's first run again) against without, calls
   alternated --repeats times: frames/s, frames per CPU second, the images that went through the network and
   where the chains start.

7. long (not in "both"): the host work per frame of a long clip, the global step included, and its memory:
   --long-frames frames (default 1000) once round the loop (`tt_moge.scene.loop_path`, back to its start), each
   rendered when asked at --long-render (320x180) and enlarged to --size (the host work sees frames of --size; the
   scene's detail is the small render's; no clip is held), through the stand-in with the errors of
   tests/test_video_long.py (metric scale +-5 %, 2 % ray noise, 3 % holes; --warp 0.03 adds the correlated ones,
   the loop that the tests leave to this bench), `ClipChain.step` on each frame timed alone: wall and CPU
   milliseconds per frame, the median and the mean (the mean carries the pose graph's solves at each keyframe and
   the loop-closure searches every 10 frames), then `ClipChain.output` (the final solve over every node) per frame
   of the clip; the keyframes, loop closures, ATE and end-to-start distance against the truth, and the process's
   resident memory every 50 frames (its growth after the first quarter: what the clip adds).

8. walk (not in "both"): the 150-frame walk of tests/test_video_long.py at 320x240 through `predict_video`, with
   the stand-in's exact answers, with issue 45's errors of a real network (`testing.video.real_errors`) and with
   those plus the 3 % smooth warp, the last two on --draws draws of the errors (0: the tests' own): the spread and
   first-to-last drift of depth / truth and the ATE as a share of the path, per draw and their largest.

    python -m perf.video.video_bench                        # all four parts, defaults
    python -m perf.video.video_bench --part host --frames 24
    python -m perf.video.video_bench --part calibration --calibration-frames 16
    python -m perf.video.video_bench --part relocalise
    python -m perf.video.video_bench --part gaps --size 640x480
    python -m perf.video.video_bench --part cuts --clip-frames 32
    python -m perf.video.video_bench --part long                 # 1000 frames, 1920x1080
    python -m perf.video.video_bench --part long --warp 0.03
    python -m perf.video.video_bench --part walk --draws 5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time

from ..common import cpu_line, finish_report, median, timed_both


def _size(text: str) -> tuple:
    w, h = text.lower().split("x")
    return int(w), int(h)


def host_part(size: tuple, frames: int) -> dict:
    from tt_moge.host import CallOptions, plan_canvas, postprocess
    from tt_moge.scene import camera_path, render_path
    from tt_moge.testing.video import VideoOracle, symmetric_errors
    from tt_moge.video.calibrate import Calibration
    from tt_moge.video.predict import ClipChain

    t = time.perf_counter()
    renders = render_path(camera_path(frames, length=0.1 * frames), *size)
    print(f"rendered {frames} frames of {size[0]}x{size[1]} in {time.perf_counter() - t:.1f} s", flush=True)
    k = renders[0].intrinsics
    oracle = VideoOracle(renders, scale_errors=symmetric_errors(frames, 0.15, 1), noise=0.005, holes=0.05)
    call = CallOptions.make(intrinsics=k)
    plan = plan_canvas(size, size, "pad")
    chain = ClipChain(None, 0)
    start = Calibration(0, frames, None, 1.0, (1.0, 50.0))
    ours = {"wall": [], "cpu": [], "register": [], "scale": [], "fuse": []}
    model = {"wall": [], "cpu": []}
    registered = 0
    for i, r in enumerate(renders):
        raw = oracle.raw_maps(i)
        w0, c0 = time.perf_counter(), time.process_time()
        out = postprocess(raw, plan, call)  # the model's own host work on this frame, for scale
        model["wall"].append((time.perf_counter() - w0) * 1e3)
        model["cpu"].append((time.process_time() - c0) * 1e3)
        timing: dict = {}
        w0, c0 = time.perf_counter(), time.process_time()
        done = chain.step(i, r.image, out, start if i == 0 else None, 30.0, timing)  # [this frame]: nothing held
        wall, cpu = (time.perf_counter() - w0) * 1e3, (time.process_time() - c0) * 1e3
        registered += sum(frame.registered for frame in done)
        if i == 0:
            continue  # it only starts the chain
        ours["wall"].append(wall)
        ours["cpu"].append(cpu)
        for key in ("register", "scale", "fuse"):
            ours[key].append(timing[key])
    result = {
        "size": list(size),
        "frames": frames,
        "registered": registered,
        "video_ms": {k: round(median(v), 2) for k, v in ours.items()},
        "postprocess_ms": {k: round(median(v), 2) for k, v in model.items()},
    }
    result["ratio_wall"] = round(result["video_ms"]["wall"] / result["postprocess_ms"]["wall"], 3)
    result["ratio_cpu"] = round(result["video_ms"]["cpu"] / result["postprocess_ms"]["cpu"], 3)
    v, p = result["video_ms"], result["postprocess_ms"]
    print(
        f"host per {size[0]}x{size[1]} frame, median of {frames - 1} ({registered}/{frames} registered):\n"
        f"  video path (ClipChain.step): {v['wall']:.2f} ms wall, {v['cpu']:.2f} ms CPU "
        f"(register {v['register']:.2f}, scale {v['scale']:.2f}, fuse {v['fuse']:.2f} ms wall)\n"
        f"  the model's own post-processing (solve + finish): {p['wall']:.2f} ms wall, {p['cpu']:.2f} ms CPU\n"
        f"  ratio video / post-processing: {result['ratio_wall']:.2f} wall, {result['ratio_cpu']:.2f} CPU"
    )
    return result


def calibration_part(size: tuple, frames: int) -> dict:
    import numpy as np

    import tt_moge.video.calibrate as calibrate_module
    from tt_moge.host import CallOptions
    from tt_moge.scene import camera_path, render_path
    from tt_moge.testing.video import VideoOracle, symmetric_errors

    t = time.perf_counter()
    renders = render_path(camera_path(frames, length=0.1 * frames), *size)
    print(f"rendered {frames} frames of {size[0]}x{size[1]} in {time.perf_counter() - t:.1f} s", flush=True)
    errors = np.random.default_rng(4).uniform(-0.1, 0.1, frames)
    oracle = VideoOracle(
        renders, scale_errors=symmetric_errors(frames, 0.15, 1), focal_errors=errors, noise=0.005, holes=0.05
    )
    images = [(i, r.image) for i, r in enumerate(renders)]
    oracle.predict_many([r.image for r in renders])  # the stand-in makes each frame's raw maps once: not timed
    spent = {"model": [0.0, 0.0], "search": [0.0, 0.0], "register": [0.0, 0.0]}

    def timing(key, fn):
        def call(*args, **kwargs):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key][0] += time.perf_counter() - w
                spent[key][1] += time.process_time() - c

        return call

    model = type("Timed", (), {"predict_many": staticmethod(timing("model", oracle.predict_many))})()
    search, register = calibrate_module.focal_from_tracks, calibrate_module._register
    calibrate_module.focal_from_tracks = timing("search", search)
    calibrate_module._register = timing("register", register)
    try:
        w0, c0 = time.perf_counter(), time.process_time()
        calibration = calibrate_module.calibrate(model, images, CallOptions())
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    finally:
        calibrate_module.focal_from_tracks, calibrate_module._register = search, register
    record = calibration.record()["focal"]
    truth = renders[0].intrinsics[0, 0]
    k = calibration.intrinsics.pixel_matrix(size)
    ms = {key: [round(v * 1e3, 1) for v in value] for key, value in spent.items()}
    result = {
        "size": list(size),
        "frames": frames,
        "host_ms": [round((wall - spent["model"][0]) * 1e3, 1), round((cpu - spent["model"][1]) * 1e3, 1)],
        "focal_search_ms": ms["search"],
        "registration_ms": ms["register"],
        "registration_passes": 2 if record["source"] == "geometry" else 1,
        "model_ms": ms["model"],
        "focal": record,
        "focal_error": round(float(k[0, 0] / truth - 1), 5),
        "median_focal_error": round(float(record["median_fx"] / truth - 1), 5),
    }
    print(
        f"calibration of {frames} frames {size[0]}x{size[1]} (once per clip or window), wall / CPU ms:\n"
        f"  host work (calibrate less the model's predict_many): {result['host_ms'][0]:.0f} / "
        f"{result['host_ms'][1]:.0f}\n"
        f"  of which the focal search from the tracks: {ms['search'][0]:.0f} / {ms['search'][1]:.0f}; "
        f"registration of the frames ({result['registration_passes']} passes): {ms['register'][0]:.0f} / "
        f"{ms['register'][1]:.0f}\n"
        f"  focal: {record['source']} ({record['pairs']} pairs, {record['points']} tracks, standard error "
        f"{record['uncertainty']}), {result['focal_error']:+.2%} from the truth; the frames' median "
        f"{result['median_focal_error']:+.2%}"
    )
    return result


@contextlib.contextmanager
def _tiny_model(canvas: tuple):
    """A random-weight checkpoint (tiny-vits-normal) loaded on the CPU at `canvas`, fp32: the clip parts' model."""
    from tt_moge import MoGeModel
    from tt_moge.testing import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(tmp, "tiny-vits-normal")
        with MoGeModel.from_pretrained(
            ckpt, device="cpu", resolution=canvas, num_tokens=1200, warmup=1, warmup_variants="none", precision="fp32"
        ) as model:
            yield model


def clip_part(size: tuple, frames: int, repeats: int, canvas: tuple) -> dict:
    from tt_moge.scene import camera_path, render_path
    from tt_moge.testing.video import PredictOnly
    from tt_moge.video import predict_video

    renders = render_path(camera_path(frames, length=0.1 * frames), *size)
    images = [r.image for r in renders]
    k = renders[0].intrinsics
    with _tiny_model(canvas) as model:
        calls = {
            "predict_many": lambda: model.predict_many(images),
            "predict_video": lambda: model.predict_video(images),
            "predict_video_forwarding_twice": lambda: predict_video(PredictOnly(model), images),
            "predict_video_given_k": lambda: model.predict_video(images, intrinsics=k),
        }
        wall: dict = {name: [] for name in calls}
        cpu: dict = {name: [] for name in calls}
        for _ in range(repeats):
            for name, call in calls.items():
                w, c = timed_both(call)
                wall[name].append(w)
                cpu[name].append(c)
    fps = {name: round(frames / median(s), 3) for name, s in wall.items()}
    fpcs = {name: round(frames / median(s), 3) for name, s in cpu.items()}  # frames per CPU second of the process
    result = {
        "size": list(size),
        "frames": frames,
        "canvas": list(canvas),
        "repeats": repeats,
        "frames_per_second": fps,
        "frames_per_cpu_second": fpcs,
        "ratio_to_predict_many": {n: round(fps[n] / fps["predict_many"], 3) for n in fps},
        "cpu_ratio_to_predict_many": {n: round(fpcs[n] / fpcs["predict_many"], 3) for n in fpcs},
    }
    print(f"clip of {frames} frames {size[0]}x{size[1]}, tiny model on a {canvas[0]}x{canvas[1]} canvas (CPU):")
    for name in calls:
        print(
            f"  {name:31s} {fps[name]:7.3f} frames/s ({result['ratio_to_predict_many'][name]:.2f} x predict_many), "
            f"{fpcs[name]:7.3f} frames per CPU second ({result['cpu_ratio_to_predict_many'][name]:.2f} x)"
        )
    return result


def cuts_part(size: tuple, frames: int, repeats: int, canvas: tuple) -> dict:
    """A clip with a cut through the tiny model: the walk, then the pan (in inverted grey levels) through a 50
    degree lens, `frames` frames each; `predict_video` with calibrate_chains on and off, alternated: frames/s, the
    frames that went through the network (the rewound ones run again), the chains."""
    from tt_moge.scene import camera_path, intrinsics_for, pan_path, render_path

    walk = render_path(camera_path(frames, length=0.1 * frames), *size)
    pan = render_path(pan_path(range(0, 3 * frames, 3)), *size, intrinsics_for(*size, 50.0))
    images = [r.image for r in walk] + [255 - r.image for r in pan]

    class Counted:  # the model, counting the images that go through its network
        def __init__(self, model):
            self.model, self.forwards = model, 0

        def predict_many(self, batch, **options):
            self.forwards += len(batch)
            return self.model.predict_many(batch, **options)

        def forward_many(self, batch, **options):
            self.forwards += len(batch)
            return self.model.forward_many(batch, **options)

        def finish_many(self, forwarded, **options):
            return self.model.finish_many(forwarded, **options)

    from tt_moge.video import predict_video

    runs = {"calibrate_chains": True, "one_camera": False}
    wall: dict = {name: [] for name in runs}
    cpu: dict = {name: [] for name in runs}
    seen: dict = {}
    with _tiny_model(canvas) as model:
        for _ in range(repeats):
            for name, on in runs.items():
                counted = Counted(model)
                clip = []
                w, c = timed_both(lambda: clip.append(predict_video(counted, images, calibrate_chains=on)))
                wall[name].append(w)
                cpu[name].append(c)
                chains = clip[0].summary()["chains"]
                seen[name] = {"forwards": counted.forwards, "chains": [c["first_frame"] for c in chains]}
    n = len(images)
    result = {"size": list(size), "frames": n, "canvas": list(canvas), "repeats": repeats}
    for name in runs:
        result[name] = dict(
            seen[name],
            frames_per_second=round(n / median(wall[name]), 3),
            frames_per_cpu_second=round(n / median(cpu[name]), 3),
        )
    on, off = result["calibrate_chains"], result["one_camera"]
    result["ratio"] = round(on["frames_per_second"] / off["frames_per_second"], 3)
    print(f"clip of {n} frames {size[0]}x{size[1]}, a cut at frame {frames}; tiny model on {canvas[0]}x{canvas[1]}:")
    for name in runs:
        r = result[name]
        print(
            f"  {name:17s} {r['frames_per_second']:7.3f} frames/s, {r['frames_per_cpu_second']:7.3f} frames per CPU "
            f"second, {r['forwards']} forwards, chains from frames {r['chains']}"
        )
    print(f"  calibrate_chains / one_camera: {result['ratio']:.2f} x the frames/s")
    return result


def relocalise_part(size: tuple, repeats: int) -> dict:
    import numpy as np

    from tt_moge.scene import camera_path, pan_path, render_path
    from tt_moge.video.registration import Tracker

    ref, after, jump = render_path(camera_path(24)[[4, 5, 16]], *size)
    # a pan right to 40 degrees (6 references, keyframes among them), then back to 30 degrees left: nothing of the
    # last frame's view, the first frames' found again
    pan = render_path(pan_path([0, 8, 16, 24, 32, 40, 0, -30]), *size)
    cases = {
        "next frame (tracks follow)": (ref, [after]),
        "textureless (tracks and descriptors fail)": (ref, [None]),
        "12 frames on, after a failed frame (relocalised)": (ref, [None, jump]),
        "back where it was, after a failed frame (found against a keyframe)": (pan[0], [*pan[1:6], None, pan[7]]),
    }
    result = {}
    for name, (first, frames) in cases.items():
        walls, cpus, outcome = [], [], None
        for _ in range(4 * repeats):
            tracker = Tracker()
            tracker.start(first.image, first.depth.astype(np.float32), first.mask, first.intrinsics)
            for frame in frames:  # the last one timed
                image = np.full_like(first.image, 90) if frame is None else frame.image
                geometry = (after if frame is None else frame).depth.astype(np.float32), after.mask, first.intrinsics
                w0, c0 = time.perf_counter(), time.process_time()
                reg = tracker.register(image, *geometry)
                wall, cpu = (time.perf_counter() - w0) * 1e3, (time.process_time() - c0) * 1e3
                if reg.ok:
                    tracker.advance(1.0 / reg.scale)
            walls.append(wall)
            cpus.append(cpu)
            outcome = "registered" if reg.ok else "failed"
            outcome += f" against frame {reg.reference}, relocalised" if reg.ok and reg.relocalised else ""
        result[name] = {"wall_ms": round(median(walls), 2), "cpu_ms": round(median(cpus), 2), "outcome": outcome}
        print(f"  {name}: {median(walls):.2f} ms wall, {median(cpus):.2f} ms CPU ({outcome})", flush=True)
    return result


def gaps_part(size: tuple) -> list:
    import dataclasses

    import numpy as np

    from tt_moge.scene import camera_path, render_path
    from tt_moge.testing.video import aligned_positions, stand_in
    from tt_moge.video import predict_video

    poses = camera_path(24)
    renders = render_path(poses, *size)
    rows = []
    for start, length in ((3, 2), (3, 5), (3, 8), (3, 11), (3, 14), (6, 2), (6, 5), (6, 8), (6, 11), (6, 14)):
        frames_in = list(renders)
        for i in range(start, start + length):
            frames_in[i] = dataclasses.replace(frames_in[i], image=np.full_like(frames_in[i].image, 60 + 5 * i))
        # new_chain_after=0: a frame after the run that is not found stays flagged instead of starting a new chain
        # (whose poses are in another world): this part measures the relocalisation
        images = [r.image for r in frames_in]
        clip = predict_video(stand_in(frames_in), images, calibration_frames=4, new_chain_after=0)
        ok = clip.registered
        aligned = aligned_positions(clip.poses[ok], poses[ok])
        worst = float(np.linalg.norm(aligned - poses[ok][:, :3, 3], axis=1).max())
        row = {
            "failed": [start, start + length - 1],
            "registered_after": round(float(ok[start + length :].mean()), 3),
            "relocalised": [i for i, record in enumerate(clip.records) if record["relocalised"]],
            "max_position_error_m": round(worst, 4),
        }
        rows.append(row)
        print(
            f"  frames {start}-{start + length - 1} textureless: {row['registered_after']:.0%} of the later frames "
            f"registered, relocalised {row['relocalised']}, largest position error {worst:.3f} m",
            flush=True,
        )
    return rows


class _Enlarged:
    """The loop's frames as a sequence, each rendered when asked (compact, at `small`) and enlarged to `size`
    (image bilinear, depth and mask nearest, intrinsics scaled): a 1000-frame clip at 1080p is not held. The last
    two are kept (the stand-in asks for a frame once, and once more for its raw maps)."""

    def __init__(self, poses, small: tuple, size: tuple):
        self.poses, self.small, self.size = poses, small, size
        self._last: dict = {}

    def __len__(self) -> int:
        return len(self.poses)

    def __getitem__(self, i: int):
        import cv2
        import numpy as np

        from tt_moge.scene import SceneRender, compact, render

        if i not in self._last:
            r = compact(render(*self.small, pose=self.poses[i]))
            k = r.intrinsics.copy()
            k[0] *= self.size[0] / self.small[0]
            k[1] *= self.size[1] / self.small[1]
            mask = cv2.resize(r.mask.astype(np.uint8), self.size, interpolation=cv2.INTER_NEAREST).astype(bool)
            self._last = {
                i: SceneRender(
                    image=cv2.resize(r.image, self.size, interpolation=cv2.INTER_LINEAR),
                    depth=cv2.resize(r.depth, self.size, interpolation=cv2.INTER_NEAREST),
                    points=None,
                    normal=None,
                    mask=mask,
                    intrinsics=k,
                    surface=None,
                ),
                **{j: v for j, v in self._last.items() if j == i - 1},
            }
        return self._last[i]


def _resident_mb() -> float:
    """This process's resident memory (MB, from /proc; NaN elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except OSError:
        return float("nan")


def long_part(size: tuple, frames: int, small: tuple, warp: float) -> dict:
    import math
    import resource

    import numpy as np

    from tt_moge.host import CallOptions, plan_canvas, postprocess
    from tt_moge.scene import loop_path
    from tt_moge.testing.video import VideoOracle, aligned_positions, symmetric_errors
    from tt_moge.video.calibrate import Calibration
    from tt_moge.video.predict import ClipChain

    poses = loop_path(frames)
    renders = _Enlarged(poses, small, size)
    oracle = VideoOracle(  # its thumbnails render every frame once here
        renders,
        scale_errors=symmetric_errors(frames, 0.05, 1),
        noise=0.02,
        holes=0.03,
        warp=warp,
        has_normal=False,
        raw_cache=1,
    )
    call = CallOptions.make(intrinsics=renders[0].intrinsics)
    plan = plan_canvas(size, size, "pad")
    chain = ClipChain(None, 0)
    start = Calibration(0, frames, None, 1.0, (1.0, 50.0))
    wall, cpu, split = [], [], {"register": [], "scale": [], "fuse": [], "record": []}
    resident = {}
    t = time.perf_counter()
    for i in range(frames):
        r = renders[i]
        out = postprocess(oracle.raw_maps(i), plan, call)
        timing: dict = {}
        w0, c0 = time.perf_counter(), time.process_time()
        chain.step(i, r.image, out, start if i == 0 else None, 30.0, timing)
        if i:
            wall.append((time.perf_counter() - w0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
            for key in split:
                split[key].append(timing.get(key, 0.0))
        del out, r
        if i % 50 == 0 or i == frames - 1:
            resident[i] = round(_resident_mb(), 1)
        if i and i % 100 == 0:
            print(f"  frame {i}: {time.perf_counter() - t:.0f} s, resident {resident[i]:.0f} MB", flush=True)
    w0, c0 = time.perf_counter(), time.process_time()
    clip = chain.output("loop", 30.0, {})
    final_wall, final_cpu = (time.perf_counter() - w0) * 1e3 / frames, (time.process_time() - c0) * 1e3 / frames
    resident["result"] = round(_resident_mb(), 1)
    ok = clip.registered
    length = float(np.linalg.norm(np.diff(poses[:, :3, 3], axis=0), axis=1).sum())
    aligned = aligned_positions(clip.poses[ok], poses[ok])
    ate = math.sqrt(float(np.mean(np.sum((aligned - poses[ok][:, :3, 3]) ** 2, axis=1)))) / length
    end = float(np.linalg.norm(clip.poses[-1, :3, 3] - clip.poses[0, :3, 3])) / clip.path_length if ok[-1] else None
    # what the clip adds after its first quarter: the end (the result made) over the least sampled from there on
    # (a sample can catch a passing peak: the pose graph's solve, a merge of the cloud)
    quarter = max(1, frames // 4)
    later = [v for k, v in resident.items() if isinstance(k, int) and k >= quarter]
    result = {
        "size": list(size),
        "rendered_at": list(small),
        "frames": frames,
        "warp": warp,
        "registered": int(ok.sum()),
        "chains": len(chain.chains),
        "keyframes": sum(len(c.graph) for c in chain.chains),
        "loop_closures": chain.loop_closures,
        "step_ms": {
            "wall_median": round(median(wall), 2),
            "wall_mean": round(sum(wall) / len(wall), 2),
            "cpu_median": round(median(cpu), 2),
            "cpu_mean": round(sum(cpu) / len(cpu), 2),
            **{f"{k}_mean": round(sum(v) / len(v), 2) for k, v in split.items()},
        },
        "final_ms_per_frame": {"wall": round(final_wall, 2), "cpu": round(final_cpu, 2)},
        "ate_of_path": round(ate, 5),
        "end_to_start_of_path": None if end is None else round(end, 5),
        "resident_mb": resident,
        "resident_growth_mb": round(resident["result"] - min(later + [resident["result"]]), 1),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3, 1),
        "cloud_points": int(len(clip.cloud_points)),
    }
    m = result["step_ms"]
    print(
        f"host per {size[0]}x{size[1]} frame of a {frames}-frame loop (warp {warp}; {result['registered']} "
        f"registered, {result['chains']} chain(s), {result['keyframes']} keyframes, {result['loop_closures']} loop "
        f"closures; ATE {100 * ate:.2f} % of the path"
        + ("" if end is None else f", end {100 * end:.2f} % of the path from the start")
        + "):\n"
        f"  ClipChain.step: median {m['wall_median']:.2f} ms wall, {m['cpu_median']:.2f} ms CPU; mean "
        f"{m['wall_mean']:.2f} ms wall, {m['cpu_mean']:.2f} ms CPU (mean wall: register {m['register_mean']:.2f}, "
        f"scale {m['scale_mean']:.2f}, fuse {m['fuse_mean']:.2f}, record {m['record_mean']:.2f})\n"
        f"  the final solve and the result, per frame: {final_wall:.2f} ms wall, {final_cpu:.2f} ms CPU\n"
        f"  resident memory (MB) by frame: {resident}; at the end over the least from frame {quarter} on: "
        f"{result['resident_growth_mb']} MB (fused cloud: {result['cloud_points']} voxels); peak RSS of the "
        f"process {result['max_rss_mb']} MB"
    )
    return result


def walk_part(draws: int) -> dict:
    from tt_moge.scene import camera_path, compact, render
    from tt_moge.testing.video import VideoOracle, real_errors, walk_figures
    from tt_moge.video import predict_video

    poses = camera_path(150)
    renders = [compact(render(320, 240, pose=pose)) for pose in poses]
    images = [r.image for r in renders]
    runs = [("exact", 0, VideoOracle(renders))]
    runs += [("noisy", d, real_errors(renders, d)) for d in range(draws)]
    runs += [("warped", d, real_errors(renders, d, warp=0.03)) for d in range(draws)]
    result: dict = {}
    for kind, draw, model in runs:
        clip = predict_video(model, images)
        figures = walk_figures(clip, poses, renders)
        figures["registered"] = int(clip.registered.sum())
        result.setdefault(kind, []).append(figures)
        print(
            f"{kind:6s} draw {draw}: spread {100 * figures['spread']:.2f} %, drift {100 * figures['drift']:.2f} %, "
            f"ATE {100 * figures['ate']:.2f} % of the path ({figures['registered']} of 150 registered)",
            flush=True,
        )
    for kind, rows in result.items():
        worst = {k: max(r[k] for r in rows) for k in ("spread", "drift", "ate")}
        print(f"{kind:6s} largest over {len(rows)}: " + ", ".join(f"{k} {100 * v:.2f} %" for k, v in worst.items()))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--part",
        choices=("host", "calibration", "clip", "relocalise", "gaps", "cuts", "long", "walk", "both"),
        default="both",
        help="both: the first four",
    )
    parser.add_argument("--size", type=_size, default=(1920, 1080), help="host part: frame size (default 1920x1080)")
    parser.add_argument("--frames", type=int, default=16, help="host part: frames (default 16)")
    parser.add_argument(
        "--calibration-frames", type=int, default=16, help="calibration part: frames (default 16, the default)"
    )
    parser.add_argument("--clip-size", type=_size, default=(640, 360), help="clip part: frame size (default 640x360)")
    parser.add_argument("--clip-frames", type=int, default=32, help="clip part: frames (default 32)")
    parser.add_argument("--canvas", type=_size, default=(448, 252), help="clip part: the model's canvas")
    parser.add_argument(
        "--repeats", type=int, default=2, help="clip part: alternated calls of each; relocalise: x 4 (default 2)"
    )
    parser.add_argument("--long-frames", type=int, default=1000, help="long part: frames round the loop (default 1000)")
    parser.add_argument(
        "--long-render", type=_size, default=(320, 180), help="long part: rendered at this size, enlarged to --size"
    )
    parser.add_argument(
        "--warp", type=float, default=0.0, help="long part: the stand-in's smooth depth warp (0.03: correlated errors)"
    )
    parser.add_argument("--draws", type=int, default=5, help="walk part: draws of the stand-in's errors (default 5)")
    parser.add_argument("--json", help="also write the numbers to this JSON file")
    args = parser.parse_args()
    print(cpu_line())
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the start", flush=True)
    result: dict = {"cpu": cpu_line()}
    if args.part in ("host", "both"):
        result["host"] = host_part(args.size, args.frames)
    if args.part in ("calibration", "both"):
        result["calibration"] = calibration_part(args.size, args.calibration_frames)
    if args.part in ("clip", "both"):
        result["clip"] = clip_part(args.clip_size, args.clip_frames, args.repeats, args.canvas)
    if args.part in ("relocalise", "both"):
        print(f"one registration of a {args.size[0]}x{args.size[1]} frame (the walk from its frame 4, the pan from 0):")
        result["relocalise"] = relocalise_part(args.size, args.repeats)
    if args.part == "cuts":
        result["cuts"] = cuts_part(args.clip_size, args.clip_frames // 2, args.repeats, args.canvas)
    if args.part == "long":
        result["long"] = long_part(args.size, args.long_frames, args.long_render, args.warp)
    if args.part == "walk":
        result["walk"] = walk_part(args.draws)
    if args.part == "gaps":
        print(f"the walk at {args.size[0]}x{args.size[1]} (24 frames, 2.4 m) with runs of textureless frames:")
        result["gaps"] = gaps_part(args.size)
    result["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    finish_report(result, args.json)


if __name__ == "__main__":
    main()

"""`predict_video` / `iter_video`: a clip through the model, consistent over its frames, registered and fused.

What is called and read on `model` (so that anything that does the same can stand in, e.g.
`tt_moge.testing.video.VideoOracle`): `model.predict_many(list of (H, W, 3) uint8 RGB arrays, **options)`,
where options are the call options of `model(image, ...)` (`host.CallOptions.kwargs()`), which must return one
`MoGeOutput` per image, in order; and, where the model has both, `forward_many(images, **options)` and
`finish_many(forwards, **options)` (its two halves: MoGeModel's), so that the calibration frames run through the
network once, not twice. Read from each output: depth, mask, points, intrinsics, intrinsics_pixels,
metric_scale (and, for the files, normal). The outputs are changed in place (depth and points scaled).

Steps (threads: a reader decodes frames ahead, a producer runs the model, the caller's thread registers):
1. calibration pass on the first `calibration_frames` frames (`calibrate.calibrate`): the clip's intrinsics
   (given, from fov_x, or one focal solved over the frames) and the metric level;
2. the real pass, `DEFAULT_CHUNK` frames per `predict_many` call, with the clip's intrinsics (the model solves
   only each frame's shift; the calibration frames' kept forwards are only finished again, `finish_many`); the
   next chunk runs on the model while this one is registered;
3. per frame: registration against the last registered frame (`registration.Tracker`), which gives its scale
   relative to the clip (depth and points are multiplied by it) and its pose; a frame whose fit fails its
   checks is flagged (pose NaN), keeps the segment's level and stays out of the fused cloud; after
   `new_chain_after` failed frames in a row (a cut), the last of them starts a new chain: the first frame of a
   world of its own (`ClipChain`);
4. the fused cloud (`fusion.VoxelCloud`) of the registered frames, one per chain.
With `window`, steps 1-3 restart every `window` frames (new intrinsics, the level re-anchored); the registration
chain continues across.

Memory: the reader holds 2 chunks of decoded frames, the producer at most one chunk of outputs ahead of the one
being registered, the calibration its frames' RGB and their forwards (raw maps on the canvas, about 28 bytes per
canvas pixel each, dropped as the real pass finishes them); `iter_video` keeps nothing else per frame but a few numbers
(pose, scales, registration), so an hour-long video streams. `predict_video` keeps every frame's output.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import queue
import threading
import time
from collections import deque
from typing import Any, Iterator, Optional

import numpy as np

from ..fields import bind, options_of, signature
from ..host import CallOptions, InputError, Stopwatch
from .calibrate import Calibration, calibrate
from .fusion import VoxelCloud, frame_points
from .options import DEFAULT_NEW_CHAIN_AFTER, VideoOptions
from .output import VideoFrame, VideoOutput
from .registration import MIN_INLIERS, Registration, Tracker
from .source import open_source

__all__ = [
    "predict_video",
    "iter_video",
    "VideoStream",
    "ClipChain",
    "DEFAULT_CHUNK",
    "split_options",
    "video_signature",
]

DEFAULT_CHUNK = 4  # frames per predict_many call of the real pass (its outputs are in memory at once)
EARLIER_CHAINS = 3  # chains other than the current one that a frame it does not find is looked for in
_END = object()


def split_options(where: str, options: dict) -> tuple:
    """(CallOptions, VideoOptions) of a video call's keyword arguments; unknown ones are a TypeError naming
    `where`, bad values an InputError naming the option."""
    given = bind(_SIGNATURE, where, (), options)
    call_names = {info.argument for info in options_of(CallOptions)}
    call = CallOptions.make(**{k: v for k, v in given.items() if k in call_names})
    video = VideoOptions.make(**{k: v for k, v in given.items() if k not in call_names})
    return call, video


def video_signature(leading: tuple, returns: Any = inspect.Signature.empty) -> inspect.Signature:
    """A video call's signature: the `leading` parameters, then the options of CallOptions and VideoOptions
    (keyword-only), as `predict_video`, `iter_video` and `MoGeModel.predict_video` have it."""
    call, video = signature(CallOptions), signature(VideoOptions)
    return inspect.Signature(
        [*leading, *call.parameters.values(), *video.parameters.values()], return_annotation=returns
    )


_SIGNATURE = video_signature(())


class VideoStream:
    """The frames of a clip as they are done (`VideoFrame`s, in order); after the last, `result` is the
    `VideoOutput` (with the frames' outputs and images only when `keep_frames`). The source is opened (and
    checked) here; iterate once. `close()` (or leaving a `with` block) stops early and releases everything."""

    def __init__(
        self,
        model: Any,
        source: Any,
        call: Optional[CallOptions] = None,
        video: Optional[VideoOptions] = None,
        *,
        keep_frames: bool = False,
        chunk: int = DEFAULT_CHUNK,
        seed: int = 0,
    ):
        call = CallOptions() if call is None else call
        video = VideoOptions() if video is None else video
        self.model, self.call, self.video = model, call, video
        self.keep_frames, self.chunk, self.seed = keep_frames, chunk, seed
        self.source = open_source(source, stride=video.stride, max_frames=video.max_frames)
        self.name, self.fps = self.source.name, self.source.fps
        self.result: Optional[VideoOutput] = None
        self._stop = threading.Event()
        self._iterated = False

    @property
    def expected_frames(self) -> Optional[int]:
        """Frames the stream will yield, when the source says (else None)."""
        return self.source.expected

    def __iter__(self) -> Iterator[VideoFrame]:
        if self._iterated:
            raise RuntimeError("a VideoStream iterates once")
        self._iterated = True
        return self._run()

    def close(self) -> None:
        self._stop.set()
        self.source.close()

    def __enter__(self) -> "VideoStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------- threads
    def _put(self, q: queue.Queue, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _read(self, frames: queue.Queue) -> None:
        """Reader thread: (source index, RGB) into `frames`, then _END; an error goes in as the exception."""
        try:
            size = None
            for index, rgb in self.source:
                if size is None:
                    size = rgb.shape[:2]
                elif rgb.shape[:2] != size:
                    raise InputError(
                        f"source: frame {index} is {rgb.shape[1]}x{rgb.shape[0]}; the clip's frames are "
                        f"{size[1]}x{size[0]} (every frame of a clip must have the same size)"
                    )
                if not self._put(frames, (index, rgb)):
                    return
            self._put(frames, _END)
        except BaseException as exc:
            self._put(frames, exc)

    def _produce(self, frames: queue.Queue, results: queue.Queue) -> None:
        """Producer thread: calibration passes and the real pass on the model, chunk by chunk, into `results` as
        (Calibration or None, [(source index, RGB)], [MoGeOutput]), then _END."""
        try:
            ahead: deque = deque()
            done = [False]

            def fill(n: int) -> None:
                while len(ahead) < n and not done[0]:
                    item = frames.get()
                    if item is _END:
                        done[0] = True
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        ahead.append(item)

            video, position, options, forwarded, segment_start = self.video, 0, None, None, 0
            while not self._stop.is_set():
                calibration = None
                if position == 0 or (video.window is not None and position % video.window == 0):
                    fill(video.calibration_frames)
                    if not ahead:
                        if position == 0:
                            raise InputError(f"source: {self.source.label()} has no frames")
                        break
                    if position == 0 and len(ahead) < 2:
                        raise InputError(
                            f"source: {self.source.label()} has 1 frame (after the stride); a clip needs at least 2 "
                            "to register"
                        )
                    segment = list(ahead)[: video.calibration_frames]
                    calibration = calibrate(self.model, segment, self.call, start=position, seed=self.seed)
                    forwarded, segment_start = calibration.forwarded, position
                    given = calibration.source != "solved"
                    options = (
                        self.call.kwargs() if given else dict(self.call.kwargs(), intrinsics=calibration.intrinsics)
                    )
                n = self.chunk
                if video.window is not None:
                    n = min(n, video.window - position % video.window)
                fill(n)
                batch = [ahead.popleft() for _ in range(min(n, len(ahead)))]
                if not batch:
                    break
                outputs = self._outputs(batch, options, forwarded, position - segment_start)
                if len(outputs) != len(batch):
                    raise RuntimeError(f"the model returned {len(outputs)} outputs for {len(batch)} images")
                if not self._put(results, (calibration, batch, outputs)):
                    return
                position += len(batch)
            self._put(results, _END)
        except BaseException as exc:
            self._put(results, exc)

    def _outputs(self, batch: list, options: dict, forwarded: Optional[list], offset: int) -> list:
        """The model's outputs of a chunk: frames whose forward the calibration kept (`forwarded`, from the
        segment's frame `offset` on) are only finished again with these options, and dropped; the rest run."""
        reuse = [] if forwarded is None else forwarded[offset : offset + len(batch)]
        if reuse:
            forwarded[offset : offset + len(reuse)] = [None] * len(reuse)
        outputs = self.model.finish_many(reuse, **options) if reuse else []
        rest = batch[len(reuse) :]
        return outputs + (self.model.predict_many([rgb for _, rgb in rest], **options) if rest else [])

    # ---------------------------------------------------------------------------------- the caller
    def _run(self) -> Iterator[VideoFrame]:
        t0 = time.perf_counter()
        frames: queue.Queue = queue.Queue(maxsize=2 * self.chunk)
        results: queue.Queue = queue.Queue(maxsize=1)
        threads = [
            threading.Thread(target=self._read, args=(frames,), name="tt_moge-video-read", daemon=True),
            threading.Thread(target=self._produce, args=(frames, results), name="tt_moge-video-model", daemon=True),
        ]
        for thread in threads:
            thread.start()
        state = ClipChain(self.video.voxel_size, self.seed, self.video.new_chain_after)
        register_s = 0.0
        try:
            while True:
                item = results.get()
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                calibration, batch, outputs = item
                for k, ((source_index, rgb), out) in enumerate(zip(batch, outputs)):
                    t = time.perf_counter()
                    frame = state.step(source_index, rgb, out, calibration if k == 0 else None, self.fps)
                    register_s += time.perf_counter() - t
                    if self.keep_frames:
                        state.kept.append((frame.output, rgb))
                    yield frame
        finally:
            self._stop.set()
            for q in (frames, results):  # unblock a thread waiting to put
                try:
                    while True:
                        q.get_nowait()
                except queue.Empty:
                    pass
            for thread in threads:
                thread.join(timeout=30)
            self.source.close()
        self.result = state.output(self.name, self.fps, {"total": time.perf_counter() - t0, "registration": register_s})


@dataclasses.dataclass
class _Chain:
    """One chain of a clip (`ClipChain`): its tracker (None once it is no longer looked in: its keyframes
    dropped), its fused cloud (None once it can no longer be the main chain) and the frames it registered."""

    tracker: Optional[Tracker]
    cloud: Optional[VoxelCloud]
    registered: int = 0


class ClipChain:
    """The registration chains of a clip, frame by frame (`step`: register, scale, fuse one model output), and
    what the result keeps of each frame (`output`). The caller's thread of `VideoStream` runs it; the benchmark
    (perf/video) times it alone.

    A chain is a run of frames registered one to the next, in one world (its first frame's camera). The first
    starts at frame 0. When `new_chain_after` frames in a row fail (not found against the last good frame nor a
    keyframe: the camera is somewhere none of them saw, as after a cut), the last of them starts a new chain at
    the clip's level, unless it has too few features with a depth to register against (a textureless frame
    stays flagged, and the next one is tried). A frame the current chain does not find is looked for in the
    EARLIER_CHAINS chains used last before it (their last frame and keyframes, `Tracker.register`): a cut back to
    an earlier scene (shot / reverse shot) continues that scene's chain, in its world. Failed frames cannot tell a
    cut from a stretch of frames the registration could not read (blur, a hand over the lens): the latter splits
    one scene into two chains, and a frame the new one registers is not looked for in the old one (the frames are
    yielded as they come; their poses are not revised). `new_chain_after` 0: never."""

    def __init__(self, voxel_size: Optional[float], seed: int, new_chain_after: int = DEFAULT_NEW_CHAIN_AFTER):
        self.seed, self.voxel_size, self.new_chain_after = seed, voxel_size, new_chain_after
        self.chains: list = []  # _Chain per chain, in the order they started
        self.current = 0  # the chain of the last registered frame
        self.recent: list = []  # the other chains looked in, the one used last first (at most EARLIER_CHAINS)
        self.failed_in_a_row = 0
        self.level = math.nan
        self.depth_range = (math.nan, math.nan)
        self.calibrations: list = []
        # per frame: (source index, time, pose, scale, model scale, registration, (K, K pixels), chain)
        self.rows: list = []
        self.records: list = []
        self.kept: list = []
        self.size: Optional[tuple] = None

    def step(
        self,
        source_index: int,
        rgb: np.ndarray,
        out: Any,
        calibration: Optional[Calibration],
        fps: Optional[float],
        timing: Optional[dict] = None,
    ) -> VideoFrame:
        """One frame (the model's output for it, changed in place) -> its VideoFrame. `timing`, if a dict,
        receives milliseconds: "register" (features, fit, the chain), "scale" (depth and points x the
        frame's scale), "fuse" (its points into the cloud), "record"."""
        watch = Stopwatch(timing)
        index = len(self.rows)
        if calibration is not None:
            self.calibrations.append(calibration.record())
            self.level = calibration.level
            if index == 0:
                self.depth_range = calibration.depth_range
        if index == 0:
            self.size = out.size
            started = self._start_chain(index, rgb, out, least=0)
        else:
            registration = self._register(index, rgb, out)
            self.failed_in_a_row = 0 if registration.ok else self.failed_in_a_row + 1
            started = (
                not registration.ok
                and 0 < self.new_chain_after <= self.failed_in_a_row
                and self._start_chain(index, rgb, out)
            )
            if registration.ok:
                motion = np.eye(4)
                motion[:3, :3] = registration.rotation
                motion[:3, 3] = registration.translation / registration.scale
                pose = self.rows[registration.reference][2] @ np.linalg.inv(motion)  # its reference's pose
                # a new window's first frame is re-anchored at its calibrated level
                correction = self.level if calibration is not None else 1.0 / registration.scale
                self.tracker.advance(correction)
            else:
                pose, correction = np.full((4, 4), np.nan), self.level
        if started:  # the first frame of a chain: the identity of its world, at the clip's level
            correction, pose, registration = self.level, np.eye(4), Registration(True, scale=1.0, reason=None)
        watch.lap("register")
        model_scale = float(out.metric_scale)
        out.depth *= np.float32(correction)
        out.points *= np.float32(correction)
        out = dataclasses.replace(out, metric_scale=model_scale * correction)
        watch.lap("scale")
        if registration.ok:
            self.chains[self.current].registered += 1
            if len(self.chains) > 1:
                self._prune()
            cloud = self.chains[self.current].cloud
            if cloud.voxel_size is None:
                cloud.auto(out.median_depth)
            if cloud.voxel_size is not None:
                cloud.add(*frame_points(out, rgb, pose))
        watch.lap("fuse")
        time_s = source_index / fps if fps else float(source_index)
        chain = self.current
        frame = VideoFrame(
            index,
            source_index,
            time_s,
            rgb,
            out,
            pose,
            out.metric_scale,
            model_scale,
            registration,
            self.depth_range,
            chain,
        )
        cameras = (out.intrinsics.copy(), out.intrinsics_pixels.copy())  # not the output: its maps must not stay
        self.rows.append((source_index, time_s, pose, out.metric_scale, model_scale, registration, cameras, chain))
        self.records.append(frame.record())
        watch.lap("record")
        return frame

    @property
    def tracker(self) -> Tracker:
        return self.chains[self.current].tracker

    def _main(self) -> int:
        """The chain with the most registered frames (the first of those with as many): `VideoOutput.main_chain`."""
        return int(np.argmax([c.registered for c in self.chains]))

    def _start_chain(self, index: int, rgb: np.ndarray, out: Any, least: int = MIN_INLIERS) -> bool:
        """Start a chain at this frame (numbered `index` in the clip) and make it the current one, unless it has
        fewer than `least` features with a depth: nothing could be registered against it."""
        tracker = Tracker(seed=self.seed)
        tracker.start(rgb, out.depth, out.mask, out.intrinsics_pixels, 0.0, self.level, frame=index)
        if len(tracker.ref.tracks) < least:
            return False
        self.chains.append(_Chain(tracker, VoxelCloud(self.voxel_size)))
        if len(self.chains) > 1:
            self._switch(len(self.chains) - 1)
        self.failed_in_a_row = 0
        return True

    def _switch(self, chain: int) -> None:
        """Make `chain` the current one; the one it replaces heads the earlier chains looked in (the oldest
        beyond EARLIER_CHAINS is dropped, with its keyframes)."""
        self.recent = [self.current] + [c for c in self.recent if c != chain]
        for old in self.recent[EARLIER_CHAINS:]:
            self.chains[old].tracker = None
        self.recent = self.recent[:EARLIER_CHAINS]
        self.current = chain

    def _prune(self) -> None:
        """Drop the cloud of each chain no longer looked in that can no longer be the main chain: its count of
        registered frames is final, and another chain has more (or as many, and came first)."""
        main = self._main()
        for i, chain in enumerate(self.chains):
            if chain.tracker is None and i != main:
                chain.cloud = None

    def _register(self, index: int, rgb: np.ndarray, out: Any) -> Registration:
        """The frame's registration in the current chain, else in the earlier chains looked in (the one used last
        first): the first that finds it becomes the current chain. Else the current chain's failure."""
        failed = self.tracker.register(rgb, out.depth, out.mask, out.intrinsics_pixels, frame=index)
        if failed.ok:
            return failed
        for chain in list(self.recent):
            registration = self.chains[chain].tracker.register(
                rgb, out.depth, out.mask, out.intrinsics_pixels, frame=index
            )
            if registration.ok:
                self._switch(chain)
                return registration
        if self.recent:
            failed.reason = f"{failed.reason}; not found in the {len(self.recent)} earlier chain(s) either"
        return failed

    def output(self, name: str, fps: Optional[float], seconds: dict) -> VideoOutput:
        if not self.rows:
            raise InputError("source: no frames")
        source_frames, times, poses, scale, model_scale, regs, cameras, chains = zip(*self.rows)
        cloud = self.chains[self._main()].cloud
        points, colours, _ = cloud.result()
        kept = self.kept or None
        return VideoOutput(
            name=name,
            size=self.size,
            fps=fps,
            frame_intrinsics=np.stack([c[0] for c in cameras]).astype(np.float32),
            frame_intrinsics_pixels=np.stack([c[1] for c in cameras]).astype(np.float32),
            poses=np.stack(poses),
            scale=np.array(scale),
            model_scale=np.array(model_scale),
            registered=np.array([r.ok for r in regs]),
            chain=np.array(chains),
            inliers=np.array([r.inliers for r in regs]),
            residual=np.array([r.residual for r in regs]),
            failures=[r.reason for r in regs],
            source_frames=np.array(source_frames),
            times=np.array(times),
            cloud_points=points,
            cloud_colors=colours,
            voxel_size=math.nan if cloud.voxel_size is None else float(cloud.voxel_size),
            depth_range=self.depth_range,
            calibrations=self.calibrations,
            records=self.records,
            seconds=seconds,
            frames=None if kept is None else [o for o, _ in kept],
            images=None if kept is None else [i for _, i in kept],
        )


def iter_video(model: Any, source: Any, **options: Any) -> VideoStream:
    """The frames of a clip as they are done (a `VideoStream` of `VideoFrame`s; `.result` afterwards): for clips
    that do not fit in memory. Options: those of `predict_video`."""
    call, video = split_options("iter_video", options)
    return VideoStream(model, source, call, video)


def predict_video(model: Any, source: Any, **options: Any) -> VideoOutput:
    """A clip -> VideoOutput with every frame's consistent MoGeOutput (`frames`), the clip's intrinsics, poses,
    per-frame scales and registration, and the fused cloud (see the module docstring).

    `source`: a video file (what OpenCV's FFmpeg reads), a folder of frames (name order), video bytes, an
    (N, H, W, 3) array or an iterable of images. Options: the call options of `model(image, ...)` (fit, fov_x,
    intrinsics, apply_mask, force_projection) and `VideoOptions` (stride, max_frames, calibration_frames,
    window, voxel_size). `model`: anything with `predict_many` (see the module docstring)."""
    call, video = split_options("predict_video", options)
    with VideoStream(model, source, call, video, keep_frames=True) as stream:
        for _ in stream:
            pass
        return stream.result


param = inspect.Parameter
predict_video.__signature__ = video_signature(
    (param("model", param.POSITIONAL_OR_KEYWORD), param("source", param.POSITIONAL_OR_KEYWORD)), VideoOutput
)
iter_video.__signature__ = video_signature(
    (param("model", param.POSITIONAL_OR_KEYWORD), param("source", param.POSITIONAL_OR_KEYWORD)), VideoStream
)
del param

"""`predict_video` / `iter_video`: a clip through the model, consistent over its frames, registered and fused.

What is called and read on `model` (so that anything that does the same can stand in, e.g.
`tt_moge.testing.video.VideoOracle`): `model.predict_many(list of (H, W, 3) uint8 RGB arrays, **options)`,
where options are the call options of `model(image, ...)` (`host.CallOptions.kwargs()`), which must return one
`MoGeOutput` per image, in order; and, where the model has both, `forward_many(images, **options)` and
`finish_many(forwards, **options)` (its two halves: MoGeModel's), so that the calibration frames run through the
network once, not twice. The clip's options are parsed once, when it starts; a model whose `service` takes a
`CallOptions` (MoGeModel, ModelPool, the stand-in) gets that object in each call instead of keyword arguments
(`calls.ModelCalls`). Read from each output: depth, mask, points, intrinsics, intrinsics_pixels,
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
   world of its own (`ClipChain`). With `calibrate_chains`, the failed frames are held until the run of failures
   ends or is a cut; at a cut they are sent back (a `Rewind` to the first of them with texture): the producer runs
   the clip again from it, after a calibration pass on its frames, so each chain has its own intrinsics and
   level and starts at the new shot's first frame; a frame found in an earlier chain that runs with other
   intrinsics is sent back too, to run again with that chain's calibration. What the producer had run past a
   rewound frame is dropped;
4. the fused cloud (`fusion.VoxelCloud`) of the registered frames, one per chain.
With `window`, steps 1-3 restart every `window` frames (new intrinsics, the level re-anchored); the registration
chain continues across.

Memory: the reader holds 2 chunks of decoded frames, the producer at most one chunk of outputs ahead of the one
being registered (and, for a rewind, the RGB of the frames it ran that the caller has not yet done), the
calibration its frames' RGB and their forwards (raw maps on the canvas, about 28 bytes per canvas pixel each,
dropped as the real pass finishes them); `iter_video` keeps nothing else per frame but a few numbers (pose,
scales, registration), so an hour-long video streams. `predict_video` keeps every frame's output.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Iterator, Optional

import numpy as np

from ..fields import takes_options
from ..host import CallOptions, InputError, Stopwatch
from ..output import finite_or_none
from .bundle import View, adjust
from .calibrate import Calibration, calibrate
from .calls import ModelCalls
from .fusion import VoxelCloud, frame_points
from .options import DEFAULT_CALIBRATION_FRAMES, DEFAULT_NEW_CHAIN_AFTER, VideoOptions
from .output import VideoFrame, VideoOutput
from .posegraph import CALIBRATION_STD, PoseGraph, Similarity
from .registration import MIN_INLIERS, Registration, Tracker
from .source import open_source

__all__ = [
    "predict_video",
    "iter_video",
    "VideoStream",
    "ClipChain",
    "DEFAULT_CHUNK",
]

DEFAULT_CHUNK = 4  # frames per predict_many call of the real pass (its outputs are in memory at once)
EARLIER_CHAINS = 3  # chains other than the current one that a frame it does not find is looked for in
BUNDLE_KEYFRAMES = 6  # the newest keyframes of a chain adjusted together at each new keyframe (bundle.py)
MIN_BUNDLE_KEYFRAMES = 3  # ... once it has this many: two are the link itself fitted again, no third view to
# average their depths' errors against
LOCAL_NODES = 8  # the newest keyframe nodes of a chain's pose graph solved again at each new keyframe
_END = object()


class VideoStream:
    """The frames of a clip as they are done (`VideoFrame`s, in order); after the last, `result` is the
    `VideoOutput` (with the frames' outputs and images only when `keep_frames`). `call` and `video`: the clip's
    options, validated (`CallOptions.make`, `VideoOptions.make`; not checked again). The source is opened (and
    checked) here; iterate once. `close()` (or leaving a `with` block) stops early and releases everything.

    `on_frame(count, (height, width))`, when given, is called by the reader for each frame as it is decoded
    (`count` frames read so far, this one included), before the frame goes to the model: an exception it raises
    ends the stream with that exception, so the frames after it are never run. The server counts a clip's
    frames and their memory there, whatever the file's header said. `on_stage(text)`, when given, is called by
    the producer as it starts a step ("calibrating the camera on frames 1-16", "model on frames 17-20"), for a
    progress display."""

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
        on_frame: Optional[Callable[[int, tuple], None]] = None,
        on_stage: Optional[Callable[[str], None]] = None,
    ):
        call = CallOptions() if call is None else call
        video = VideoOptions() if video is None else video
        self.model, self.call, self.video = model, call, video
        self.calls = ModelCalls(model)  # the model called with `call` as it is, chunk after chunk
        self.keep_frames, self.chunk, self.seed = keep_frames, chunk, seed
        self.on_frame = on_frame
        self.on_stage = on_stage
        self.source = open_source(source, stride=video.stride, max_frames=video.max_frames)
        self.name, self.fps = self.source.name, self.source.fps
        self.result: Optional[VideoOutput] = None
        self._done = 0  # the frames before this clip index are done by the caller (the producer may forget them)
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
            for count, (index, rgb) in enumerate(self.source, 1):
                if self.on_frame is not None:
                    self.on_frame(count, rgb.shape[:2])
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

    def _produce(self, frames: queue.Queue, results: queue.Queue, rewinds: queue.Queue) -> None:
        """Producer thread: calibration passes and the real pass on the model, chunk by chunk, into `results` as
        (Calibration or None, [(source index, RGB)], [MoGeOutput]), then _END. A `Rewind` from the caller (in
        `rewinds`, also after _END) runs the clip again from its frame: `_Rewound` goes into `results` first."""
        try:
            ahead: deque = deque()  # (source index, RGB) read, not yet run
            recent: deque = deque()  # (clip index, (source index, RGB)) run, not yet done by the caller
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
            # what the next chunk starts with: a calibration pass (its trigger), a kept Calibration, or nothing
            pending: Any = "start"
            running: Optional[Calibration] = None
            ended = False
            while not self._stop.is_set():
                try:
                    rewind = rewinds.get(timeout=0.1) if ended else rewinds.get_nowait()
                except queue.Empty:
                    if ended:
                        continue
                else:  # the caller's request: the frames from rewind.index on again
                    ahead.extendleft(reversed([item for index, item in recent if index >= rewind.index]))
                    recent.clear()
                    position, ended = rewind.index, False
                    pending = "chain" if rewind.calibration is None else rewind.calibration
                    if not self._put(results, _Rewound(rewind.index)):
                        return
                while recent and recent[0][0] < self._done:
                    recent.popleft()
                if pending is None and video.window is not None and position - segment_start >= video.window:
                    pending = "window"
                calibration = None
                if isinstance(pending, str):
                    fill(video.calibration_frames)
                    if position == 0 and not ahead:
                        raise InputError(f"source: {self.source.label()} has no frames")
                    if position == 0 and len(ahead) < 2:
                        raise InputError(
                            f"source: {self.source.label()} has 1 frame (after the stride); a clip needs at least 2 "
                            "to register"
                        )
                    if ahead:
                        segment = list(ahead)[: video.calibration_frames]
                        self._stage(
                            f"calibrating the camera on frames {position + 1}-{position + len(segment)}"
                            + ("" if pending == "start" else f" (a new {pending})")
                        )
                        calibration = self._calibrate(segment, position, pending, running)
                        forwarded, segment_start, running = calibration.forwarded, position, calibration
                        options = self._options(calibration)
                elif pending is not None:  # an earlier chain's calibration, run again (no pass, no record)
                    forwarded, segment_start, running = None, position, pending
                    options = self._options(pending)
                pending = None
                n = self.chunk
                if video.window is not None:
                    n = min(n, video.window - (position - segment_start))
                fill(n)
                batch = [ahead.popleft() for _ in range(min(n, len(ahead)))]
                if not batch:  # the end of the source: wait for a rewind or the stop
                    ended = self._put(results, _END)
                    continue
                self._stage(f"model on frames {position + 1}-{position + len(batch)}")
                outputs = self._outputs(batch, options, forwarded, position - segment_start)
                if len(outputs) != len(batch):
                    raise RuntimeError(f"the model returned {len(outputs)} outputs for {len(batch)} images")
                recent.extend(enumerate(batch, position))
                if not self._put(results, (calibration, batch, outputs)):
                    return
                position += len(batch)
        except BaseException as exc:
            self._put(results, exc)

    def _stage(self, text: str) -> None:
        """What the producer starts now, for `on_stage` (a progress display: a calibration pass can take minutes)."""
        if self.on_stage is not None:
            self.on_stage(text)

    def _calibrate(self, segment: list, position: int, trigger: str, running: Optional[Calibration]) -> Calibration:
        """The calibration pass of the segment starting at clip index `position`. A new chain's that cannot be made
        (no frame of the segment fixes a focal) keeps the running calibration, with a note saying so."""
        try:
            return calibrate(self.model, segment, self.call, start=position, seed=self.seed, trigger=trigger)
        except ValueError as exc:
            if trigger != "chain" or running is None:
                raise
            note = f"kept the calibration of frame {running.start}: {exc}"
            return dataclasses.replace(
                running, start=position, trigger=trigger, frames=0, registered=0, forwarded=None, note=note
            )

    def _options(self, calibration: Calibration) -> CallOptions:
        """The real pass's call options with a segment's calibration: its intrinsics, where they were solved (the
        clip's own options otherwise: neither intrinsics nor fov_x given), once per segment."""
        if calibration.source != "solved":
            return self.call
        return dataclasses.replace(self.call, intrinsics=calibration.intrinsics)

    def _outputs(self, batch: list, options: CallOptions, forwarded: Optional[list], offset: int) -> list:
        """The model's outputs of a chunk: frames whose forward the calibration kept (`forwarded`, from the
        segment's frame `offset` on) are only finished again with these options, and dropped; the rest run."""
        reuse = [] if forwarded is None else forwarded[offset : offset + len(batch)]
        if reuse:
            forwarded[offset : offset + len(reuse)] = [None] * len(reuse)
        outputs = self.calls.finish_many(reuse, options) if reuse else []
        rest = batch[len(reuse) :]
        return outputs + (self.calls.predict_many([rgb for _, rgb in rest], options) if rest else [])

    # ---------------------------------------------------------------------------------- the caller
    def _run(self) -> Iterator[VideoFrame]:
        t0 = time.perf_counter()
        frames: queue.Queue = queue.Queue(maxsize=2 * self.chunk)
        results: queue.Queue = queue.Queue(maxsize=1)
        rewinds: queue.Queue = queue.Queue()
        threads = [
            threading.Thread(target=self._read, args=(frames,), name="tt_moge-video-read", daemon=True),
            threading.Thread(
                target=self._produce, args=(frames, results, rewinds), name="tt_moge-video-model", daemon=True
            ),
        ]
        for thread in threads:
            thread.start()
        state = ClipChain(
            self.video.voxel_size, self.seed, self.video.new_chain_after, calibrate_chains=self.video.calibrate_chains
        )
        register_s = 0.0
        waiting: Optional[int] = None  # the clip index of a rewind asked for: results before its _Rewound are stale
        try:
            while True:
                item = results.get()
                if isinstance(item, BaseException):
                    raise item
                if waiting is not None:
                    if isinstance(item, _Rewound) and item.index == waiting:
                        waiting = None
                    continue
                if item is _END:
                    break
                calibration, batch, outputs = item
                for k, ((source_index, rgb), out) in enumerate(zip(batch, outputs)):
                    t = time.perf_counter()
                    done = state.step(source_index, rgb, out, calibration if k == 0 else None, self.fps)
                    register_s += time.perf_counter() - t
                    rewind, state.rewind = state.rewind, None
                    if rewind is not None:
                        rewinds.put(rewind)
                        waiting = rewind.index
                    yield from self._done_frames(state, done)
                    if rewind is not None:
                        break
            yield from self._done_frames(state, state.release())
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

    def _done_frames(self, state: "ClipChain", frames: list) -> Iterator[VideoFrame]:
        for frame in frames:
            self._done = frame.index + 1
            if self.keep_frames:
                state.kept.append((frame.output, frame.image))
            yield frame


@dataclasses.dataclass
class Rewind:
    """The caller's request to the producer: run the clip again from its frame `index`, with a new calibration
    pass (`calibration` None: a new chain starts there) or with an earlier chain's `calibration`."""

    index: int
    calibration: Optional[Calibration] = None


@dataclasses.dataclass
class _Rewound:
    """In the results: what follows is the clip again from frame `index` (what came before it since the request
    is stale)."""

    index: int


@dataclasses.dataclass
class _Chain:
    """One chain of a clip (`ClipChain`): its tracker (None once it is no longer looked in: its keyframes
    dropped), its fused cloud (None once it can no longer be the main chain), the frames it registered and the
    calibration its frames run with (its own with `calibrate_chains`, else the clip's)."""

    tracker: Optional[Tracker]
    cloud: Optional[VoxelCloud]
    registered: int = 0
    calibration: Optional[Calibration] = None
    graph: PoseGraph = dataclasses.field(default_factory=PoseGraph)


class ClipChain:
    """The registration chains of a clip, frame by frame (`step`: register, scale, fuse one model output), and
    what the result keeps of each frame (`output`). The caller's thread of `VideoStream` runs it; the benchmark
    (perf/video) times it alone.

    A chain is a run of frames registered one to the next, in one world (its first frame's camera). The first
    starts at frame 0. When `new_chain_after` frames in a row fail (not found against the last good frame nor a
    keyframe: the camera is somewhere none of them saw, as after a cut), the last of them starts a new chain,
    unless it has too few features with a depth to register against (a textureless frame stays flagged, and the
    next one is tried). A frame the current chain does not find is looked for in the EARLIER_CHAINS chains used
    last before it (their last frame and keyframes, `Tracker.register`): a cut back to an earlier scene (shot /
    reverse shot) continues that scene's chain, in its world. Failed frames cannot tell a cut from a stretch of
    frames the registration could not read (blur, a hand over the lens): the latter splits one scene into two
    chains, and a frame the new one registers is not looked for in the old one (the frames are yielded as they
    come; their poses are not revised). `new_chain_after` 0: never.

    With `calibrate_chains`, a new chain is calibrated on its own frames and starts at the first frame of the
    run of failures: `step` holds failed frames (`held`) until a registered frame releases them (flagged) or the
    run reaches `new_chain_after` (`_cut`): then the frames from the first of them with texture are forgotten and
    `rewind` is set (a `Rewind` to it); they come back, run again after a calibration pass on them (trigger
    "chain"), and the first starts the chain at that calibration's level. A frame found in an earlier chain whose
    intrinsics differ from those it ran with comes back the same way, run again from it with that chain's
    calibration (no pass), and is registered again. Without it (the benchmark's case, and anything that cannot
    run frames again) nothing is held, and a new chain starts at the last failed frame with the level and
    intrinsics of the clip's segment."""

    def __init__(
        self,
        voxel_size: Optional[float],
        seed: int,
        new_chain_after: int = DEFAULT_NEW_CHAIN_AFTER,
        calibrate_chains: bool = False,
    ):
        self.seed, self.voxel_size, self.new_chain_after = seed, voxel_size, new_chain_after
        self.calibrate_chains = calibrate_chains
        self.chains: list = []  # _Chain per chain, in the order they started
        self.current = 0  # the chain of the last registered frame
        self.recent: list = []  # the other chains looked in, the one used last first (at most EARLIER_CHAINS)
        self.failed_in_a_row = 0
        self.level = math.nan
        self.running: Optional[Calibration] = None  # the calibration the frames now arriving were run with
        self.rewind: Optional[Rewind] = None  # set by `step`: the frames to run again (the caller takes it)
        self._rewound = -1  # the last frame sent back to an earlier chain's calibration
        self.held: list = []  # VideoFrames of the current run of failed frames, not yet released
        self._run_start: list = []  # (tracker, counters) of each chain before the current run of failed frames
        self.depth_range = (math.nan, math.nan)
        self.calibrations: list = []
        # per frame: (source index, time, pose, scale, model scale, registration, (K, K pixels), chain)
        self.rows: list = []
        self.records: list = []
        self.kept: list = []
        self.size: Optional[tuple] = None
        # per registered frame: (chain, node, Similarity raw node -> raw frame) and the scale its tracked points
        # were given (`_hang`); a few numbers a frame
        self.hang: dict = {}
        self.used: dict = {}
        self.loop_closures = 0

    def step(
        self,
        source_index: int,
        rgb: np.ndarray,
        out: Any,
        calibration: Optional[Calibration],
        fps: Optional[float],
        timing: Optional[dict] = None,
    ) -> list:
        """One frame (the model's output for it, changed in place) -> the VideoFrames now done, in order: this one;
        none while it is held (a failed frame that may be the first of a new shot, with `calibrate_chains`) or sent
        back (`rewind`); held ones with it once its registration or a cut decides them. `timing`, if a dict,
        receives milliseconds: "register" (features, fit, the chain), "scale" (depth and points x the frame's
        scale), "fuse" (its points into the cloud), "record"."""
        watch = Stopwatch(timing)
        index = len(self.rows)
        chain_first = index == 0 or (calibration is not None and calibration.trigger == "chain")
        registration, cut = None, False
        if not chain_first:
            if self.failed_in_a_row == 0:  # a run of failed frames may start here: the trackers as they were
                self._run_start = [(c.tracker, c.tracker.counters()) for c in self.chains if c.tracker is not None]
            registration = self._register(index, rgb, out)
            if registration is None:  # found in an earlier chain, run with other intrinsics: it comes back
                return []
            failed = 0 if registration.ok else self.failed_in_a_row + 1
            cut = not registration.ok and 0 < self.new_chain_after <= failed
            if cut and self.calibrate_chains:
                released = self._cut(index, rgb, out)
                if released is not None:
                    return released
            self.failed_in_a_row = failed
        if calibration is not None:
            self._calibrated(calibration, index)
        if index == 0:
            self.size = out.size
        if chain_first:
            started = self._start_chain(index, rgb, out, least=0 if index == 0 else MIN_INLIERS)
            if not started:
                registration = Registration(False, reason="too few features with a depth to start a chain")
                self.failed_in_a_row += 1
        else:
            started = cut and self._start_chain(index, rgb, out)
        if started:  # the first frame of a chain: the identity of its world, at its level
            correction, pose, registration = self.level, np.eye(4), Registration(True, scale=1.0, reason=None)
        elif registration.ok:  # hung on the pose graph of its reference's chain: its scale and pose from there
            correction, pose = self._hang(index, registration)
        else:
            pose, correction = np.full((4, 4), np.nan), self.level
        if calibration is not None and (started or not chain_first):  # a window's: the current chain's from now
            self.chains[self.current].calibration = self.running
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
        if self.calibrate_chains and not registration.ok and 0 < self.failed_in_a_row < self.new_chain_after:
            self.held.append(frame)  # a new shot's first frames, if a cut follows
            return []
        return self.release() + [frame]

    def release(self) -> list:
        """The frames held (failed frames that a cut did not follow), in order; none are held after this."""
        released, self.held = self.held, []
        return released

    def _cut(self, index: int, rgb: np.ndarray, out: Any) -> Optional[list]:
        """A cut found at frame `index` (the last of `new_chain_after` failed frames), with `calibrate_chains`: the
        new chain starts at the first of the failed frames held with it that has the features to register
        against. Its frames are forgotten (the rows, the records, the trackers' counters as before the run of
        failures) and sent back (`rewind`); the ones before it are released, flagged. None when no frame of the
        run can start a chain (each later failed frame is tried)."""
        candidates = [(f.index, f.image, f.output) for f in self.held] + [(index, rgb, out)]
        first = next((i for i, image, output in candidates if self._tracker(i, image, output) is not None), None)
        if first is None:
            return None
        for tracker, counters in self._run_start:
            tracker.rewind(counters)
        released = [f for f in self.held if f.index < first]
        self.held = []
        del self.rows[first:], self.records[first:]
        self.calibrations = [c for c in self.calibrations if c["start_frame"] < first]
        self.rewind = Rewind(first)  # nothing of these frames is kept: they come back calibrated
        return released

    @property
    def tracker(self) -> Tracker:
        return self.chains[self.current].tracker

    def _main(self) -> int:
        """The chain with the most registered frames (the first of those with as many): `VideoOutput.main_chain`."""
        return int(np.argmax([c.registered for c in self.chains]))

    def _tracker(self, index: int, rgb: np.ndarray, out: Any, least: int = MIN_INLIERS) -> Optional[Tracker]:
        """A tracker started on this frame (numbered `index` in the clip); None if it has fewer than `least`
        features with a depth: nothing could be registered against it."""
        tracker = Tracker(seed=self.seed)
        tracker.start(rgb, out.depth, out.mask, out.intrinsics_pixels, 0.0, self.level, frame=index)
        return tracker if len(tracker.ref.tracks) >= least else None

    def _start_chain(self, index: int, rgb: np.ndarray, out: Any, least: int = MIN_INLIERS) -> bool:
        """Start a chain at this frame and make it the current one, unless it has too few features (`_tracker`)."""
        tracker = self._tracker(index, rgb, out, least)
        if tracker is None:
            return False
        chain = _Chain(tracker, VoxelCloud(self.voxel_size), calibration=self.running)
        node = chain.graph.add_node(index, Similarity.identity(self.level))
        self._prior(chain.graph, node, 0.0, index)
        self.hang[index], self.used[index] = (len(self.chains), node, Similarity.identity()), self.level
        self.chains.append(chain)
        if len(self.chains) > 1:
            self._switch(len(self.chains) - 1)
        self.failed_in_a_row = 0
        return True

    def _hang(self, index: int, reg: Registration) -> tuple:
        """A registered frame on its chain's pose graph -> (its scale correction, its pose), the graph's estimate.

        The fit is against its reference's points as the tracker holds them (scaled by `used`): turned into one
        between the two frames' raw points, and composed with the reference's own hanging, it hangs the frame on
        the keyframe node its reference hangs on (`hang`: chain, node, raw node -> raw frame). A frame the tracker
        makes a keyframe becomes a node, with that fit as its edge and any loop closure the tracker found as more;
        the newest LOCAL_NODES nodes are solved again (all of them after a loop closure). Each frame's prior (its
        scale correction near 1: the model's own metric scale) is carried by its node."""
        chain, node, rel_ref = self.hang[reg.reference]
        graph = self.chains[chain].graph
        rel = Similarity(reg.scale * self.used[reg.reference], reg.rotation, reg.translation) @ rel_ref
        estimate = graph.nodes[node] @ rel.inverse()
        tracker = self.tracker
        tracker.advance(estimate.scale)
        self.used[index] = estimate.scale
        if tracker.keyframes and tracker.keyframes[-1].frame == index and reg.information is not None:
            new = graph.add_node(index, estimate)
            graph.add_edge(node, new, rel, reg.information)
            self._prior(graph, new, 0.0, index)
            self.hang[index] = (chain, new, Similarity.identity())
            first = len(graph) - LOCAL_NODES
            for loop in tracker.loops:
                if loop.reference in self.hang and self.hang[loop.reference][0] == chain:
                    _, old, rel_old = self.hang[loop.reference]
                    measured = Similarity(loop.scale * self.used[loop.reference], loop.rotation, loop.translation)
                    graph.add_edge(old, new, measured @ rel_old, loop.information)
                    self.loop_closures += 1
                    first = min(first, old)  # the loop's nodes, from its oldest: its correction spread along it
            graph.optimise(first=first)
            self._adjust(chain)
            estimate = graph.nodes[new]
        else:
            self._prior(graph, node, math.log(rel.scale), index)
            self.hang[index] = (chain, node, rel)
        return estimate.scale, estimate.pose()

    def _adjust(self, chain: int) -> None:
        """The newest BUNDLE_KEYFRAMES keyframes of the chain adjusted together (`bundle.adjust`: their poses and
        scales with the points of the features they share, the oldest held), and the pose graph's edges between
        them made the adjusted ones: the graph keeps their information and the loop closures, the links between
        neighbours are the bundle's."""
        graph, tracker = self.chains[chain].graph, self.chains[chain].tracker
        window, nodes = [], []
        for key in tracker.keyframes[-BUNDLE_KEYFRAMES:]:
            hung = self.hang.get(key.frame)
            if hung is not None and hung[0] == chain and graph.frames[hung[1]] == key.frame:
                window.append(key)
                nodes.append(hung[1])
        if len(window) < MIN_BUNDLE_KEYFRAMES:
            return
        views = [
            View(
                key.geometry[2],
                key.ids,
                key.tracks.astype(np.float64) + 0.5,
                np.where(key.lifted, key.xyz[:, 2] / key.geometry[4], np.nan),
                graph.nodes[node],
                held=n == 0,
                prior=(graph.prior_weight[node], graph.prior_sum[node]),
            )
            for n, (key, node) in enumerate(zip(window, nodes))
        ]
        result = adjust(views)
        if result is None:
            return
        for node, estimate in zip(nodes, result["estimates"]):
            graph.nodes[node] = estimate
        inside = set(nodes)
        for edge in graph.edges:
            if edge.a in inside and edge.b in inside:
                edge.measured = graph.nodes[edge.b].inverse() @ graph.nodes[edge.a]

    def _prior(self, graph: PoseGraph, node: int, log_rel: float, index: int) -> None:
        """Frame `index`'s metric prior on the node it hangs on (log_rel: the log of its scale relative to the
        node's). The model's own scale (a scale correction of 1), but the frames of a calibration pass count
        through the pass's level (the median of the model's scale over them, relative to the pass's first frame:
        robust to a frame far off): on its first frame, each with CALIBRATION_STD (the others PRIOR_STD: a weak
        prior, which sets the level of a long chain and leaves a short one at its calibration's); none on the
        others."""
        calibration = self.running
        if calibration is None or not calibration.frames or index >= calibration.start + calibration.frames:
            graph.add_prior(node, log_rel)
        elif index == calibration.start:
            graph.add_prior(node, log_rel + math.log(self.level), CALIBRATION_STD / math.sqrt(calibration.frames))

    def _final(self) -> list:
        """Every chain's graph solved once more over all its nodes; then each registered frame's (scale
        correction, pose) from it (None for the others)."""
        for chain in self.chains:
            if len(chain.graph) > 1:
                chain.graph.optimise(first=0, max_nfev=50)
        final = [None] * len(self.rows)
        for index, (chain, node, rel) in self.hang.items():
            if index < len(final) and self.rows[index][5].ok:
                estimate = self.chains[chain].graph.nodes[node] @ rel.inverse()
                final[index] = (estimate.scale, estimate.pose())
        return final

    @staticmethod
    def _rescaled(out: Any, image: Any, scale: float) -> tuple:
        return _rescaled_output(out, scale), image

    def _refuse(self, poses: tuple, regs: tuple, chains: tuple) -> None:
        """The kept frames fused again at the graph's poses (each chain's cloud anew)."""
        for chain in self.chains:
            if chain.cloud is not None:
                chain.cloud = VoxelCloud(chain.cloud.voxel_size)
        for (out, rgb), pose, reg, c in zip(self.kept, poses, regs, chains):
            cloud = self.chains[c].cloud
            if reg.ok and cloud is not None and cloud.voxel_size is not None:
                cloud.add(*frame_points(out, rgb, pose))

    def _calibrated(self, calibration: Calibration, index: int) -> None:
        """A calibration pass's result arrives with frame `index` (its first): its record, its level; the
        calibration is kept without the forwards (they are the producer's, dropped as it finishes them)."""
        self.calibrations.append(calibration.record())
        self.level = calibration.level
        self.running = dataclasses.replace(calibration, forwarded=None)
        if index == 0:
            self.depth_range = calibration.depth_range

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

    def _register(self, index: int, rgb: np.ndarray, out: Any) -> Optional[Registration]:
        """The frame's registration in the current chain, else in the earlier chains looked in (the one used last
        first): the first that finds it becomes the current chain. Else the current chain's failure. None (and
        `rewind` set, every tracker as before this frame) when an earlier chain found it but runs with other
        intrinsics than this frame did (`calibrate_chains`): the frame comes back, run with that chain's
        calibration, and is registered again (once: it is not sent back twice)."""
        before = [(c.tracker, c.tracker.counters()) for c in self.chains if c.tracker is not None]
        failed = self.tracker.register(rgb, out.depth, out.mask, out.intrinsics_pixels, frame=index)
        if failed.ok:
            return failed
        for chain in list(self.recent):
            registration = self.chains[chain].tracker.register(
                rgb, out.depth, out.mask, out.intrinsics_pixels, frame=index
            )
            if registration.ok:
                own = self.chains[chain].calibration
                if self.calibrate_chains and self._rewound != index and not _same_camera(own, self.running):
                    for tracker, counters in before:
                        tracker.rewind(counters)
                    self.rewind, self._rewound = Rewind(index, own), index
                    self.running, self.level = own, own.level
                    return None
                self._switch(chain)
                return registration
        if self.recent:
            failed.reason = f"{failed.reason}; not found in the {len(self.recent)} earlier chain(s) either"
        return failed

    def output(self, name: str, fps: Optional[float], seconds: dict) -> VideoOutput:
        if not self.rows:
            raise InputError("source: no frames")
        final = self._final()
        rows = []
        for row, record, done in zip(self.rows, self.records, final):
            if done is not None:  # the graph's: the applied scale and the pose change, the rest stays
                scale = row[4] * done[0]
                record["pose"] = [[round(float(v), 9) for v in r] for r in done[1]]
                record["scale"] = finite_or_none(scale)
                row = (row[0], row[1], done[1], scale, *row[4:])
            rows.append(row)
        source_frames, times, poses, scale, model_scale, regs, cameras, chains = zip(*rows)
        if self.kept:
            self.kept = [self._rescaled(o, i, s) for (o, i), s in zip(self.kept, scale)]
            self._refuse(poses, regs, chains)
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


def _rescaled_output(out: Any, scale: float) -> Any:
    """A kept frame's output at the applied scale `scale` (its depth and points rescaled in place)."""
    factor = scale / out.metric_scale
    if math.isfinite(factor) and factor != 1.0:
        out.depth *= np.float32(factor)
        out.points *= np.float32(factor)
        out = dataclasses.replace(out, metric_scale=scale)
    return out


def _same_camera(a: Calibration, b: Optional[Calibration]) -> bool:
    """Whether the real pass runs the same with either calibration: the same intrinsics where they were solved
    (given intrinsics or fov_x are the clip's, the same for every segment)."""
    if b is None or a.source != b.source:
        return False
    return a.source != "solved" or a.intrinsics == b.intrinsics


@takes_options("iter_video")
def iter_video(
    model: Any,
    source: Any,
    *,
    fit: str = "pad",
    fov_x: Optional[float] = None,
    apply_mask: bool = True,
    force_projection: bool = True,
    intrinsics: Any = None,
    stride: int = 1,
    max_frames: Optional[int] = None,
    calibration_frames: int = DEFAULT_CALIBRATION_FRAMES,
    window: Optional[int] = None,
    new_chain_after: int = DEFAULT_NEW_CHAIN_AFTER,
    calibrate_chains: bool = True,
    voxel_size: Optional[float] = None,
) -> VideoStream:
    """The frames of a clip as they are done (a `VideoStream` of `VideoFrame`s; `.result` afterwards): for clips
    that do not fit in memory. Options: those of `predict_video`."""
    given = locals()
    return VideoStream(model, source, CallOptions.of_arguments(given), VideoOptions.of_arguments(given))


@takes_options("predict_video")
def predict_video(
    model: Any,
    source: Any,
    *,
    fit: str = "pad",
    fov_x: Optional[float] = None,
    apply_mask: bool = True,
    force_projection: bool = True,
    intrinsics: Any = None,
    stride: int = 1,
    max_frames: Optional[int] = None,
    calibration_frames: int = DEFAULT_CALIBRATION_FRAMES,
    window: Optional[int] = None,
    new_chain_after: int = DEFAULT_NEW_CHAIN_AFTER,
    calibrate_chains: bool = True,
    voxel_size: Optional[float] = None,
) -> VideoOutput:
    """A clip -> VideoOutput with every frame's consistent MoGeOutput (`frames`), the clip's intrinsics, poses,
    per-frame scales and registration, and the fused cloud (see the module docstring).

    `source`: a video file (what OpenCV's FFmpeg reads), a folder of frames (name order), video bytes, an
    (N, H, W, 3) array or an iterable of images. Options: the call options of `model(image, ...)` (fit, fov_x,
    intrinsics, apply_mask, force_projection) and `VideoOptions` (stride, max_frames, calibration_frames,
    window, new_chain_after, calibrate_chains, voxel_size). `model`: anything with `predict_many` (see the module
    docstring)."""
    given = locals()
    call, video = CallOptions.of_arguments(given), VideoOptions.of_arguments(given)
    with VideoStream(model, source, call, video, keep_frames=True) as stream:
        for _ in stream:
            pass
        return stream.result

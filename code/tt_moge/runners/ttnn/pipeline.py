"""The device side of a call, pipelined: canvases go up, traces replay and maps come back while the host works.

`DevicePipeline.submit(canvas)` enqueues one call and returns at once (`Call`); `DevicePipeline.wait(call)` blocks
until its maps are on the host. Two slots, used in turn: each has its own device input per canvas dtype, its own
trace per dtype (captured on the dtype's first call, both slots at once) and its own persistent device outputs, all
allocated at load before any trace, so that no trace's intermediates can lie where another slot's input or outputs
live. Each trace ends by copying the raw maps and the class token into its slot's outputs; the host reads them into
recycled host tensors (`post.DeviceOutput.start_read`: preallocated, which ttnn pins for the read where it can).

With two command queues (worker dispatch), as tt-metal's "Ops on CQ0, input writes and output readback on CQ1"
(tech_reports/AdvancedPerformanceOptimizationsForModels, 2.3.3), with traces:

    CQ1:  W0  W1  wait T0  R0  W2  wait T1  R1  W3 ...      (W: upload, R: read-back)
    CQ0:  wait W0  T0  wait W1  T1  wait W2  T2 ...          (T: the trace)

The read of call i is enqueued by the next `submit` (after its upload: an upload waiting behind a read that waits
for the running trace would leave the chip idle between traces) or by `wait` when no call follows. The events order
every access to a slot: W(i) writes input i % 2 after R(i - 2) on the same queue, which came after T(i - 2) had
read it; T(i) waits for W(i), and so for R(i - 2), before it overwrites outputs i % 2; R(i) waits for T(i). The
chip runs T(i + 1) while the link carries R(i) and W(i + 2).

With one command queue (ETH dispatch, the P150's configuration) every command runs in order on it: W(i), T(i),
R(i), W(i + 1), ... The chip still waits for the link between traces, but `submit` returns at once and the host
prepares and finishes other images meanwhile.

At most `SLOTS` calls are in flight: `submit` first completes the call that used its slot before (a host wait for
its read, at once in steady state). numpy and the injected ttnn only (the mock check runs this without torch).
"""

from __future__ import annotations

import threading
from typing import Optional

import numpy as np

from .pre import INPUT_DTYPES

__all__ = ["Call", "DevicePipeline", "SLOTS"]

SLOTS = 2  # double-buffered: one call's trace runs while the other's canvas goes up and maps come down


class Call:
    """One submitted canvas: its slot, its events, and (once complete) its maps and class token."""

    def __init__(self, index: int, slot: int, kind: str):
        self.index, self.slot, self.kind = index, slot, kind
        self.computed = None  # event recorded on the compute queue after the trace (two queues only)
        self.read_enqueued = False
        self.done_event = None  # event recorded after the read
        self.reading = None  # post.DeviceOutput.start_read's handle
        self.cls_host = None  # the host tensor the class token is read into
        self.maps: Optional[dict] = None  # {head: numpy (n, H, W)} once complete
        self.cls_token: Optional[np.ndarray] = None

    @property
    def complete(self) -> bool:
        return self.maps is not None


class DevicePipeline:
    """Canvas in, raw maps out, two calls in flight (see the module docstring).

    ttnn: the ttnn module (or the emulator, or the mock check's proxy). device: the open device. graph: a loaded
    `graph.TtnnGraph` (`finest_tiles` set). pre, post: loaded `pre.DeviceInput`, `post.DeviceOutput`. queues: 1 or
    2 (the device must have been opened with that many). trace: capture and replay traces (False: every call runs
    the ops eagerly; the mock device cannot capture one)."""

    def __init__(self, ttnn, device, graph, pre, post, *, queues: int = 1, trace: bool = True):
        if queues not in (1, 2):
            raise ValueError(f"queues={queues!r}: one or two command queues")
        self.ttnn, self.device, self.graph, self.pre, self.post = ttnn, device, graph, pre, post
        self.queues, self.trace = queues, trace
        self.read_queue = 1 if queues == 2 else 0
        T = ttnn
        # allocated before any trace is captured: no trace's intermediates can lie where these live
        self.inputs = {(kind, s): pre.allocate_input(kind) for kind in INPUT_DTYPES for s in range(SLOTS)}
        self.outputs = [post.allocate_outputs() for _ in range(SLOTS)]
        dim = graph.plan["dim"]
        cls_dtype = getattr(T, graph.formats.residual)  # the class token's format (the residual stream's)
        self.cls = [
            T.allocate_tensor_on_device(T.Shape([1, 1, 1, dim]), cls_dtype, T.TILE_LAYOUT, device, T.DRAM_MEMORY_CONFIG)
            for _ in range(SLOTS)
        ]
        self._cls_host = [
            T.Tensor(np.zeros((1, 1, 1, dim), np.float32), cls_dtype, None, T.TILE_LAYOUT) for _ in range(SLOTS)
        ]
        self.traces: dict = {}  # (canvas dtype, slot) -> trace id
        self._calls = 0
        self._in_flight: list = []  # submitted calls not yet complete, oldest first
        self._unread: Optional[Call] = None  # two queues: the last call, whose read the next submit enqueues
        self._lock = threading.RLock()

    # ------------------------------------------------------------------------------------------ calls
    def forward_ops(self, kind: str, slot: int) -> None:
        """The device forward of slot `slot`'s `kind` input into its outputs: the input side, the network, the
        output side, the class token copied out (what a trace holds)."""
        T = self.ttnn
        out = self.graph.forward(self.pre.forward(self.inputs[kind, slot]))
        self.post.forward(out["finest"], into=self.outputs[slot])
        T.copy(out["cls_token"], self.cls[slot])
        T.deallocate(out["cls_token"])

    def _capture(self, kind: str) -> None:
        """Both slots' traces of `kind`, on the compute queue, with nothing in flight."""
        T = self.ttnn
        T.synchronize_device(self.device)
        for slot in range(SLOTS):
            trace_id = T.begin_trace_capture(self.device, cq_id=0)
            self.forward_ops(kind, slot)
            T.end_trace_capture(self.device, trace_id, cq_id=0)
            self.traces[kind, slot] = trace_id

    def submit(self, canvas: np.ndarray) -> Call:
        """Enqueue one canvas (1, 3, H, W), uint8 (0..255) or float32 (in [0, 1]); returns before the forward
        ends. The canvas's bytes are copied into a host tensor here: the caller may reuse its array at once."""
        T = self.ttnn
        kind = self.pre.input_dtype(canvas)
        with self._lock:
            self._make_room()
            slot = self._calls % SLOTS
            call = Call(self._calls, slot, kind)
            self._calls += 1
            if self.trace and (kind, 0) not in self.traces:
                self._capture(kind)
            write_queue = self.read_queue
            self.pre.upload(canvas, into=self.inputs[kind, slot], cq_id=write_queue)
            if self.queues == 2:
                T.wait_for_event(0, T.record_event(self.device, write_queue))
            if self.trace:
                T.execute_trace(self.device, self.traces[kind, slot], cq_id=0, blocking=False)
            else:
                self.forward_ops(kind, slot)
            self._in_flight.append(call)
            if self.queues == 2:
                call.computed = T.record_event(self.device, 0)
                previous, self._unread = self._unread, call
                if previous is not None:  # behind this call's upload on the link's queue (module docstring)
                    self._enqueue_read(previous)
            else:
                self._enqueue_read(call)
            return call

    def _enqueue_read(self, call: Call) -> None:
        T, q = self.ttnn, self.read_queue
        if self.queues == 2:
            T.wait_for_event(q, call.computed)
        call.reading = self.post.start_read(self.outputs[call.slot], cq_id=q)
        call.cls_host = self._cls_host[call.slot]
        T.copy_device_to_host_tensor(self.cls[call.slot], call.cls_host, blocking=False, cq_id=q)
        call.done_event = T.record_event(self.device, q)
        call.read_enqueued = True

    def _make_room(self) -> None:
        """Complete the oldest calls until a slot is free (the one the next call takes)."""
        while len(self._in_flight) >= SLOTS:
            self._complete(self._in_flight[0])

    def _complete(self, call: Call) -> None:
        """Wait for the call's read and take its maps and class token off the recycled host tensors. Under the
        pipeline's lock (one lock: a wait and a submit never hold two)."""
        T = self.ttnn
        with self._lock:
            if call.complete:
                return
            if not call.read_enqueued:
                self._enqueue_read(call)
                if self._unread is call:
                    self._unread = None
            T.event_synchronize(call.done_event)
            host = T.to_layout(call.cls_host, T.ROW_MAJOR_LAYOUT)
            if host.dtype != T.float32:
                host = T.to_dtype(host, T.float32)
            # copies: the slot's class-token host tensor is read into again two calls later
            call.cls_token = np.array(host.to_numpy(), dtype=np.float32).reshape(-1)
            call.maps = self.post.finish_read(call.reading)
            call.reading = call.cls_host = None
            self._in_flight.remove(call)

    def wait(self, call: Call) -> tuple:
        """The call's ({head: numpy (n, H, W)}, class token (dim,) float32), once on the host."""
        self._complete(call)
        return call.maps, call.cls_token

    def is_complete(self, call: Call) -> bool:
        return call.complete

    # ------------------------------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Wait for everything in flight, release the traces and the slots' device buffers."""
        T = self.ttnn
        with self._lock:
            T.synchronize_device(self.device)
            for trace_id in self.traces.values():
                T.release_trace(self.device, trace_id)
            self.traces = {}
            for tensor in list(self.inputs.values()) + self.cls + [t for o in self.outputs for t in o.values()]:
                T.deallocate(tensor)
            self.inputs, self.cls, self.outputs, self._in_flight, self._unread = {}, [], [], [], None

"""The video path's calls of its model, with the clip's call options parsed once (`host.CallOptions`).

A clip's options are validated when it starts (`predict_video` / `iter_video`, the command line, the server's
query); the calibration passes and every chunk of the real pass then call the model with that `CallOptions` (or
a copy with a field replaced: the calibration's `apply_mask` / `force_projection` off, a segment's solved
intrinsics), never parsing keyword arguments again:

* a model whose `service` takes a `CallOptions` (`predict_many(images, options)`, `forward_many`,
  `finish_many`: MoGeModel's `PredictionService`, ModelPool's `PoolService`, the stand-in
  `testing.video.VideoOracle`'s) is called there;
* any other model, anything with `predict_many(images, **options)` (docs/video.md), gets them as keyword
  arguments (`CallOptions.kwargs()`), which it parses itself; its `forward_many` / `finish_many` too, where it has
  both.
"""

from __future__ import annotations

from typing import Any

from ..host import CallOptions

__all__ = ["ModelCalls"]

_MANY = ("predict_many", "forward_many", "finish_many")


class ModelCalls:
    """`model`'s predict_many / forward_many / finish_many, each taking a validated `CallOptions` (see the module
    docstring). `keeps_forwards`: the model has forward_many and finish_many (the calibration frames' forwards
    can be kept and finished again, not run twice)."""

    def __init__(self, model: Any):
        self.model = model
        service = getattr(model, "service", None)
        self.service = service if all(callable(getattr(service, name, None)) for name in _MANY) else None
        self.keeps_forwards = self.service is not None or all(hasattr(model, name) for name in _MANY[1:])

    def _call(self, name: str, items: list, options: CallOptions) -> list:
        if self.service is not None:
            return getattr(self.service, name)(items, options)
        return getattr(self.model, name)(items, **options.kwargs())

    def predict_many(self, images: list, options: CallOptions) -> list:
        return self._call("predict_many", images, options)

    def forward_many(self, images: list, options: CallOptions) -> list:
        return self._call("forward_many", images, options)

    def finish_many(self, forwarded: list, options: CallOptions) -> list:
        return self._call("finish_many", forwarded, options)

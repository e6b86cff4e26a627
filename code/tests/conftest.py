"""Shared fixtures: random-weight checkpoints in the upstream format, written once per test session."""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest

from . import background

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network
# CPU kernel choices of this test session (and of the servers it starts) in a file of their own
os.environ.setdefault("MOGE_KERNEL_CACHE", os.path.join(tempfile.mkdtemp(prefix="tt_moge-kernels-"), "kernels.json"))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(preset, **make_network_kwargs) -> path of a model.pt, cached per arguments."""
    from tt_moge.testing import make_checkpoint

    cache: dict = {}

    def get(preset: str = "tiny-vits-normal", **kwargs):
        key = (preset, tuple(sorted(kwargs.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(preset)
            cache[key] = make_checkpoint(folder, preset, **kwargs)
        return cache[key]

    return get


TEST_CANVAS = (448, 252)  # small 16:9 canvas: the API tests run in seconds on 2 cores
TEST_TOKENS = 1200


@pytest.fixture(scope="session")
def tiny_model(checkpoint):
    """A loaded tiny model (ViT-S backbone, 4 blocks used) on a small canvas, shared by the API tests.

    precision="fp32": the reference network, so that the host tests see the same raw maps on every machine
    ("auto" is bf16 only on CPUs with bfloat16 instructions); the bf16 path is tested in test_runners.py."""
    from tt_moge import MoGeModel

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # loading with an explicit device must not warn
        model = MoGeModel.from_pretrained(
            checkpoint("tiny-vits-normal"),
            device="cpu",
            resolution=TEST_CANVAS,
            num_tokens=TEST_TOKENS,
            warmup=1,
            warmup_variants="none",
            precision="fp32",
        )
    yield model
    model.close()


@pytest.fixture(scope="session")
def upstream():
    """upstream(path) -> microsoft/MoGe's own MoGeModel (PyPI dlr-moge) loaded from that checkpoint, eval mode.

    Upstream loads with strict=False; we check that nothing was skipped. The last two models are cached.
    """
    from collections import OrderedDict

    import moge.model.v2 as upstream_v2  # the oracle: pip install --no-deps dlr-moge==2.0.0 dlr-utils3d==1.3

    from tt_moge.weights import read_checkpoint

    cache: OrderedDict = OrderedDict()

    def get(path):
        key = str(path)
        if key not in cache:
            model = upstream_v2.MoGeModel.from_pretrained(key).eval()
            _, state = read_checkpoint(path)
            missing, unexpected = model.load_state_dict(state, strict=False)
            assert not missing and not unexpected
            cache[key] = model
            while len(cache) > 2:
                cache.popitem(last=False)
        return cache[key]

    return get


_LEAKS: list = []  # (test, what it changed) for the session's summary
_WATCHED_ENV = ("MOGE_CPU_THREADS", "MOGE_HOST", "MOGE_SERVE_THREADS", "OMP_NUM_THREADS")


def _process_settings() -> dict:
    """The process-wide settings that change a model's last bits (see `_settings_restored`)."""
    import torch

    from tt_moge import native

    settings = {"torch threads": torch.get_num_threads(), "host path override": native._override}
    if native._lib is not None:  # read only: never build the library here
        settings["native threads"] = int(native._lib.moge_threads())
    settings.update({name: os.environ.get(name) for name in _WATCHED_ENV})
    return settings


@pytest.fixture(autouse=True)
def _settings_restored(request):
    """Each test starts with the process settings the one before it started with. A model's float sums depend on
    torch's thread count at its load (and the native kernels' count), so a test that leaves another count behind
    changes the last bits of every model loaded after it: a comparison of two routes to one answer then fails far
    from its cause. A leak is undone here and named in the session's summary."""
    before = _process_settings()
    yield
    after = _process_settings()
    changed = {k: (before[k], after[k]) for k in before if k in after and before[k] != after[k]}
    if changed:  # (the native library loaded during the test is not a change)
        import torch

        from tt_moge import native

        _LEAKS.append((request.node.nodeid, changed))
        torch.set_num_threads(before["torch threads"])
        native._override = before["host path override"]
        if "native threads" in before and native._lib is not None:
            native._lib.moge_set_threads(before["native threads"])
        for name in _WATCHED_ENV:
            if before[name] is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before[name]


def pytest_collection_finish(session):
    """Start the subprocess checks that the selected tests will ask for (tests/background.py)."""
    runs: dict = {}
    modules = {getattr(item, "module", None) for item in session.items}
    for module in modules:
        if hasattr(module, "background_runs"):
            runs.update(module.background_runs([i for i in session.items if getattr(i, "module", None) is module]))
    background.start(runs)


def pytest_sessionfinish(session):
    background.stop()


def pytest_terminal_summary(terminalreporter):
    """How the background runs were used (tests/background.py), when there were any."""
    for nodeid, changed in _LEAKS:
        terminalreporter.write_line(f"process settings left changed (undone) by {nodeid}: {changed}")
    if background.tally():
        counts = ", ".join(f"{n} {what}" for what, n in sorted(background.tally().items()))
        terminalreporter.write_line(f"background runs: {counts}")

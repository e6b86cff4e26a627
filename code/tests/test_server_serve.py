"""Serving.serve: the one receive / admit / run path of /predict, /predict/panorama and /predict/video.

Whatever ends a request (a refused cost, a failing job, a request cancelled while it waits for a host thread,
a server that stops), the memory budget and the queue slot come back and an upload held on disk is discarded
exactly once. These run the method itself on a Serving with one host thread and a fake upload, so each way
out is reached on purpose; the routes' own tests (test_server, test_video_surfaces) cover the same path over
HTTP."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("fastapi")

from tt_moge.server.errors import ApiError  # noqa: E402
from tt_moge.server.serving import Serving  # noqa: E402
from tt_moge.server.settings import ServerSettings  # noqa: E402

BODY = 1000  # bytes the fake body reserves while it arrives
COST = 5000  # bytes the request is admitted at


@pytest.fixture
def serving():
    s = Serving(ServerSettings(host_threads=1))
    s.model = object()  # admit() only asks whether a model is loaded
    yield s
    s.executor.shutdown(wait=True, cancel_futures=True)


class Upload:
    """A fake upload that counts its discards."""

    def __init__(self):
        self.read_ms = 1.5
        self.discarded = 0

    def discard(self) -> None:
        self.discarded += 1


def serve(serving: Serving, upload: Upload, cost=lambda u: COST, job=lambda u, timing, reservation: "payload"):
    async def receive(reserve):
        reserve(BODY)
        return upload

    return serving.serve(receive, cost, job, Upload.discard)


def settled(serving: Serving) -> bool:
    return serving.budget.used == 0 and serving.in_flight == 0


def test_a_served_request_holds_its_cost_until_answered_and_times_its_stages(serving):
    upload = Upload()
    seen = {}

    def job(u, timing, reservation):
        seen["used"], seen["in_flight"], seen["thread"] = (
            serving.budget.used,
            serving.in_flight,
            threading.current_thread().name,
        )
        timing["work"] = 1.0
        return ("done", u)

    done = asyncio.run(serve(serving, upload, job=job))
    assert done.payload == ("done", upload)
    assert seen == {"used": COST, "in_flight": 1, "thread": seen["thread"]} and seen["thread"].startswith(
        "tt_moge-serve"
    )
    assert set(done.timing) == {"read", "queue", "work", "total"} and done.timing["read"] == 1.5
    assert upload.discarded == 1  # the work has ended: the file is no longer needed
    assert serving.budget.used == COST and serving.in_flight == 1  # still held: the answer is not sent yet
    done.ticket.done("answer")
    assert settled(serving)


def test_a_refused_cost_releases_the_body_and_discards(serving):
    upload = Upload()

    def refuse(u):
        assert serving.budget.used == BODY  # the body was held while it arrived
        raise ApiError(413, "too_large", "never fits")

    with pytest.raises(ApiError, match="never fits"):
        asyncio.run(serve(serving, upload, cost=refuse))
    assert upload.discarded == 1 and settled(serving)


def test_a_cost_over_the_budget_is_a_503_that_releases_everything(serving):
    upload = Upload()
    with pytest.raises(ApiError) as err:
        asyncio.run(serve(serving, upload, cost=lambda u: serving.budget.limit + 1))
    assert err.value.status == 503 and err.value.code == "memory_full"
    assert upload.discarded == 1 and settled(serving)


def test_a_failing_job_releases_everything_and_discards(serving):
    upload = Upload()

    def job(u, timing, reservation):
        raise ApiError(400, "bad_video", "broken")

    with pytest.raises(ApiError, match="broken"):
        asyncio.run(serve(serving, upload, job=job))
    assert upload.discarded == 1 and settled(serving)


def test_a_request_cancelled_while_it_waits_for_the_host_thread_never_runs_and_still_discards(serving):
    """The one host thread is busy; the waiting request is cancelled (its client left): its job must never run,
    its upload must be discarded and its slot and bytes returned once the busy thread frees."""
    busy, release = threading.Event(), threading.Event()
    upload, ran = Upload(), []

    async def scenario():
        serving.executor.submit(lambda: (busy.set(), release.wait(10)))
        assert await asyncio.to_thread(busy.wait, 10)
        task = asyncio.create_task(serve(serving, upload, job=lambda u, t, r: ran.append(u)))
        while serving.in_flight == 0:  # admitted, now queued behind the busy thread
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    release.set()
    serving.executor.submit(lambda: None).result(10)  # the thread has moved past the cancelled job
    assert ran == [] and upload.discarded == 1 and settled(serving)


def test_a_stopped_server_releases_everything_and_discards(serving):
    upload = Upload()
    serving.executor.shutdown(wait=True)
    with pytest.raises(RuntimeError):
        asyncio.run(serve(serving, upload))
    assert upload.discarded == 1 and settled(serving)

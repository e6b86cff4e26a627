"""The web page in a real browser: headless Chromium (selenium) against a real `python -m tt_moge.server` on
127.0.0.1 with a random-weight tiny checkpoint and an API key.

It opens the page, enters the key (the page asks for it), uploads media/source.png and checks that the depth,
normal and mask images and the 3D view are shown (a screenshot of the canvas is not blank, and changes when
dragged and zoomed), that the numbers on the page equal POST /predict/summary for the same image, that the npz
the browser downloads equals POST /predict bit for bit, that everything the page loaded came from the server
itself, and that a corrupt and a too-large upload show the API's error while the server keeps serving; when the
server stops, its result folder is gone.

MOGE_UI_SCREENSHOT=PATH saves a screenshot of the page with the result (docs/web-ui.png).
The test is skipped without selenium or Chromium, unless MOGE_BROWSER_TESTS=required (.ci/run sets it).
Run: cd code && python -m pytest tests/test_ui_browser.py -q
"""

from __future__ import annotations

import io
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

REQUIRED = os.environ.get("MOGE_BROWSER_TESTS") == "required"
if not REQUIRED:
    pytest.importorskip("selenium")
    pytest.importorskip("fastapi")

import httpx  # noqa: E402

from tt_moge.testing.browser import canvas_pixels, find_chromium, start_chromium, wait_for_download  # noqa: E402

from .server_harness import ServerProcess  # noqa: E402

if find_chromium() is None:
    if REQUIRED:
        raise RuntimeError(
            "MOGE_BROWSER_TESTS=required but no Chromium + chromedriver: apt-get install chromium chromium-driver"
        )
    pytest.skip("no Chromium + chromedriver (apt-get install chromium chromium-driver)", allow_module_level=True)

from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.actions.wheel_input import ScrollOrigin  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

SOURCE = Path(__file__).resolve().parents[2] / "media" / "source.png"
# Non-ASCII, as a person may choose one: "é" is Latin-1 (a browser sent it as the single byte 0xE9: 401), the
# rest is not (a browser refuses such a header: the run failed in the page). The page sends it percent-encoded.
KEY = "clé-東京-browser-test"
# 1920x1080 fits (2.07 MP); the too-large test image does not.
FLAGS = ["--queue-size", "2", "--host-threads", "2", "--max-pixels", "2500000", "--max-body-mb", "8"]
BACKGROUND = np.array([240, 240, 242])  # the view's clear colour (viewer.js)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tt_moge.testing import make_checkpoint

    folder = tmp_path_factory.mktemp("ui-browser")
    temp = folder / "tmp"
    temp.mkdir()
    weights = make_checkpoint(folder / "weights", "tiny-vits-normal", well_posed=True)
    proc = ServerProcess(weights, FLAGS, env={"MOGE_API_KEY": KEY, "TMPDIR": str(temp)})
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
    assert not list(temp.glob("tt_moge-ui-*")), "the page's result folder outlived the server"


@pytest.fixture(scope="module")
def downloads(tmp_path_factory):
    return tmp_path_factory.mktemp("downloads")


@pytest.fixture(scope="module")
def browser(downloads):
    session = start_chromium(downloads, size=(1400, 1000))
    yield session
    session.quit()


@pytest.fixture(scope="module")
def api(server):
    authorization = b"Bearer " + KEY.encode("utf-8")  # as curl sends it (httpx takes a non-ASCII header as bytes)
    with httpx.Client(base_url=server.url, headers={"Authorization": authorization}, timeout=120) as client:
        yield client


def click_at(browser, element, dx: float, dy: float) -> None:
    """A click dx, dy CSS pixels from the element's centre, with the element scrolled to the middle of the window
    first, as a person would scroll to it: an earlier test may have left the page where the point is off-screen."""
    browser.execute_script("arguments[0].scrollIntoView({block: 'center', inline: 'center'})", element)
    ActionChains(browser).move_to_element_with_offset(element, round(dx), round(dy)).click().perform()


def drawn(pixels: np.ndarray) -> np.ndarray:
    """(H, W) bool: the view's pixels that differ from its clear colour (something was drawn there)."""
    return np.abs(pixels.astype(np.int16) - BACKGROUND).max(axis=2) > 24


def redrawn(browser, canvas, act) -> np.ndarray:
    """The view's pixels (int16) after `act` and the frame it causes."""
    frames = int(canvas.get_attribute("data-frames"))
    act()
    WebDriverWait(browser, 10).until(lambda b: int(canvas.get_attribute("data-frames")) > frames)
    time.sleep(0.3)
    return canvas_pixels(canvas).astype(np.int16)


def state(browser) -> str:
    return browser.find_element(By.TAG_NAME, "body").get_attribute("data-state")


def upload(browser, path: Path, timeout_s: float = 120) -> str:
    """Choose a file in the page (it runs at once) and wait for the run to end -> "done" or "error"."""
    runs = browser.execute_script("return window.ttMoge.runs")
    browser.find_element(By.ID, "file").send_keys(str(path))
    WebDriverWait(browser, timeout_s).until(lambda b: b.execute_script("return window.ttMoge.runs") > runs)
    return state(browser)


def console_errors(browser) -> list:
    """Script errors (not the network lines Chromium logs for the 4xx answers the tests ask for)."""
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE" and e.get("source") != "network"]


@pytest.fixture(scope="module")
def result_page(server, browser):
    """The page showing the result of media/source.png, reached as a person would: no key -> asked for one; the
    (non-ASCII) key typed into the page's field is accepted."""
    browser.get(server.url + "/")
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "server-status").text == "ready")
    assert browser.find_element(By.ID, "key-row").is_displayed()  # the page asks for the key this server needs
    assert upload(browser, SOURCE) == "error"
    assert "API key" in browser.find_element(By.ID, "error").text
    browser.find_element(By.ID, "api-key").send_keys(KEY)
    browser.find_element(By.ID, "run").click()
    WebDriverWait(browser, 120).until(lambda b: state(b) in ("done", "error"))
    assert state(browser) == "done", browser.find_element(By.ID, "error").text
    if os.environ.get("MOGE_UI_SCREENSHOT"):  # the picture in docs/web-ui.md: the whole page, the view turned a little
        canvas = browser.find_element(By.ID, "view")
        ActionChains(browser).move_to_element(canvas).click_and_hold().move_by_offset(-140, -50).release().perform()
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1400, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        time.sleep(0.5)
        browser.save_screenshot(os.environ["MOGE_UI_SCREENSHOT"])
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        ActionChains(browser).double_click(canvas).perform()  # back to the photo's own camera
        time.sleep(0.3)
    return browser


def test_maps_and_an_interactive_3d_view_are_shown(result_page):
    browser = result_page
    for name in ("depth", "normal", "mask"):
        WebDriverWait(browser, 30).until(
            lambda b: b.execute_script(
                f"const i = document.getElementById('{name}'); return i.complete && i.naturalWidth > 0"
            )
        )
        assert browser.find_element(By.ID, name).is_displayed(), name
    sizes = browser.execute_script(
        "return ['depth', 'normal', 'mask'].map(id => "
        "[document.getElementById(id).naturalWidth, document.getElementById(id).naturalHeight])"
    )
    assert sizes[1] == sizes[2] == [1920, 1080] and sizes[0][1] == 1080 and sizes[0][0] > 1920  # depth: + colour bar

    canvas = browser.find_element(By.ID, "view")
    assert not browser.find_element(By.ID, "view-message").is_displayed()
    first = canvas_pixels(canvas).astype(np.int16)
    off_background = drawn(first).mean()
    assert off_background > 0.5, f"the 3D view is blank: {off_background:.0%} of it differs from the background"
    assert first.std() > 20 and len(np.unique(first.reshape(-1, 3), axis=0)) > 500  # a textured picture, not a fill

    def changed_after(act) -> float:
        before = canvas_pixels(canvas).astype(np.int16)
        return float(np.abs(redrawn(browser, canvas, act) - before).mean())

    orbit = changed_after(
        lambda: (
            ActionChains(browser).move_to_element(canvas).click_and_hold().move_by_offset(150, 60).release().perform()
        )
    )
    zoom = changed_after(
        lambda: ActionChains(browser).scroll_from_origin(ScrollOrigin.from_element(canvas), 0, 400).perform()
    )
    assert orbit > 5 and zoom > 5, (orbit, zoom)
    ActionChains(browser).double_click(canvas).perform()  # back to the photo's own camera
    assert console_errors(browser) == []


def test_the_3d_view_draws_the_points_alone_on_request(result_page):
    """'points only' draws the photo's mesh as its vertices: close up, the background shows between the dots where
    the triangles covered it; unticked, the same view is the mesh again, pixel for pixel."""
    browser = result_page
    canvas, box = browser.find_element(By.ID, "view"), browser.find_element(By.ID, "view-points")
    assert browser.find_element(By.ID, "view-points-row").is_displayed() and not box.is_selected()

    def background(pixels: np.ndarray) -> float:
        return float(1 - drawn(pixels).mean())

    def reset() -> None:  # the photo's own camera
        redrawn(browser, canvas, lambda: ActionChains(browser).double_click(canvas).perform())

    reset()
    closer = ActionChains(browser).scroll_from_origin(ScrollOrigin.from_element(canvas), 0, -1500)
    mesh = redrawn(browser, canvas, closer.perform)
    points = redrawn(browser, canvas, box.click)
    assert canvas.get_attribute("data-mode") == "points"
    assert background(points) > background(mesh) + 0.2, (background(points), background(mesh))
    dots = points[drawn(points)]
    assert len(dots) > 0.01 * points.shape[0] * points.shape[1] and len(np.unique(dots, axis=0)) > 100  # the photo's
    again = redrawn(browser, canvas, box.click)
    assert canvas.get_attribute("data-mode") == "mesh" and np.array_equal(again, mesh)
    reset()
    assert console_errors(browser) == []


def test_numbers_on_the_page_equal_predict_summary(result_page, api):
    browser = result_page
    expected = api.post("/predict/summary", content=SOURCE.read_bytes(), headers={"Content-Type": "image/png"}).json()
    shown = json.loads(browser.execute_script("return document.getElementById('summary-json').textContent"))
    assert {k: v for k, v in shown.items() if k != "timing_ms"} == {
        k: v for k, v in expected.items() if k != "timing_ms"
    }
    rows = {
        row.get_attribute("data-key"): (json.loads(row.get_attribute("data-value")), row.text)
        for row in browser.find_elements(By.CSS_SELECTOR, "#numbers-table tr")
    }
    for key in ("fov_x_deg", "fov_y_deg", "metric_scale", "median_depth_m", "valid_fraction"):
        assert rows[key][0] == expected[key], key
    assert rows["size"][0] == [1920, 1080]
    assert f"{expected['fov_x_deg']:.1f}°" in rows["fov_x_deg"][1]
    assert f"{expected['median_depth_m']:.2f} m" in rows["median_depth_m"][1]
    assert f"{100 * expected['valid_fraction']:.1f} %" in rows["valid_fraction"][1]
    assert set(rows["timing"][0]) == set(expected["timing_ms"])


def test_two_clicks_on_a_map_measure_the_distance_of_predict_points(result_page, api):
    """Clicking two pixels of the depth map shows their depths and the distance between their 3D points: those of
    POST /predict's arrays at the pixels the page reports; the marks are drawn on every map; a third click
    starts a new pair, and a click on the colour bar is no pixel."""
    import cv2

    from tt_moge import MoGeOutput

    browser = result_page
    out = MoGeOutput.from_npz(
        api.post("/predict", content=SOURCE.read_bytes(), headers={"Content-Type": "image/png"}).content
    )
    inside = cv2.erode(out.mask.astype(np.uint8), np.ones((41, 41), np.uint8)) > 0  # valid well around the click
    rows, cols = np.nonzero(inside)
    assert len(rows) > 10000
    targets = [(int(cols[i]), int(rows[i])) for i in (len(rows) // 5, 4 * len(rows) // 5)]
    img = browser.find_element(By.ID, "depth")
    size = browser.execute_script(
        "const i = arguments[0]; return [i.clientWidth, i.clientHeight, i.naturalWidth, i.naturalHeight]", img
    )
    text = browser.find_element(By.ID, "measure-text")

    def click(x: float, y: float) -> None:  # at photo pixel (x, y); selenium's offsets are from the centre
        dx, dy = ((x + 0.5) * size[0] / size[2] - size[0] / 2), ((y + 0.5) * size[1] / size[3] - size[1] / 2)
        click_at(browser, img, dx, dy)

    def picked() -> list:
        return json.loads(text.get_attribute("data-pixels"))

    assert browser.find_element(By.ID, "measure").is_displayed()
    for x, y in targets:
        click(x, y)
    WebDriverWait(browser, 30).until(lambda b: text.get_attribute("data-distance"))
    pixels = picked()
    per_css_px = size[2] / size[0]  # photo pixels per CSS pixel of the shown map
    for (x, y), (px, py) in zip(targets, pixels):
        assert abs(px - x) <= per_css_px + 1 and abs(py - y) <= per_css_px + 1, (targets, pixels)
    a, b = (out.points[py, px].astype(np.float64) for px, py in pixels)
    expected = float(np.linalg.norm(a - b))
    assert expected > 0.01
    assert float(text.get_attribute("data-distance")) == pytest.approx(expected, rel=1e-9)
    assert f"A to B: {expected:.3f} m" in text.text
    for (px, py), label in zip(pixels, "AB"):
        assert f"{label} at ({px}, {py}): depth {out.depth[py, px]:.3f} m" in text.text
    for name in ("depth", "normal", "mask"):  # the marks on every map
        marks = browser.find_elements(By.CSS_SELECTOR, f"#{name} + svg circle, #{name} + svg line")
        assert len(marks) == 3, name

    click(size[2] - 5, size[3] / 2)  # the colour bar right of the photo: not a pixel, nothing changes
    time.sleep(0.3)
    assert picked() == pixels
    click(*targets[0])  # a third point starts a new pair
    WebDriverWait(browser, 30).until(lambda b: len(picked()) == 1 and "Click a second point" in text.text)
    assert not text.get_attribute("data-distance")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#depth + svg circle")) == 1
    assert console_errors(browser) == []


def first_view_ndc(points: np.ndarray, fov_y_deg: float, width: int, height: int) -> tuple:
    """(x, y) in [-1, 1], y down, where camera-space points are drawn in the 3D view's first frame: a pinhole at
    the origin looking forward with the given vertical field of view, on a width x height canvas."""
    f = 1 / np.tan(np.radians(fov_y_deg) / 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        return f * height / width * points[..., 0] / points[..., 2], f * points[..., 1] / points[..., 2]


def view_step(browser) -> int:
    """The 3D view mesh's grid step in photo pixels, from the line under the view."""
    return int(re.search(r"a vertex per (\d+)×", browser.find_element(By.ID, "view-info").text).group(1))


def test_clicks_on_the_3d_view_measure_the_pixels_under_them(result_page, api):
    """From the first view (the photo's own camera), a click where a pixel's 3D point is drawn picks that pixel
    (within the view mesh's grid step), the page measures there as on the maps (predict's points at the picked
    pixels) and marks both points in the view; a drag and a double click pick nothing."""
    import cv2

    from tt_moge import MoGeOutput

    browser = result_page
    out = MoGeOutput.from_npz(
        api.post("/predict", content=SOURCE.read_bytes(), headers={"Content-Type": "image/png"}).content
    )
    summary = api.post("/predict/summary", content=SOURCE.read_bytes(), headers={"Content-Type": "image/png"}).json()
    inside = cv2.erode(out.mask.astype(np.uint8), np.ones((61, 61), np.uint8)) > 0  # valid well around the click
    rows, cols = np.nonzero(inside)
    targets = [(int(cols[i]), int(rows[i])) for i in (len(rows) // 4, 3 * len(rows) // 4)]
    canvas = browser.find_element(By.ID, "view")
    width, height = browser.execute_script("return [arguments[0].clientWidth, arguments[0].clientHeight]", canvas)
    text = browser.find_element(By.ID, "measure-text")

    def screen(x: int, y: int) -> tuple:  # CSS offset from the canvas centre where pixel (x, y)'s point is drawn
        sx, sy = first_view_ndc(out.points[y, x].astype(np.float64), summary["fov_y_deg"], width, height)
        return round(sx * width / 2), round(sy * height / 2)  # the first view: from the camera, the photo's fov_y

    def click(x: int, y: int) -> None:
        click_at(browser, canvas, *screen(x, y))

    def picked() -> list:
        return json.loads(text.get_attribute("data-pixels") or "[]")

    before = picked()
    click(*targets[0])  # reported after the double-click interval
    WebDriverWait(browser, 30).until(lambda b: picked() != before)
    if len(picked()) != 1:  # a pick left by the test before: this click completed its pair; start a new one
        click(*targets[0])
        WebDriverWait(browser, 30).until(lambda b: len(picked()) == 1)
    click(*targets[1])
    WebDriverWait(browser, 30).until(lambda b: len(picked()) == 2 and text.get_attribute("data-distance"))
    pixels = picked()
    step = view_step(browser)
    tolerance = step + 1920 / width + 1  # the mesh's grid, and one CSS pixel of the view in photo pixels
    for (x, y), (px, py) in zip(targets, pixels):
        assert abs(px - x) <= tolerance and abs(py - y) <= tolerance, (targets, pixels, tolerance)
    a, b = (out.points[py, px].astype(np.float64) for px, py in pixels)
    assert float(text.get_attribute("data-distance")) == pytest.approx(float(np.linalg.norm(a - b)), rel=1e-9)
    assert canvas.get_attribute("data-marks") == "2"

    ActionChains(browser).move_to_element(canvas).click_and_hold().move_by_offset(80, 30).release().perform()
    ActionChains(browser).double_click(canvas).perform()
    time.sleep(0.8)
    assert picked() == pixels  # neither the drag nor the double click picked
    assert console_errors(browser) == []


def test_downloaded_npz_equals_predict_bit_for_bit(result_page, api, downloads):
    browser = result_page
    browser.find_element(By.CSS_SELECTOR, "#download-buttons button[data-file='result.npz']").click()
    path = wait_for_download(downloads, "source.npz")
    expected = api.post("/predict", content=SOURCE.read_bytes(), headers={"Content-Type": "image/png"})
    assert expected.status_code == 200
    assert path.read_bytes() == expected.content


def test_the_page_loads_nothing_from_elsewhere(result_page, server):
    names = result_page.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert names and all(n.startswith(server.url + "/") or n.startswith(("blob:", "data:")) for n in names), names


def test_bad_uploads_show_the_api_error_and_the_server_keeps_serving(result_page, api, server, tmp_path):
    browser = result_page
    corrupt = tmp_path / "corrupt.png"
    data = SOURCE.read_bytes()
    corrupt.write_bytes(data[: len(data) // 2])  # the header is fine: refused when decoding fails
    api_error = api.post("/predict", content=corrupt.read_bytes(), headers={"Content-Type": "image/png"}).json()
    assert upload(browser, corrupt) == "error"
    shown = browser.find_element(By.ID, "error").text
    assert api_error["code"] == "bad_image" and api_error["code"] in shown and api_error["detail"] in shown, shown
    assert not browser.find_element(By.ID, "numbers").is_displayed()  # the old result is not left on show

    from PIL import Image

    large = tmp_path / "large.png"
    Image.new("RGB", (2000, 1300)).save(large)  # 2.6 MP, over --max-pixels 2500000
    api_error = api.post("/predict", content=large.read_bytes(), headers={"Content-Type": "image/png"}).json()
    assert upload(browser, large) == "error"
    shown = browser.find_element(By.ID, "error").text
    assert shown.startswith("Too large:") and api_error["detail"] in shown, shown

    assert api.get("/health").json()["status"] == "ok"
    assert upload(browser, SOURCE) == "done"  # and the page works again


def test_a_2_to_1_image_runs_as_a_panorama_with_the_apis_numbers(result_page, api, tmp_path):
    """A rendered room panorama (2:1) dropped on the page: offered and run as a panorama, its numbers those of
    POST /predict/panorama/summary, the sphere's mesh in the 3D view; unticked, it runs as a photo; a photo
    hides the choice."""
    import cv2
    from PIL import Image

    from tt_moge.testing.room import render_panorama

    browser = result_page
    pano = tmp_path / "room.png"
    Image.fromarray(render_panorama(256, 128).image).save(pano)
    assert upload(browser, pano, timeout_s=300) == "done", browser.find_element(By.ID, "error").text
    checkbox = browser.find_element(By.ID, "panorama")
    assert browser.find_element(By.ID, "panorama-row").is_displayed() and checkbox.is_selected()
    assert not browser.find_element(By.ID, "fov_x").is_enabled()  # a photo's option, not a panorama's
    assert browser.find_element(By.ID, "apply_mask").is_enabled()
    expected = api.post("/predict/panorama/summary", content=pano.read_bytes(), headers={"Content-Type": "image/png"})
    assert expected.status_code == 200, expected.text
    expected = expected.json()
    shown = json.loads(browser.execute_script("return document.getElementById('summary-json').textContent"))
    drop = ("seconds", "timing_ms", "merge_residual")
    assert {k: v for k, v in shown.items() if k not in drop} == {k: v for k, v in expected.items() if k not in drop}
    assert shown["kind"] == "panorama" and shown["valid_fraction"] > 0.05
    rows = {r.get_attribute("data-key"): r.text for r in browser.find_elements(By.CSS_SELECTOR, "#numbers-table tr")}
    assert f"{expected['median_distance_m']:.2f} m" in rows["median_distance_m"] and "12 of 12" in rows["views"]
    assert not browser.find_element(By.ID, "normal").is_displayed()  # a panorama has no normal map
    canvas = browser.find_element(By.ID, "view")
    pixels = canvas_pixels(canvas).astype(np.int16)
    assert drawn(pixels).mean() > 0.5, "the panorama's view is blank"
    with np.load(
        io.BytesIO(
            api.post("/predict/panorama", content=pano.read_bytes(), headers={"Content-Type": "image/png"}).content
        )
    ) as npz:
        points, mask = npz["points"].astype(np.float64), npz["mask"].astype(bool)
    # a click where a pixel's point is drawn (the first view: from the centre, forward, 75 degrees high) picks it
    width, height = browser.execute_script("return [arguments[0].clientWidth, arguments[0].clientHeight]", canvas)
    sx, sy = first_view_ndc(points, 75, width, height)
    ahead = (points[..., 2] > 0) & (np.abs(sx) < 0.7) & (np.abs(sy) < 0.7)
    rows, cols = np.nonzero(ahead & (cv2.erode(mask.astype(np.uint8), np.ones((7, 7), np.uint8)) > 0))
    assert len(rows) > 20
    far = int(np.argmax(np.abs(rows - mask.shape[0] / 2)))  # off the horizon: a flipped row would not pass
    y, x = int(rows[far]), int(cols[far])
    text = browser.find_element(By.ID, "measure-text")
    click_at(browser, canvas, sx[y, x] * width / 2, sy[y, x] * height / 2)
    WebDriverWait(browser, 30).until(lambda b: "A at" in text.text)
    px, py = json.loads(text.get_attribute("data-pixels"))[-1]
    step = view_step(browser)
    assert min(abs(px - x), 256 - abs(px - x)) <= step + 1 and abs(py - y) <= step + 1, ((x, y), (px, py))

    checkbox.click()  # the same image as a photo
    assert browser.find_element(By.ID, "fov_x").is_enabled()
    runs = browser.execute_script("return window.ttMoge.runs")
    browser.find_element(By.ID, "run").click()
    WebDriverWait(browser, 120).until(lambda b: b.execute_script("return window.ttMoge.runs") > runs)
    shown = json.loads(browser.execute_script("return document.getElementById('summary-json').textContent"))
    assert state(browser) == "done" and "fov_x_deg" in shown and "kind" not in shown
    assert upload(browser, SOURCE) == "done"
    assert not browser.find_element(By.ID, "panorama-row").is_displayed()
    assert console_errors(browser) == []


def test_a_clip_shows_its_scene_and_the_apis_numbers(result_page, api, tmp_path):
    """A short clip dropped on the page: its numbers are POST /predict/video/summary's for the same bytes, and
    the 3D view shows the fused cloud with the camera path (not blank, red path pixels, moves when dragged)."""
    import cv2

    from tt_moge.scene import camera_path, render_path

    browser = result_page
    clip = tmp_path / "walk.mp4"
    writer = cv2.VideoWriter(str(clip), cv2.VideoWriter_fourcc(*"mp4v"), 8.0, (160, 120))
    for r in render_path(camera_path(16)[::4], 160, 120):
        writer.write(np.ascontiguousarray(r.image[..., ::-1]))
    writer.release()
    assert upload(browser, clip, timeout_s=300) == "done", browser.find_element(By.ID, "error").text
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-kind") == "video"
    expected = api.post("/predict/video/summary", content=clip.read_bytes(), headers={"Content-Type": "video/mp4"})
    assert expected.status_code == 200, expected.text
    expected = expected.json()
    shown = json.loads(browser.execute_script("return document.getElementById('summary-json').textContent"))
    assert shown["poses"] == expected["poses"] and shown["intrinsics"] == expected["intrinsics"]
    assert shown["frames"] == 4 and shown["registered"] == expected["registered"]
    assert shown["chains"] == expected["chains"] and shown["main_chain"] == expected["main_chain"]
    row = browser.find_element(By.CSS_SELECTOR, '#numbers-table tr[data-key="registered"]')
    text = row.find_elements(By.TAG_NAME, "td")[1].text
    assert text.startswith(f"{expected['registered']} of 4"), text
    assert ("chains (a new one after each cut)" in text) == (len(expected["chains"]) > 1), text

    canvas = browser.find_element(By.ID, "view")
    assert not browser.find_element(By.ID, "view-message").is_displayed()
    pixels = canvas_pixels(canvas).astype(np.int16)
    assert drawn(pixels).mean() > 0.02, "the scene view is blank"
    orbit = ActionChains(browser).move_to_element(canvas).click_and_hold().move_by_offset(120, 40).release()
    assert np.abs(redrawn(browser, canvas, orbit.perform) - pixels).mean() > 1
    names = [b.get_attribute("data-file") for b in browser.find_elements(By.CSS_SELECTOR, "#download-buttons button")]
    assert set(names) == {"clip.npz", "poses.json", "trajectory.txt", "scene.ply", "scene.glb"}
    assert console_errors(browser) == []

"""Headless Chromium driven by selenium, for the web page's browser test and benchmark.

Uses the system's Chromium and its matching driver (Debian: `apt-get install chromium chromium-driver`), never a
browser downloaded at run time: $MOGE_CHROMIUM / $MOGE_CHROMEDRIVER name them, else the usual paths are tried.
WebGL runs on SwiftShader (software), so the 3D view draws on machines without a GPU.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Optional

from .. import env as environment

__all__ = ["find_chromium", "start_chromium", "wait_for_download", "canvas_pixels"]

_BROWSERS = ("chromium", "chromium-browser", "google-chrome")
_DRIVERS = ("chromedriver",)


def _first(env: str, names: tuple, extra: tuple) -> Optional[str]:
    if environment.get(env):
        return environment.get(env)
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return next((p for p in extra if Path(p).is_file()), None)


def find_chromium() -> Optional[tuple]:
    """(chromium, chromedriver) paths, or None when either is missing."""
    browser = _first("MOGE_CHROMIUM", _BROWSERS, ("/usr/bin/chromium", "/usr/lib/chromium/chromium"))
    driver = _first("MOGE_CHROMEDRIVER", _DRIVERS, ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"))
    return (browser, driver) if browser and driver else None


def start_chromium(download_dir: Optional[Path] = None, size: tuple = (1400, 1000)) -> Any:
    """A selenium WebDriver on headless Chromium (downloads go to `download_dir`, without asking)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    found = find_chromium()
    if found is None:
        raise RuntimeError(
            "no Chromium + chromedriver found: apt-get install chromium chromium-driver "
            "(or set MOGE_CHROMIUM and MOGE_CHROMEDRIVER)"
        )
    browser, driver = found
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--enable-unsafe-swiftshader",
        "--use-angle=swiftshader",
        "--disable-gpu-sandbox",
        "--no-first-run",
        "--disable-extensions",
        "--hide-scrollbars",
        f"--window-size={size[0]},{size[1]}",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(arg)
    if download_dir is not None:
        options.add_experimental_option(
            "prefs", {"download.default_directory": str(download_dir), "download.prompt_for_download": False}
        )
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    session = webdriver.Chrome(options=options, service=Service(driver))  # an explicit driver: no download
    if download_dir is not None:
        session.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(download_dir)})
    return session


def wait_for_download(folder: Path, name: str, timeout_s: float = 60.0) -> Path:
    """The path of `name` in `folder` once Chromium has finished writing it."""
    target = Path(folder) / name
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if target.exists() and not (Path(folder) / (name + ".crdownload")).exists():
            return target
        time.sleep(0.1)
    raise TimeoutError(
        f"{name} was not downloaded into {folder} within {timeout_s} s "
        f"(there: {sorted(p.name for p in Path(folder).iterdir())})"
    )


def canvas_pixels(element: Any):
    """What an element shows on screen, as an (H, W, 3) uint8 array (a real screenshot, not the canvas buffer)."""
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(element.screenshot_as_png)).convert("RGB"))

"""Screenshots of the web pages for docs/ui.md and the README, at 1366x900 (desktop) and 390x844 (phone), into
docs/img/: ui-empty-*, the first view; ui-error-*, a form with bad fields; ui-desktop / ui-phone, the page with
requests running and queued, and the gallery; ui-video-*, a video's page; ui-dark-*, the page in dark mode. Taken
by headless Chromium (Debian's chromium and chromedriver) against a live gateway on an embedded Redis with two
synthetic-backend replicas.

    .venv/bin/python scripts/ui_screenshots.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(tempfile.mkdtemp(prefix="replicadp-ui-shots-"))
# Before replicadp_tasks reads its settings: outputs and state in the temp folder, no hub.
os.environ.update(HF_HUB_OFFLINE="1", OUTPUT_DIR=str(WORK / "outputs"), REPLICADP_STATE_DIR=str(WORK / "state"))

import httpx  # noqa: E402
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402

from client.local.embedded import EmbeddedServer, _free_port, stop_pid  # noqa: E402
from client.local.replicas import Replicas  # noqa: E402

STEP_S = 0.25  # the synthetic backend's time per step at 64x64x5 (tests/helpers.py's SYNTHETIC)
SYNTHETIC = "synthetic:{:g}".format(STEP_S * 832 * 480 * 33 * 30 / (64 * 64 * 5))
# Finished videos (prompt, seed, steps, size): small, since the synthetic backend's time grows with the pixels;
# of three shapes, as a gallery holds them. The last one is a re-run of the first.
FINISHED = [("a red fox trotting through fresh snow at dawn", 7, 4, "128x80"),
            ("a tall waterfall in a mossy forest", 3, 4, "80x128"),
            ("waves breaking on a rocky shore, slow motion", 42, 4, "128x80"),
            ("a spinning top on a wooden table", 9, 4, "96x96"),
            ("city lights at night, time-lapse", 5, 4, "128x80")]
RERUN = 0  # FINISHED[0] again: "Output matches the original"
# Two requests that keep both replicas busy (200 steps at 96x96: ~110 s) and one queued behind them.
RUNNING = [("a paper boat drifting down a rain gutter", 1234, "interactive"),
           ("a hot-air balloon rising over misty hills", 77, "normal")]
QUEUED = ("a lighthouse beam sweeping through fog", 8, "normal")
SIZES = {"desktop": (1366, 900), "phone": (390, 844)}
OUT = ROOT / "docs" / "img"


def wait(predicate, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.2)
    return value


def post(client: httpx.Client, prompt: str, seed: int, steps: int, size: str, priority: str = "normal") -> dict:
    form = {"prompt": prompt, "seed": str(seed), "num_inference_steps": str(steps), "priority": priority,
            "size": size, "num_frames": "5"}
    return client.post("/v1/videos", files={k: (None, v) for k, v in form.items()}).raise_for_status().json()


def healthy(client: httpx.Client, gateway: subprocess.Popen) -> bool:
    if gateway.poll() is not None:
        raise RuntimeError(f"the gateway exited ({gateway.returncode})")
    try:
        return client.get("/health").status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def chromium(name: str, width: int, height: int, dark: bool = False):
    """A headless Chromium of its own showing pages at width x height CSS pixels (a phone's screen emulated)."""
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                f"--window-size={width},{height}", f"--user-data-dir={WORK / ('profile-' + name)}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    driver.phone = width < 500
    try:
        if driver.phone:
            resize(driver, width, height)
        if dark:
            driver.execute_cdp_cmd("Emulation.setEmulatedMedia",
                                   {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
        yield driver
    finally:
        driver.quit()


def resize(driver, width: int, height: int) -> None:
    if driver.phone:
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": True})
    else:
        driver.set_window_size(width, height)


def open_ui(driver, url: str, mine: list[dict], path: str = "/ui") -> None:
    driver.get(f"{url}/ui")
    driver.execute_script("localStorage.setItem('replicadp.requests', arguments[0])", json.dumps(mine))
    driver.get(f"{url}{path}")


def save(driver, name: str, width: int, height: int, whole: bool) -> None:
    time.sleep(1.5)  # one more poll: every part filled in
    if whole:  # the whole page at this width (headless Chromium's window size includes no browser chrome)
        resize(driver, width, max(height, driver.execute_script("return document.documentElement.scrollHeight")))
        time.sleep(0.5)
    out = OUT / f"{name}.png"
    OUT.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(out))
    print(out)


def first_view(url: str) -> None:
    for size, (width, height) in SIZES.items():
        with chromium(f"empty-{size}", width, height) as driver:
            open_ui(driver, url, [])
            wait(lambda: driver.execute_script("return $('queue').textContent !== 'Loading…'"), "the first poll")
            save(driver, f"ui-empty-{size}", width, height, whole=True)
            driver.execute_script("$('advanced').open = true")  # the fields typed into below are folded there
            driver.find_element("id", "f-prompt").clear()
            for field, value in (("num_inference_steps", "17e"), ("guidance_scale", "abc")):
                driver.find_element("id", f"f-{field}").clear()
                driver.find_element("id", f"f-{field}").send_keys(value)
            driver.find_element("id", "submit").click()
            driver.execute_script("scrollTo(0, 0)")
            save(driver, f"ui-error-{size}", width, height, whole=False)


def busy_page(url: str, mine: list[dict]) -> None:
    for dark in (False, True):
        for size, (width, height) in SIZES.items():
            with chromium(f"{'dark' if dark else 'main'}-{size}", width, height, dark) as driver:
                open_ui(driver, url, mine)
                wait(lambda: driver.execute_script(
                    "return document.querySelectorAll('.card img').length >= 5 && "
                    "[...document.querySelectorAll('.card img')].every(i => i.complete && i.naturalWidth > 0)"),
                    "the gallery's posters")
                wait(lambda: driver.execute_script("return $('replicas').querySelectorAll('progress').length >= 2"),
                     "both replicas running at a step")
                wait(lambda: driver.execute_script("return !!document.querySelector('.match:not([hidden])')"),
                     "the re-run's comparison")
                name = f"ui-dark-{size}" if dark else f"ui-{size}"
                save(driver, name, width, height, whole=True)


def video_page(url: str, mine: list[dict], job_id: str) -> None:
    for size, (width, height) in SIZES.items():
        with chromium(f"video-{size}", width, height) as driver:
            open_ui(driver, url, mine, f"/ui/videos/{job_id}")
            wait(lambda: driver.execute_script("return $('player').readyState >= 2 && "
                                               "$('first-frame').naturalWidth > 0"), "the video and its first frame")
            driver.find_element("id", "copy-curl").click()
            save(driver, f"ui-video-{size}", width, height, whole=False)


def main() -> None:
    server = EmbeddedServer(WORK / "redis")
    redis_url = server.start()
    replicas = gateway = None
    try:
        replicas = Replicas(2, redis_url=redis_url, model=SYNTHETIC, threads=1,
                            log_path=WORK / "replicas.log").start(timeout=180)
        port = _free_port()
        gateway = subprocess.Popen([str(Path(sys.executable).parent / "replicadp"), "serve-http", "--port", str(port)],
                                   env={**os.environ, "REDIS_URL": redis_url}, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=60) as client:
            wait(lambda: healthy(client, gateway), "the gateway and a live replica")
            first_view(url)
            done = [post(client, p, s, n, size) for p, s, n, size in FINISHED]
            wait(lambda: all(client.get(f"/v1/videos/{j['id']}").json()["status"] == "completed" for j in done),
                 "the finished videos")
            original = client.get(f"/v1/videos/{done[RERUN]['id']}").json()
            rerun = post(client, *FINISHED[RERUN][:3], FINISHED[RERUN][3])
            wait(lambda: client.get(f"/v1/videos/{rerun['id']}").json()["status"] == "completed", "the re-run")
            running = [post(client, p, s, 200, "96x96", priority) for p, s, priority in RUNNING]
            wait(lambda: all(client.get(f"/v1/videos/{j['id']}").json()["status"] == "in_progress" for j in running),
                 "both replicas to run")
            queued = post(client, QUEUED[0], QUEUED[1], 8, "64x64", QUEUED[2])
            def entry(job: dict, state: str, compare: dict | None = None) -> dict:  # one of "My requests"
                return {"id": job["id"], "prompt": job["prompt"], "created_at": job["created_at"], "state": state,
                        "compareTo": compare}

            mine = [entry(queued, "queued"), *(entry(j, "queued") for j in running),
                    entry(rerun, "completed", {"id": original["id"], "frames_sha256": original["frames_sha256"]}),
                    entry(done[1], "completed")]
            busy_page(url, mine)
            video_page(url, mine, original["id"])
            for job in (*running, queued):
                client.delete(f"/v1/videos/{job['id']}")
    finally:
        if gateway is not None:
            stop_pid(gateway.pid)
        if replicas is not None:
            replicas.stop()
        server.stop()
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()

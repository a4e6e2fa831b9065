"""Screenshots of the web page for docs/ui.md and the README: docs/img/ui-desktop.png (1366 wide) and
docs/img/ui-phone.png (390 wide), each the whole page, taken by headless Chromium (Debian's chromium and chromedriver)
against a live gateway on an embedded Redis, two synthetic-backend replicas, two finished videos and one running.

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
SHAPE = {"size": "64x64", "num_frames": "5"}
FINISHED = [("a red fox trotting through fresh snow at dawn", 7, 8),
            ("waves breaking on a rocky shore, slow motion", 42, 12)]
RUNNING = ("a paper boat drifting down a rain gutter", 1234, 200)
SIZES = {"desktop": (1366, 900), "phone": (390, 844)}


def wait(predicate, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.2)
    return value


def post(client: httpx.Client, prompt: str, seed: int, steps: int, priority: str = "normal") -> dict:
    form = {"prompt": prompt, "seed": str(seed), "num_inference_steps": str(steps), "priority": priority, **SHAPE}
    return client.post("/v1/videos", files={k: (None, v) for k, v in form.items()}).raise_for_status().json()


def healthy(client: httpx.Client, gateway: subprocess.Popen) -> bool:
    if gateway.poll() is not None:
        raise RuntimeError(f"the gateway exited ({gateway.returncode})")
    try:
        return client.get("/health").status_code == 200
    except httpx.TransportError:
        return False


def shoot(url: str, mine: list[dict], name: str, width: int, height: int) -> None:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--window-size={width},{height}",
                f"--user-data-dir={WORK / ('profile-' + name)}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        driver.get(f"{url}/ui")
        driver.execute_script("localStorage.setItem('replicadp.requests', arguments[0])", json.dumps(mine))
        driver.get(f"{url}/ui")
        wait(lambda: driver.execute_script(
            "return [...document.querySelectorAll('.card video')].filter(v => v.readyState >= 2).length") >= 2,
            "the gallery's videos to load")
        wait(lambda: driver.execute_script("return document.querySelector('#replicas progress')"),
             "a replica running at a step")
        time.sleep(1.5)  # one more poll: every part filled in
        # The whole page at this width (headless Chromium's window size includes no browser chrome to subtract).
        driver.set_window_size(width, max(height, driver.execute_script("return document.documentElement.scrollHeight")))
        time.sleep(0.5)
        out = ROOT / "docs" / "img" / f"ui-{name}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out))
        print(out)
    finally:
        driver.quit()


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
            done = [post(client, p, s, n) for p, s, n in FINISHED]
            wait(lambda: all(client.get(f"/v1/videos/{j['id']}").json()["status"] == "completed" for j in done),
                 "the finished videos")
            running = post(client, *RUNNING, priority="interactive")
            mine = [{"id": j["id"], "prompt": j["prompt"], "created_at": j["created_at"],
                     "state": "queued" if j is running else "completed", "compareTo": None}
                    for j in (running, *reversed(done))]
            for name, (width, height) in SIZES.items():
                shoot(url, mine, name, width, height)
            client.delete(f"/v1/videos/{running['id']}")
    finally:
        if gateway is not None:
            stop_pid(gateway.pid)
        if replicas is not None:
            replicas.stop()
        server.stop()
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()

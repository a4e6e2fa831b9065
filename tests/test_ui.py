"""The web page (`/ui`, docs/ui.md) as a person uses it: headless Chromium (Debian's chromium and chromedriver,
driven by selenium) on a real gateway in front of real replicas: the session's tiny-model ones, or one of the
synthetic backend whose requests last as long as a test sets."""

import shutil
import tempfile
from contextlib import contextmanager

import httpx
import pytest
from conftest import start_replicas
from helpers import lasting, wait_for
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.select import Select
from test_http import SMALL, auth, gateway, live, multipart, result_meta, slow  # noqa: F401 (fixtures)

from replicadp_tasks.records import RequestState
from replicadp_tasks.tiny_model import save_tiny_lora

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="needs Debian's chromium and "
                                "chromium-driver (make install-test installs them)")
KEY = "ui-test-key"


@contextmanager
def chromium(width: int = 1366, height: int = 900):
    """A headless Chromium of its own (profile in a temp folder), quit and removed also on failure."""
    profile = tempfile.mkdtemp(prefix="chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", f"--user-data-dir={profile}",
                f"--window-size={width},{height}", "--autoplay-policy=no-user-gesture-required"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    with chromium() as driver:
        yield driver


def open_page(driver, gw):
    """The page of `gw`, with nothing remembered from an earlier test (its requests, its key)."""
    driver.get(f"{gw.url}/ui")
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.get(f"{gw.url}/ui")


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def fill(driver, **fields):
    """Type into the form's inputs (f-<name>; length is in frames, the unit's default)."""
    for name, value in fields.items():
        element = driver.find_element(By.ID, f"f-{name}")
        element.clear()
        element.send_keys(str(value))


def my_request(driver) -> str:
    """The id of the newest request in "My requests", once the page lists one."""
    return wait_for(lambda: js(driver, "const li = document.querySelector('#requests li'); return li && li.dataset.id"),
                    "the page to list the request it sent")


def item(driver, job_id: str, what: str):
    return js(driver, f"const li = document.querySelector('#requests li[data-id=\"{job_id}\"]'); return li && {what}")


def plays(driver, job_id: str) -> bool:
    """The gallery card of `job_id` has its video loaded (readyState >= HAVE_CURRENT_DATA, decoded from the blob: URL
    the page fetched with the key)."""
    return js(driver, f"const v = document.querySelector('.card[data-video-id=\"{job_id}\"] video'); "
                      "return !!v && v.src.startsWith('blob:') && v.readyState >= 2 && v.videoWidth > 0")


def test_a_request_from_the_page_plays_its_video(live, browser):
    """A prompt typed into the page and sent with Generate runs on a tiny-model replica; the page follows it to
    completed and its video plays inline in the gallery, with its seed and size."""
    open_page(browser, live)
    fill(browser, prompt="a fox in snow", size="64x64", length=9, num_inference_steps=2, seed=5)
    browser.find_element(By.ID, "submit").click()
    job_id = my_request(browser)
    wait_for(lambda: item(browser, job_id, "li.dataset.status") == "completed", f"job {job_id} to complete")
    wait_for(lambda: plays(browser, job_id), f"the video of {job_id} to play in the gallery")
    card = browser.find_element(By.CSS_SELECTOR, f'.card[data-video-id="{job_id}"]').text
    assert "a fox in snow" in card and "Seed\n5" in card and "64x64, 9 frames" in card, card
    js(browser, f"document.querySelector('.card[data-video-id=\"{job_id}\"] video').play()")
    wait_for(lambda: js(browser, f"return document.querySelector('.card[data-video-id=\"{job_id}\"] video')"
                                 ".currentTime > 0"), "the video to advance as it plays")


def test_a_rerun_from_a_videos_page_says_its_output_matches(live, browser):
    """A video's Details re-run it with the same inputs (seed, size, steps, ...), on whichever replica takes it,
    and the page says the re-run's output (frames sha256) matches the original's."""
    form = {**SMALL, "prompt": "a lighthouse at dusk", "seed": "11"}
    original = live.client.post("/v1/videos", files=multipart(form)).json()["id"]
    wait_for(lambda: live.client.get(f"/v1/videos/{original}").json()["status"] == "completed", f"{original} to complete")
    open_page(browser, live)
    wait_for(lambda: plays(browser, original), f"{original} to show in the gallery")
    browser.find_element(By.CSS_SELECTOR, f'.card[data-video-id="{original}"] button.view').click()
    assert browser.find_element(By.ID, "detail").is_displayed()
    assert "a lighthouse at dusk" in browser.find_element(By.ID, "detail-meta").text
    browser.find_element(By.ID, "rerun").click()
    try:
        rerun = my_request(browser)
    except TimeoutError:  # seen once, not reproduced: say what the dialog said of the re-run
        raise AssertionError(f"no re-run listed; the dialog says: {browser.find_element(By.ID, 'detail-note').text!r}")
    assert rerun != original
    verdict = wait_for(lambda: item(browser, rerun, "!li.querySelector('.match').hidden && li.querySelector('.match')"),
                       f"the re-run {rerun} to be compared")
    assert verdict.get_attribute("data-match") == "true", verdict.text
    assert verdict.text.startswith("Output matches the original")
    job = live.client.get(f"/v1/videos/{rerun}").json()
    assert job["seed"] == 11 and job["frames_sha256"] == live.client.get(f"/v1/videos/{original}").json()["frames_sha256"]


def test_the_progress_bar_moves_and_cancel_stops_a_running_request(slow, browser):
    """A 30 s request (synthetic backend, 0.25 s a step) shows its progress bar moving and its replica running it
    at a step; Cancel stops it on the replica (RequestCancelled) and the page says cancelled."""
    open_page(browser, slow)
    request = lasting(30)
    fill(browser, prompt="a slow one", size="64x64", length=request["num_frames"],
         num_inference_steps=request["num_inference_steps"])
    browser.find_element(By.ID, "submit").click()
    job_id = my_request(browser)
    first = wait_for(lambda: item(browser, job_id, "li.querySelector('progress').value"), f"{job_id} to make progress")
    wait_for(lambda: item(browser, job_id, "li.querySelector('progress').value") > first, "the progress bar to move")
    wait_for(lambda: f"running {job_id[:8]}, step" in browser.find_element(By.ID, "replicas").text,
             "the replica to show the request at a step", timeout=25)  # it runs 30 s
    status = slow.client.get("/v1/status").json()
    assert status["replicas"][0]["running"]["id"] == job_id and status["replicas"][0]["serving"]
    browser.find_element(By.CSS_SELECTOR, f'#requests li[data-id="{job_id}"] button.cancel').click()
    wait_for(lambda: item(browser, job_id, "li.dataset.status") == "cancelled", "the page to say cancelled")
    meta = wait_for(lambda: (m := result_meta(slow.redis_url, job_id)) and m["status"] == RequestState.FAILURE
                    and m, f"{job_id} to stop on the replica")
    assert meta["result"]["exc_type"] == "RequestCancelled"


@pytest.mark.parametrize("fields, field, words", [
    ({"size": "100x100"}, "size", "=100: must be a multiple of 16"),
    ({"num_inference_steps": 999}, "num_inference_steps", "num_inference_steps"),
    ({"length": 6}, "length", "num_frames"),
])
def test_bad_input_shows_the_servers_error_next_to_its_field(slow, browser, fields, field, words):
    """The gateway's 400 (OpenAI's error object, `param` naming the field) is shown under the input it names,
    which is marked invalid, described by the message and focused; no request is listed."""
    open_page(browser, slow)
    fill(browser, prompt="bad input", **fields)
    browser.find_element(By.ID, "submit").click()
    error = wait_for(lambda: browser.find_element(By.ID, f"err-{field}").text, f"an error under {field}")
    assert words in error, error
    element = browser.find_element(By.ID, f"f-{field}")
    assert element.get_attribute("aria-invalid") == "true"
    assert f"err-{field}" in element.get_attribute("aria-describedby").split()
    assert browser.switch_to.active_element == element
    assert js(browser, "return document.querySelectorAll('#requests li').length") == 0


def test_without_a_key_the_page_loads_and_asks_for_it(redis_db, browser):
    """With API keys, the page itself loads without one, its /v1 calls get 401 and it asks for the key; once the
    key is given it shows the cluster (here: no live replica)."""
    with gateway(redis_db(), "ui-keys", "--api-key", KEY) as gw:
        assert httpx.get(f"{gw.url}/ui").status_code == 200
        assert gw.client.get("/v1/status").status_code == 401
        assert gw.client.get("/v1/status", headers=auth(KEY)).json()["replicas"] == []
        open_page(browser, gw)
        alert = wait_for(lambda: browser.find_element(By.ID, "alert").text, "the page to ask for the key")
        assert "needs an API key" in alert
        assert browser.find_element(By.ID, "api-key").get_attribute("aria-invalid") == "true"
        browser.find_element(By.ID, "api-key").send_keys(KEY)
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_for(lambda: "No live replica" in browser.find_element(By.ID, "replicas").text, "the cluster with the key")
        assert not browser.find_element(By.ID, "alert").is_displayed()


def test_a_deployment_with_a_step_cache_offers_a_fidelity_choice(redis_db, tiny_model, browser):
    """Replicas with a step cache (REPLICADP_CACHE=pab) serve both qualities: the page offers the Fidelity choice
    (standard, fast), and a request sent with fast runs the fast path (its result says so)."""
    url = redis_db()
    group = start_replicas(1, url, "ui-cache", REPLICADP_CACHE="pab")
    try:
        with gateway(url, "ui-cache") as gw:
            open_page(browser, gw)
            wait_for(lambda: browser.find_element(By.ID, "quality-field").is_displayed(), "the Fidelity choice")
            choices = [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#f-quality option")]
            assert choices == ["standard", "fast"]
            fill(browser, prompt="a fox in snow", size="64x64", length=9, num_inference_steps=4, seed=5)
            Select(browser.find_element(By.ID, "f-quality")).select_by_value("fast")
            browser.find_element(By.ID, "submit").click()
            job_id = my_request(browser)
            wait_for(lambda: item(browser, job_id, "li.dataset.status") == "completed", f"job {job_id} to complete")
            assert gw.client.get(f"/v1/videos/{job_id}").json()["params"]["quality"] == "fast"
    finally:
        group.stop()


def test_a_deployment_with_adapters_offers_them_and_a_request_runs_with_them(redis_db, tiny_model, tmp_path, browser):
    """A replica with a registered LoRA adapter (REPLICADP_LORAS): the page shows the LoRA field with the adapter's
    name; a request sent with "style:0.5" runs with it (its job's params say so) and its Details list it; an
    unregistered name is refused with the gateway's error beside the field."""
    save_tiny_lora(tiny_model, tmp_path / "style.safetensors", seed=1)
    (tmp_path / "loras.toml").write_text('[adapters.style]\nsource = "style.safetensors"\n')
    url = redis_db()
    group = start_replicas(1, url, "ui-loras", REPLICADP_LORAS=str(tmp_path / "loras.toml"))
    try:
        with gateway(url, "ui-loras") as gw:
            open_page(browser, gw)
            wait_for(lambda: browser.find_element(By.ID, "loras-field").is_displayed(), "the LoRA field")
            assert browser.find_element(By.ID, "loras-available").text == "style"
            fill(browser, prompt="a fox in snow", size="64x64", length=9, num_inference_steps=2, seed=5, loras="nope")
            browser.find_element(By.ID, "submit").click()
            error = wait_for(lambda: browser.find_element(By.ID, "err-loras").text, "the error beside the LoRA field")
            assert "no such adapter here; registered: style" in error, error
            fill(browser, loras="style:0.5")
            browser.find_element(By.ID, "submit").click()
            job_id = my_request(browser)
            wait_for(lambda: item(browser, job_id, "li.dataset.status") == "completed", f"job {job_id} to complete")
            assert gw.client.get(f"/v1/videos/{job_id}").json()["params"]["loras"] == [{"name": "style", "scale": 0.5}]
            wait_for(lambda: plays(browser, job_id), f"{job_id} to show in the gallery")
            browser.find_element(By.CSS_SELECTOR, f'.card[data-video-id="{job_id}"] button.view').click()
            assert "LoRA adapters\nstyle:0.5" in browser.find_element(By.ID, "detail-meta").text
    finally:
        group.stop()

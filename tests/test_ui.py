"""The web pages (`/ui` and `/ui/videos/<id>`, docs/ui.md) as a person uses them: headless Chromium (Debian's chromium
and chromedriver, driven by selenium) on a real gateway in front of real replicas: the session's tiny-model ones,
or one of the synthetic backend whose requests (and decoding) last as long as a test sets. Nothing here waits a
set time for the machine: each step waits for what the page shows, or for the replica's record."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager

import httpx
import pytest
from conftest import start_replicas
from helpers import SYNTHETIC, lasting, wait_for
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.select import Select
from test_http import SMALL, auth, form_of, gateway, live, multipart, result_meta, slow  # noqa: F401 (fixtures)

from replicadp_tasks.contract import READY, RequestState
from replicadp_tasks.model import save_tiny_lora

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="needs Debian's chromium and "
                                "chromium-driver (make install-test installs them)")
KEY = "ui-test-key"
DECODE_S = 10  # the decoding replica's decode after its last step: a cancel lands well inside it
PHONE = (390, 844)


@contextmanager
def chromium(width: int = 1366, height: int = 900):
    """A headless Chromium of its own (profile and HTTP cache in a temp folder) showing pages at `width` x `height`
    CSS pixels, quit and removed also on failure."""
    profile = tempfile.mkdtemp(prefix="chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--user-data-dir={profile}", f"--window-size={width},{height}",
                "--autoplay-policy=no-user-gesture-required"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        if width < 500:  # headless Chromium's narrowest window: a phone's screen is emulated
            driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                                   {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": True})
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    with chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def decoding(redis_db):
    """One synthetic replica that decodes for DECODE_S seconds after its last step, behind a gateway."""
    url = redis_db()
    group = start_replicas(1, url, "ui-decoding", model=f"{SYNTHETIC}:{DECODE_S}")
    try:
        with gateway(url, "ui-decoding") as gw:
            yield gw
    finally:
        group.stop()


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def open_page(driver, gw, path: str = "/ui"):
    """A page of `gw`, with nothing remembered from an earlier test (its requests, its key), once it has polled
    the gateway (or been refused: then it asks for a key)."""
    driver.get(f"{gw.url}/ui")
    js(driver, "localStorage.clear(); sessionStorage.clear();")
    driver.get(f"{gw.url}{path}")
    if path == "/ui":
        wait_for(lambda: js(driver, "return $('queue').textContent !== 'Loading…' || !$('key-form').hidden"),
                 "the page's first poll")


def fill(driver, **fields):
    """Type into the form's inputs (f-<name>; a size is typed as a custom one; length is in frames)."""
    for name, value in fields.items():
        if name == "size":
            Select(driver.find_element(By.ID, "f-size-preset")).select_by_value("custom")
        element = driver.find_element(By.ID, f"f-{name}")
        element.clear()
        element.send_keys(str(value))


def fill_request(driver, request: dict, prompt: str, **more):
    """The form filled with a request of helpers.lasting (its shape and steps)."""
    fill(driver, prompt=prompt, size=f"{request['width']}x{request['height']}", length=request["num_frames"],
         num_inference_steps=request["num_inference_steps"], **more)


def my_request(driver, listed: tuple[str, ...] = ()) -> str:
    """The id of the newest request in "My requests", once the page lists one other than those `listed` before."""
    newest = "const li = document.querySelector('#requests li'); return li && li.dataset.id"
    return wait_for(lambda: (i := js(driver, newest)) not in listed and i, "the page to list the request it sent")


def item(driver, job_id: str, what: str):
    return js(driver, f"const li = document.querySelector('#requests li[data-id=\"{job_id}\"]'); return li && {what}")


def send(gw, request: dict, key: str | None = None) -> str:
    """POST /v1/videos of a request (helpers.lasting's), the job id."""
    r = gw.client.post("/v1/videos", files=multipart(form_of(request)), headers=auth(key) if key else None)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def completed(gw, job_id: str, key: str | None = None) -> dict:
    return wait_for(lambda: (j := gw.client.get(f"/v1/videos/{job_id}", headers=auth(key) if key else None).json())
                    ["status"] == "completed" and j, f"{job_id} to complete")


def watch_phases(driver, job_id: str):
    """From now on, the page records each phase its item of `job_id` shows (data-phase), in order, in __phases: a
    phase shown between two of the test's looks is not missed."""
    js(driver, """const id = arguments[0]; window.__phases = [];
        const look = () => { const li = document.querySelector(`#requests li[data-id="${id}"]`);
            const p = li && li.dataset.phase; if (p && window.__phases.at(-1) !== p) window.__phases.push(p); };
        new MutationObserver(look).observe($('requests'), {subtree: true, childList: true, attributes: true});
        look();""",
       job_id)


def phases(driver) -> list[str]:
    return js(driver, "return window.__phases")


def resources(driver, suffix: str) -> list[dict]:
    """The browser's resource timing entries of URLs ending in `suffix`: name, transferSize, encodedBodySize."""
    return js(driver, "return performance.getEntriesByType('resource').filter(e => e.name.endsWith(arguments[0]))"
                      ".map(e => ({name: e.name, transferSize: e.transferSize, encodedBodySize: e.encodedBodySize}))",
              suffix)


def posters_shown(driver) -> int:
    """Gallery cards whose poster image has loaded (0 while any card still waits for its poster)."""
    return js(driver, "const imgs = [...document.querySelectorAll('.card .thumb img')];"
                      "return imgs.every(i => i.complete && i.naturalWidth > 0) ? imgs.length : 0")


def plays(driver, job_id: str) -> bool:
    """The gallery card of `job_id` plays its video: fetched (with the key) into a blob: URL on the click, decoded
    (readyState >= HAVE_CURRENT_DATA) and advancing."""
    return js(driver, f"const v = document.querySelector('.card[data-video-id=\"{job_id}\"] video'); return !!v && "
                      "v.src.startsWith('blob:') && v.readyState >= 2 && v.videoWidth > 0 && v.currentTime > 0")


def test_a_request_from_the_page_plays_its_video(live, browser):
    """A prompt typed into the page and sent with Generate runs on a tiny-model replica; the page follows it to
    completed, and its gallery card shows the video's poster with its seed and size; a click on the poster plays
    the video in place, without player controls."""
    open_page(browser, live)
    fill(browser, prompt="a fox in snow", size="64x64", length=9, num_inference_steps=2, seed=5)
    browser.find_element(By.ID, "submit").click()
    job_id = my_request(browser)
    wait_for(lambda: item(browser, job_id, "li.dataset.status") == "completed", f"job {job_id} to complete")
    card = f'.card[data-video-id="{job_id}"]'
    wait_for(lambda: js(browser, f"const i = document.querySelector('{card} img'); return i && i.naturalWidth > 0"),
             f"the poster of {job_id} in the gallery")
    text = browser.find_element(By.CSS_SELECTOR, card).text
    assert "a fox in snow" in text and "seed 5 · 64x64 · 9 frames · 2 steps" in text, text
    assert not js(browser, f"return document.querySelector('{card} video')"), "a video before any click"
    browser.find_element(By.CSS_SELECTOR, f"{card} .thumb").click()
    wait_for(lambda: plays(browser, job_id), f"the video of {job_id} to play in its card")
    assert not js(browser, f"return document.querySelector('{card} video').controls")
    assert browser.find_element(By.CSS_SELECTOR, f"{card} .thumb").get_attribute("aria-label").startswith("Pause")


def test_a_videos_page_loads_by_its_address_and_reruns_it_with_its_priority(live, browser):
    """A video's page, opened by its URL (/ui/videos/<id>), shows the video, its first frame, its inputs and its
    replica, with Re-run and Download in view; the download is named from the prompt and seed. Re-run sends the
    same inputs at the same priority (batch here), and the page says the re-run's output (frames sha256) matches
    the original's. The gallery and "My requests" on /ui link to the videos' pages; "Edit in the form" fills the
    form with the video's inputs and priority."""
    original = send(live, {**{k: v for k, v in SMALL.items() if k != "size"}, "width": 64, "height": 64,
                           "prompt": "A lighthouse at dusk!", "seed": "11", "priority": "batch"})
    job = completed(live, original)
    open_page(browser, live, f"/ui/videos/{original}")
    wait_for(lambda: js(browser, "const v = $('player'); return v.src.startsWith('blob:') && v.readyState >= 2"),
             "the video to load on its page")
    assert browser.find_element(By.ID, "title").text == "A lighthouse at dusk!"
    assert browser.title == "A lighthouse at dusk! — replicadp"
    inputs, run = browser.find_element(By.ID, "inputs").text, browser.find_element(By.ID, "run").text
    assert "Seed\n11" in inputs and "Priority\nbatch" in inputs and "Size\n64x64" in inputs, inputs
    assert f"Replica\n{job['replica']}" in run and f"Frames sha256\n{job['frames_sha256']}" in run, run
    wait_for(lambda: js(browser, "return $('first-frame').naturalWidth > 0"), "the first frame (the poster)")
    download = browser.find_element(By.ID, "download")
    assert download.get_attribute("download") == "a-lighthouse-at-dusk-seed11.mp4"
    assert download.get_attribute("href").startswith("blob:")
    assert js(browser, "return $('download').getBoundingClientRect().bottom <= innerHeight"), "Download below the fold"
    rerun_button = browser.find_element(By.ID, "rerun")
    assert rerun_button.text == "Re-run (batch)"
    rerun_button.click()
    rerun = my_request(browser)
    assert rerun != original
    verdict = wait_for(lambda: item(browser, rerun, "!li.querySelector('.match').hidden && li.querySelector('.match')"),
                       f"the re-run {rerun} to be compared")
    assert verdict.get_attribute("data-match") == "true", verdict.text
    assert verdict.text.startswith("Output matches the original")
    again = live.client.get(f"/v1/videos/{rerun}").json()
    assert again["priority"] == "batch" and again["seed"] == 11 and again["frames_sha256"] == job["frames_sha256"]
    browser.get(f"{live.url}/ui")
    view = wait_for(lambda: item(browser, rerun, "li.querySelector('a.view')"), "the re-run's View link")
    assert view.get_attribute("href") == f"{live.url}/ui/videos/{rerun}"
    link = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, f'.card[data-video-id="{original}"] a.prompt'),
                    "the original in the gallery")[0]
    link.click()
    wait_for(lambda: browser.current_url == f"{live.url}/ui/videos/{original}", "the gallery link to open its page")
    wait_for(lambda: browser.find_element(By.ID, "edit").is_displayed(), "Edit in the form")
    browser.find_element(By.ID, "edit").click()
    form = "return ['prompt', 'size', 'length', 'num_inference_steps', 'seed', 'priority'].map(f => $('f-' + f).value)"
    wait_for(lambda: js(browser, form) == ["A lighthouse at dusk!", "64x64", "9", "2", "11", "batch"],
             "the form to hold the video's inputs and priority")


def run_snippets(driver, key: str | None = None) -> list[str]:
    """Copy the request of the video's page as curl and as Python, run each (bash, this interpreter) with
    REPLICADP_API_KEY set to `key`, and return the two job ids they print. With a key, the code names the variable,
    never the key."""
    made = []
    for kind, run in (("curl", ["bash", "-c"]), ("python", [sys.executable, "-c"])):
        driver.find_element(By.ID, f"copy-{kind}").click()
        code = wait_for(lambda: js(driver, f"const pre = $('snippet'); return pre.dataset.kind === '{kind}' && "
                                           "pre.textContent"), f"the request as {kind}")
        if key:
            assert "REPLICADP_API_KEY" in code and key not in code, code
        env = {**os.environ, **({"REPLICADP_API_KEY": key} if key else {})}
        out = subprocess.run([*run, code], capture_output=True, text=True, timeout=60, check=True, env=env).stdout
        made.append(json.loads(out)["id"] if kind == "curl" else out.split()[0])
    return made


def test_copy_as_curl_and_as_python_send_the_same_request(slow, browser):
    """A video's page gives its request as a curl command and as Python (requests): each, run as is, makes a job
    with the same inputs and priority, whose frames are the original's. Behind API keys, both send
    `Authorization: Bearer $REPLICADP_API_KEY` (the page asks for the key first) and never the key itself."""
    original = send(slow, lasting(0.5, prompt="it's a \"quoted\" prompt; $HOME `x`", seed=3, priority="normal"))
    job = completed(slow, original)
    open_page(browser, slow, f"/ui/videos/{original}")
    wait_for(lambda: browser.find_element(By.ID, "actions").is_displayed(), "the video's actions")
    for job_id in run_snippets(browser):
        copy = completed(slow, job_id)
        assert copy["params"] == job["params"] and copy["priority"] == "normal", copy
        assert copy["frames_sha256"] == job["frames_sha256"]
    with gateway(slow.redis_url, "ui-keyed", "--api-key", KEY) as keyed:
        mine = send(keyed, lasting(0.5, prompt="behind a key"), key=KEY)
        completed(keyed, mine, key=KEY)
        open_page(browser, keyed, f"/ui/videos/{mine}")
        wait_for(lambda: browser.find_element(By.ID, "key-form").is_displayed(), "the page to ask for the key")
        browser.find_element(By.ID, "api-key").send_keys(KEY)
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_for(lambda: browser.find_element(By.ID, "actions").is_displayed(), "the video's actions with the key")
        for job_id in run_snippets(browser, KEY):
            assert completed(keyed, job_id, key=KEY)["params"]["prompt"] == "behind a key"


def test_a_queued_request_shows_its_place_then_its_phases_and_the_live_table_agrees(slow, browser):
    """Behind a long request on the one synthetic replica, a request sent from the page shows "queued", its place
    (next in line) and when it should start, while the Live table names the long one by its prompt. Once the long
    one is cancelled, the page's request shows "denoising, step k of n" from its job, the same step as the Live
    table beside its prompt, and the tab's title its percent; its bar moves, its focused Cancel button keeps the
    focus across polls; Cancel says "cancelling", then "cancelled" once the replica has stopped it, and the Live
    table shows the replica idle, nothing stale."""
    completed(slow, send(slow, lasting(0.5, prompt="warm-up")))  # a recent job: the page knows what a request costs
    long = send(slow, lasting(30, prompt="the long one"))
    wait_for(lambda: slow.client.get(f"/v1/videos/{long}").json()["status"] == "in_progress", f"{long} to start")
    open_page(browser, slow)
    fill_request(browser, lasting(20), "behind the long one")
    Select(browser.find_element(By.ID, "f-priority")).select_by_value("interactive")
    browser.find_element(By.ID, "submit").click()
    job_id = my_request(browser)
    watch_phases(browser, job_id)
    queued = r"queued · next in line · starts in (a moment|about \d+ s) · waiting \d+ s"
    wait_for(lambda: re.fullmatch(queued, item(browser, job_id, "li.querySelector('.status').textContent") or ""),
             "the queued request's place and expected start")
    wait_for(lambda: '"the long one": denoising, step' in browser.find_element(By.ID, "replicas").text,
             "the Live table to name the long request by its prompt")
    assert slow.client.delete(f"/v1/videos/{long}").status_code == 200
    both = r"step (\d+) of (\d+)"

    def same_step():
        text = js(browser, f"return [document.querySelector('#requests li[data-id=\"{job_id}\"] .status').textContent, "
                           "$('replicas').textContent, document.title]")
        mine, live_ = re.search(both, text[0]), re.search(both, text[1])
        named = '"behind the long one": denoising' in text[1]
        return mine and live_ and named and mine.groups() == live_.groups() and text

    texts = wait_for(same_step, "the request's step on the page and in the Live table")
    assert re.fullmatch(r"denoising · step \d+ of 80 on \S+ · \d+ s in all", texts[0]), texts[0]
    assert re.fullmatch(r"\d+% · denoising — replicadp", texts[2]), texts[2]
    first = item(browser, job_id, "li.querySelector('progress').value")
    cancel = browser.find_element(By.CSS_SELECTOR, f'#requests li[data-id="{job_id}"] button.cancel')
    js(browser, "arguments[0].focus()", cancel)
    wait_for(lambda: item(browser, job_id, "li.querySelector('progress').value") > first + 2, "the bar to move")
    assert browser.switch_to.active_element == cancel, "the focus left the Cancel button as the page polled"
    cancel.click()
    wait_for(lambda: item(browser, job_id, "li.dataset.status") == "cancelled", "the page to say cancelled")
    assert phases(browser)[-2:] == ["cancelling", "cancelled"], phases(browser)
    assert "queued" in phases(browser) and "denoising" in phases(browser)
    meta = result_meta(slow.redis_url, job_id)
    assert meta["status"] == RequestState.FAILURE and meta["result"]["exc_type"] == "RequestCancelled"
    wait_for(lambda: "idle" in browser.find_element(By.ID, "replicas").text, "the Live table to show the replica idle")
    assert "behind the long one" not in browser.find_element(By.ID, "replicas").text
    assert browser.title == "replicadp"


def test_a_cancel_during_the_decode_says_cancelling_until_the_replica_stops(decoding, browser):
    """A request cancelled while its replica decodes (after its last step, where no step checks the cancel) shows
    "decoding", then "cancelling" for as long as the replica goes on (its task not ended, the Live table says
    cancelling too), then "cancelled" once the replica has stopped it (RequestCancelled; no video stored)."""
    open_page(browser, decoding)
    fill_request(browser, lasting(0.5), "cancelled while it decodes")
    browser.find_element(By.ID, "submit").click()
    job_id = my_request(browser)
    watch_phases(browser, job_id)
    wait_for(lambda: item(browser, job_id, "li.dataset.phase") == "decoding", "the page to say decoding")
    assert re.fullmatch(r"decoding the video on \S+ · \d+ s · \d+ s in all",
                        item(browser, job_id, "li.querySelector('.status').textContent"))
    browser.find_element(By.CSS_SELECTOR, f'#requests li[data-id="{job_id}"] button.cancel').click()
    wait_for(lambda: item(browser, job_id, "li.dataset.status") == "cancelling", "the page to say cancelling")
    meta = result_meta(decoding.redis_url, job_id)
    assert meta["status"] not in READY, f"the replica had stopped when the page said cancelling: {meta}"
    wait_for(lambda: "cancelling" in browser.find_element(By.ID, "replicas").text, "the Live table to say cancelling")
    assert decoding.client.get(f"/v1/videos/{job_id}").json()["phase"] == "cancelling"
    wait_for(lambda: item(browser, job_id, "li.dataset.status") == "cancelled", "the page to say cancelled",
             timeout=DECODE_S + 30)
    meta = result_meta(decoding.redis_url, job_id)
    assert meta["status"] == RequestState.FAILURE and meta["result"]["exc_type"] == "RequestCancelled"
    assert phases(browser)[-3:] == ["decoding", "cancelling", "cancelled"], phases(browser)
    assert decoding.client.get(f"/v1/videos/{job_id}/content").status_code == 409


def test_a_gallery_load_fetches_small_posters_and_no_mp4_and_a_second_load_takes_them_from_the_cache(slow):
    """Behind an API key, with 13 finished videos (more than a page of the gallery, 12), a first load of /ui (a
    fresh browser) fetches one small JPEG poster per card shown and not one byte of MP4; "Load more" shows the 13th,
    with its poster; a second load takes every poster from the browser's HTTP cache (transferSize 0), though each
    fetch sends the key; a click on a poster fetches that one MP4 and plays it. Measured through the browser's own
    resource timing entries."""
    key = "ui-gallery-key"  # a tenant of its own: its gallery holds these 13 videos only
    with gateway(slow.redis_url, "ui-gallery", "--api-key", key) as gw:
        ids = [send(gw, lasting(0.25, prompt=f"gallery {n}", seed=n), key=key) for n in range(13)]
        for job_id in ids:
            completed(gw, job_id, key=key)
        with chromium() as driver:
            open_page(driver, gw)
            driver.find_element(By.ID, "api-key").send_keys(key)
            driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
            wait_for(lambda: posters_shown(driver) == 12, "12 posters in the first gallery page")
            posters = resources(driver, "/poster")
            newest = sorted(f"{gw.url}/v1/videos/{i}/poster" for i in ids[1:])
            assert sorted(p["name"] for p in posters) == newest, posters
            assert all(0 < p["encodedBodySize"] < 20_000 for p in posters), posters
            assert resources(driver, "/content") == []
            assert js(driver, "return document.querySelectorAll('.card video').length") == 0
            driver.find_element(By.ID, "more").click()
            wait_for(lambda: posters_shown(driver) == 13, "the 13th video after Load more")
            assert len(resources(driver, "/poster")) == 13 and not driver.find_element(By.ID, "more").is_displayed()
            driver.get(f"{gw.url}/ui")  # the same tab: the key is still in its sessionStorage
            wait_for(lambda: posters_shown(driver) == 12, "the gallery again")
            again = resources(driver, "/poster")
            assert len(again) == 12 and all(p["transferSize"] == 0 for p in again), again
            driver.find_element(By.CSS_SELECTOR, f'.card[data-video-id="{ids[-1]}"] .thumb').click()
            wait_for(lambda: plays(driver, ids[-1]), "the newest video to play")
            assert [r["name"] for r in resources(driver, "/content")] == [f"{gw.url}/v1/videos/{ids[-1]}/content"]


def test_the_first_view_offers_examples_sizes_defaults_and_the_cost(slow, browser):
    """Without API keys, the page shows no key box; example prompts fill the prompt; sizes are labelled presets
    (rounded to the replicas' size multiple) or custom; the inputs hold the gateway's defaults as values (from
    /v1/status); the cost of the request in the form (seconds on a replica from /v1/status's request_cost, plus the
    expected wait of its priority) shows before it is sent, and only for a size near the recent jobs'. The favicon
    is served (an SVG, also at /favicon.ico)."""
    completed(slow, send(slow, lasting(0.5, prompt="warm-up")))  # a recent job: the page knows what a request costs
    open_page(browser, slow)
    assert not browser.find_element(By.ID, "key-form").is_displayed()
    example = browser.find_element(By.CSS_SELECTOR, "#examples button")
    example.click()
    prompt = example.get_attribute("aria-label").split('"')[1]
    assert browser.find_element(By.ID, "f-prompt").get_attribute("value") == prompt
    status = slow.client.get("/v1/status").json()
    defaults, multiple = status["defaults"], status["replicas"][0]["size_multiple"]
    options = browser.find_elements(By.CSS_SELECTOR, "#f-size-preset option")
    presets = {o.get_attribute("value"): o.text for o in options}
    assert [t.split(" · ")[0] for t in presets.values()] == ["480p landscape", "720p", "portrait", "square",
                                                             "custom…"]
    for value in list(presets)[:-1]:
        assert all(int(side) % multiple == 0 for side in value.split("x")), presets
    size = Select(browser.find_element(By.ID, "f-size-preset")).first_selected_option
    assert size.get_attribute("value") == defaults["size"]
    values = {name: browser.find_element(By.ID, f"f-{name}").get_attribute("value")
              for name in ("length", "num_inference_steps", "guidance_scale")}
    assert values == {"length": str(defaults["num_frames"]), "guidance_scale": f"{defaults['guidance_scale']:.1f}",
                      "num_inference_steps": str(defaults["num_inference_steps"])}, values
    fill(browser, size="64x64", length=5, num_inference_steps=4)  # twice the warm-up's size
    Select(browser.find_element(By.ID, "f-priority")).select_by_value("batch")

    def cost():  # the page's line and the status it computed it from, read at once
        shown, st = js(browser, "return [$('cost').textContent, ui.status]")
        return st["request_cost"] is not None and (shown, st)

    shown, st = wait_for(cost, "a known cost of a request")
    model = st["request_cost"]
    seconds = model["fixed_s"] + model["per_unit_s"] * 64 * 64 * 5 / 1e6 * 4
    assert shown.startswith(f"About {round(seconds)} s on a replica; "), (shown, seconds)
    wait = st["expected_wait_s"]["batch"]
    assert ("starts at once (batch)" if wait < 1 else f"after about {round(wait)} s in the batch queue") in shown, shown
    # Far past every recent job's size (832x480, 33 frames, 30 steps): no figure rather than a wild one.
    assert 832 * 480 * 33 / 1e6 * 30 > 4 * model["max_units"]
    fill(browser, size="832x480", length=33, num_inference_steps=30)
    wait_for(lambda: "unknown for this size" in browser.find_element(By.ID, "cost").text, "no cost for a far size")
    for path in ("/favicon.ico", "/ui/favicon.svg"):
        r = httpx.get(f"{slow.url}{path}")
        assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml") and b"<svg" in r.content
    assert browser.find_element(By.CSS_SELECTOR, "link[rel=icon]").get_attribute("href") == f"{slow.url}/ui/favicon.svg"


def luminance(css: str) -> float:
    r, g, b = (int(x) / 255 for x in re.findall(r"\d+", css)[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def test_dark_mode_follows_the_system(slow, browser):
    """With the system in dark mode (prefers-color-scheme: dark, emulated through the DevTools protocol) the page
    and a video's page are dark, with light text and dark inputs; in light mode, light."""
    job_id = send(slow, lasting(0.25, prompt="in the dark"))
    completed(slow, job_id)
    colours = ("const s = e => getComputedStyle(e); return [s(document.documentElement).backgroundColor, "
               "s(document.body).color, s(document.querySelector(arguments[0])).backgroundColor]")
    try:
        for scheme in ("dark", "light"):
            browser.execute_cdp_cmd("Emulation.setEmulatedMedia",
                                    {"features": [{"name": "prefers-color-scheme", "value": scheme}]})
            for path, field in (("/ui", "#f-prompt"), (f"/ui/videos/{job_id}", "#snippet")):
                open_page(browser, slow, path)
                page, text, box = (luminance(c) for c in js(browser, colours, field))
                if scheme == "dark":
                    assert page < 0.15 and text > 0.7 and box < 0.15, (path, page, text, box)
                else:
                    assert page > 0.9 and text < 0.2 and box > 0.9, (path, page, text, box)
    finally:
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})


def test_every_bad_field_is_named_at_once_and_its_error_goes_when_it_is_fixed(slow, browser):
    """Two bad numbers ("17e" steps, "abc" guidance) are refused in the browser, both at once: each named beside its
    field with the value as typed (never replaced by a default), both listed under the form, the first focused,
    nothing sent. Fixing one clears its error as it is typed; the other stays until it is fixed too."""
    open_page(browser, slow)
    before = len(slow.client.get("/v1/videos", params={"limit": 100}).json()["data"])
    fill(browser, prompt="two bad fields", num_inference_steps="17e", guidance_scale="abc")
    browser.find_element(By.ID, "submit").click()
    steps, guidance = (browser.find_element(By.ID, f"f-{n}") for n in ("num_inference_steps", "guidance_scale"))
    assert browser.find_element(By.ID, "err-num_inference_steps").text == 'Steps: "17e" is not a whole number'
    assert browser.find_element(By.ID, "err-guidance_scale").text == 'Guidance: "abc" is not a number'
    assert browser.find_element(By.ID, "form-error").text == "Fix these 2 fields: Steps, Guidance."
    assert steps.get_attribute("aria-invalid") == guidance.get_attribute("aria-invalid") == "true"
    assert steps.get_attribute("value") == "17e" and guidance.get_attribute("value") == "abc"
    assert browser.switch_to.active_element == steps
    assert js(browser, "return document.querySelectorAll('#requests li').length") == 0
    assert len(slow.client.get("/v1/videos", params={"limit": 100}).json()["data"]) == before
    steps.send_keys("\b")  # "17": fixed
    assert browser.find_element(By.ID, "err-num_inference_steps").text == ""
    assert steps.get_attribute("aria-invalid") is None and guidance.get_attribute("aria-invalid") == "true"
    assert browser.find_element(By.ID, "err-guidance_scale").text == 'Guidance: "abc" is not a number'
    guidance.clear()
    guidance.send_keys("4.5")
    assert browser.find_element(By.ID, "err-guidance_scale").text == ""
    assert browser.find_element(By.ID, "form-error").text == ""


@pytest.mark.parametrize("fields, field, words", [
    ({"size": "100x100"}, "size", "Size: 100 is not a multiple of 16"),  # the browser's check
    ({"length": 6}, "length", "must be of the form 4k+1"),  # the browser's check
    ({"num_inference_steps": 999}, "num_inference_steps", "num_inference_steps"),  # the gateway's 400
])
def test_bad_input_shows_its_error_next_to_its_field(slow, browser, fields, field, words):
    """A value the browser can tell is wrong, or the gateway's 400 (OpenAI's error object, `param` naming the field)
    for one it cannot, is shown under the input it names, which is marked invalid, described by the message and
    focused; no request is listed."""
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


def test_my_requests_show_eight_keep_thirty_and_clear_the_finished_ones(slow, browser):
    """"My requests" shows the newest 8 of the 30 it keeps, the rest behind "Show all 30"; a new request keeps
    the list at 30 (the oldest goes); "Clear finished" leaves only the requests still running."""
    open_page(browser, slow)
    old = [{"id": f"old-{n}", "prompt": f"old request {n}", "created_at": 0, "state": "failed"} for n in range(30)]
    js(browser, "localStorage.setItem('replicadp.requests', JSON.stringify(arguments[0]))", old)
    browser.refresh()
    count = "return document.querySelectorAll('#requests li').length"
    wait_for(lambda: js(browser, count) == 8, "8 requests shown")
    show_all = browser.find_element(By.CSS_SELECTOR, "#mine-foot .show-all")
    assert show_all.text == "Show all 30" and show_all.get_attribute("aria-expanded") == "false"
    show_all.click()
    assert js(browser, count) == 30 and show_all.text == "Show fewer"
    show_all.click()
    fill_request(browser, lasting(20), "a running one")
    browser.find_element(By.ID, "submit").click()
    job_id = my_request(browser, listed=tuple(e["id"] for e in old))
    stored = js(browser, "return JSON.parse(localStorage.getItem('replicadp.requests')).map(e => e.id)")
    assert len(stored) == 30 and stored[0] == job_id and "old-29" not in stored
    browser.find_element(By.CSS_SELECTOR, "#mine-foot .clear").click()
    assert js(browser, "return [...document.querySelectorAll('#requests li')].map(li => li.dataset.id)") == [job_id]
    assert js(browser, "return JSON.parse(localStorage.getItem('replicadp.requests')).length") == 1
    assert not show_all.is_displayed()
    assert slow.client.delete(f"/v1/videos/{job_id}").status_code == 200


def test_the_layouts_at_desktop_and_phone_sizes(slow, browser):
    """At 1366x900 each column stacks its sections with no band between them (the gallery follows the Live table
    however long the form is). At 390x844 nothing overflows sideways, a request's progress bar spans its item, the
    Live table's bar spans the value of its State line (not the label column), and a video's page has its actions
    in view."""
    done = send(slow, lasting(0.25, prompt="a finished one"))
    completed(slow, done)
    open_page(browser, slow)
    gaps = js(browser, "return [...document.querySelectorAll('main > .column')].map(c => [...c.children].map(s => "
                       "s.getBoundingClientRect()).map((r, i, all) => i ? r.top - all[i - 1].bottom : r.top))")
    assert len(gaps) == 2 and gaps[0][0] == gaps[1][0] and all(abs(g - 16) < 0.5 for c in gaps for g in c[1:]), gaps
    with chromium(*PHONE) as phone:
        open_page(phone, slow)
        fill_request(phone, lasting(20), "on a phone")
        phone.find_element(By.ID, "submit").click()
        job_id = my_request(phone)
        wait_for(lambda: js(phone, "return $('replicas').querySelector('progress')"), "the Live table's bar")
        bar, li = js(phone, f"const li = document.querySelector('#requests li[data-id=\"{job_id}\"]');"
                            "const s = getComputedStyle(li), bar = li.querySelector('progress');"
                            "return [bar.getBoundingClientRect().width, "
                            "li.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight)]")
        assert abs(bar - li) < 1, (bar, li)
        live_bar, value, label = js(phone, "const b = $('replicas').querySelector('progress'); return [b, "
                                           "b.closest('.state'), b.closest('td')].map(e => e.getBoundingClientRect())")
        assert live_bar["left"] >= label["left"] + 70 and abs(live_bar["width"] - value["width"]) < 1, (live_bar, value)
        assert js(phone, "return document.documentElement.scrollWidth") <= PHONE[0]
        assert slow.client.delete(f"/v1/videos/{job_id}").status_code == 200
        phone.get(f"{slow.url}/ui/videos/{done}")
        wait_for(lambda: phone.find_element(By.ID, "actions").is_displayed(), "the video's page")
        assert js(phone, "return $('download').getBoundingClientRect().bottom <= innerHeight"), "Download out of view"
        assert js(phone, "return document.documentElement.scrollWidth") <= PHONE[0]


def test_the_live_table_greys_when_the_gateway_stops_answering(slow, browser):
    """When the gateway stops answering, the page says so, greys the Live table and My requests (class stale) and
    says how long ago they were last updated, counting up."""
    with gateway(slow.redis_url, "ui-stopping") as gw:
        open_page(browser, gw)
        wait_for(lambda: "replica" in browser.find_element(By.ID, "replicas").text, "the Live table")
        assert "stale" not in browser.find_element(By.ID, "live").get_attribute("class")
    updated = browser.find_element(By.ID, "updated")
    gone = r"Last updated (\d+) s ago: the gateway does not answer\."
    first = wait_for(lambda: updated.is_displayed() and re.fullmatch(gone, updated.text),
                     "the page to say the gateway is gone")
    assert "stale" in browser.find_element(By.ID, "live").get_attribute("class").split()
    assert "stale" in browser.find_element(By.ID, "mine").get_attribute("class").split()
    assert "Cannot reach the gateway" in browser.find_element(By.ID, "alert").text
    wait_for(lambda: (m := re.search(r"(\d+) s ago", updated.text)) and int(m.group(1)) > int(first.group(1)),
             "the time since the last update to count up")


def test_without_a_key_the_page_loads_and_asks_for_it(redis_db, browser):
    """With API keys, the page itself loads without one and shows no key box until its /v1 calls get 401; then it
    asks for the key, and once given shows the cluster (here: no live replica)."""
    with gateway(redis_db(), "ui-keys", "--api-key", KEY) as gw:
        assert httpx.get(f"{gw.url}/ui").status_code == 200
        assert gw.client.get("/v1/status").status_code == 401
        assert gw.client.get("/v1/status", headers=auth(KEY)).json()["replicas"] == []
        open_page(browser, gw)
        alert = wait_for(lambda: browser.find_element(By.ID, "alert").text, "the page to ask for the key")
        assert "needs an API key" in alert and browser.find_element(By.ID, "key-form").is_displayed()
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
    name; a request sent with "style:0.5" runs with it (its job's params say so) and its video's page lists it; an
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
            item(browser, job_id, "li.querySelector('a.view')").click()
            wait_for(lambda: "LoRA adapters\nstyle:0.5" in browser.find_element(By.ID, "inputs").text,
                     "the video's page to list its adapter")
    finally:
        group.stop()

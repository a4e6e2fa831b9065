"""Structured logs (REPLICADP_LOG_FORMAT=json) and a hub model's download progress, as an operator sees them: the
log files of real replicas and of a real gateway, and a real download by huggingface_hub from a Hub-protocol
server on 127.0.0.1 that serves the tiny model's files."""

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import SESSION_DIR, run_client_on, start_replicas
from test_http import gateway

from client.local.replicas import replica_names

REPLICADP = str(Path(sys.executable).parent / "replicadp")
SMALL = {"prompt": "a heron in reeds", "height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 2}
REPO = "replicadp-tests/tiny-wan"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def json_lines(path: Path) -> list[dict]:
    """Every line of a log file as a JSON object; a line that is not one fails the test, naming it."""
    lines = []
    for number, text in enumerate(path.read_text().splitlines(), 1):
        try:
            lines.append(json.loads(text))
        except ValueError:
            pytest.fail(f"{path}:{number} is not JSON: {text!r}")
    return lines


def test_replica_lines_are_json_and_name_the_request(redis_db, tiny_model):
    """With REPLICADP_LOG_FORMAT=json every line a replica's processes write (the launcher's, Celery's, ours, a
    failed request's traceback) is one JSON object with time, level, logger, message, role and replica name;
    the lines about a request carry its task id, and those written while it ran its request id too."""
    url, name = redis_db(), "logs-json"
    log_path = SESSION_DIR / "logs" / f"{name}.log"
    group = start_replicas(1, url, name, REPLICADP_LOG_FORMAT="json")
    try:
        ok, bad = run_client_on(url, [{**SMALL, "request_id": "heron-1"}, {**SMALL, "height": 65}], concurrency=1)
    finally:
        group.stop()
    assert ok.ok and not bad.ok, (ok.error, bad.error)
    lines = json_lines(log_path)
    replica = replica_names(1)[0]
    assert {line["role"] for line in lines} == {"replica", "launcher"}
    for line in lines:
        assert {"time", "level", "logger", "message", "pid"} <= line.keys() and line["time"].endswith("+00:00")
        assert line["role"] == "launcher" or line["replica"] == replica, line
    assert any(line["message"].startswith(f"replica {replica} loaded") for line in lines)
    for outcome, request_id in ((ok, "heron-1"), (bad, bad.task_id)):
        about = [line for line in lines if outcome.task_id in line["message"]]
        assert any("received" in line["message"] for line in about), about  # the main process's
        assert all(line.get("task_id") == outcome.task_id for line in about), about
        during = [line for line in lines if line.get("request_id") == request_id]
        assert during and all(line["task_id"] == outcome.task_id for line in during), during
    failed = [line for line in lines if line.get("task_id") == bad.task_id and "exc" in line]
    assert failed and "InvalidRequest" in failed[0]["exc"], [line for line in lines if line.get("task_id") == bad.task_id]


def test_gateway_lines_are_json(redis_db):
    """With REPLICADP_LOG_FORMAT=json the gateway's lines (uvicorn's start and stop, its access log) are JSON
    objects with role "gateway"; an access line says client, method, path and status, and a job's route its
    job (task) id."""
    with gateway(redis_db(), "logs-json", REPLICADP_LOG_FORMAT="json") as gw:
        assert gw.client.get("/v1/videos/no-such-job").status_code == 404
    lines = json_lines(gw.log_path)
    assert lines and all(line["role"] == "gateway" and line["level"] for line in lines)
    assert any(line["logger"] == "uvicorn.error" and "Application startup complete" in line["message"]
               for line in lines)
    access = [line for line in lines if line["logger"] == "uvicorn.access" and line["path"] == "/v1/videos/no-such-job"]
    assert len(access) == 1 and access[0]["method"] == "GET" and access[0]["status"] == 404
    assert access[0]["task_id"] == "no-such-job" and access[0]["client"].startswith("127.0.0.1:")


# --- the download ----------------------------------------------------------------------------------------


class Hub(ThreadingHTTPServer):
    """Enough of the Hub's HTTP protocol for huggingface_hub's snapshot_download and hf_hub_download, serving the
    files of `folder` as model REPO at COMMIT: repo info, the file tree, each file's metadata (HEAD) and bytes.
    Keeps the paths it was asked for."""

    def __init__(self, folder: Path):
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        self.asked: list[str] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def oid(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id, as the Hub gives it


class HubHandler(BaseHTTPRequestHandler):
    server: Hub

    def do_HEAD(self):
        self.answer(body=False)

    def do_GET(self):
        self.answer(body=True)

    def answer(self, body: bool):
        path = urlsplit(self.path).path
        self.server.asked.append(f"{self.command} {path}")
        files = self.server.files
        headers, data = {"X-Repo-Commit": COMMIT}, None
        if path in (f"/api/models/{REPO}/revision/main", f"/api/models/{REPO}/revision/{COMMIT}"):
            data = json.dumps({"id": REPO, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}).encode()
        elif path == f"/api/models/{REPO}/tree/{COMMIT}":
            data = json.dumps([{"type": "file", "path": f, "size": len(files[f]), "oid": self.server.oid(f)}
                               for f in files]).encode()
        else:
            for revision in ("main", COMMIT):
                name = path.removeprefix(f"/{REPO}/resolve/{revision}/")
                if name != path and name in files:
                    data, headers["ETag"] = files[name], f'"{self.server.oid(name)}"'
        if data is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(tiny_model):
    server = Hub(tiny_model)
    yield server
    server.shutdown()
    server.server_close()


def hub_env(hub: Hub, home: Path, offline: bool = False) -> dict:
    """A process's environment for `hub`: a Hugging Face cache of its own, online unless `offline`."""
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1" if offline else "0",
            "HF_HUB_DISABLE_TELEMETRY": "1"}


def test_first_start_downloads_the_model_and_logs_its_progress(redis_db, hub, tmp_path):
    """A replica of a hub model that the cache lacks downloads it at start, logging (JSON) how many files and
    bytes, its progress and its end, then loads it and serves."""
    url, name = redis_db(), "logs-download"
    group = start_replicas(1, url, name, model=REPO, REPLICADP_LOG_FORMAT="json", **hub_env(hub, tmp_path / "hf"))
    try:
        [outcome] = run_client_on(url, [SMALL], concurrency=1)
    finally:
        group.stop()
    assert outcome.ok, outcome.error
    assert f"GET /{REPO}/resolve/{COMMIT}/transformer/diffusion_pytorch_model.safetensors" in hub.asked
    messages = [line["message"] for line in json_lines(SESSION_DIR / "logs" / f"{name}.log")
                if line["logger"] == "replicadp"]
    files = len(hub.files) - 1  # model_index.json comes first, alone
    total = sum(len(data) for path, data in hub.files.items() if path != "model_index.json")
    start = f"model {REPO}: downloading {files} files, {total / 1000:.1f} kB"
    assert start in messages, messages
    progress = [m for m in messages if m.startswith(f"model {REPO}: ") and "downloaded (" in m]
    assert progress and all(f"of {total / 1000:.1f} kB downloaded" in m for m in progress), messages
    assert any(m.startswith(f"model {REPO}: downloaded {files} files") for m in messages), messages


def download_in(env: dict) -> subprocess.CompletedProcess:
    """hub.download(REPO) in a process of its own (huggingface_hub reads HF_HUB_OFFLINE once, at import), its
    log lines on stderr."""
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, format='%(name)s: %(message)s'); "
            f"from replicadp_tasks.model.hub import download; print(download({REPO!r}))")
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


def test_a_cached_model_is_not_downloaded_again_and_offline_asks_nothing(hub, tmp_path):
    """Once the cache holds the model, the next start says "already in the cache" and fetches no file; with
    HF_HUB_OFFLINE=1 it asks the hub nothing at all, and a model the cache lacks is an error, not a download."""
    home = tmp_path / "hf"
    first = download_in(hub_env(hub, home))
    assert first.returncode == 0 and "downloading" in first.stderr, first.stderr
    hub.asked.clear()
    again = download_in(hub_env(hub, home))
    assert again.returncode == 0 and f"model {REPO}: already in the cache" in again.stderr, again.stderr
    assert again.stdout == first.stdout and not [a for a in hub.asked if a.startswith("GET /" + REPO)], hub.asked
    hub.asked.clear()
    offline = download_in(hub_env(hub, home, offline=True))
    assert offline.returncode == 0 and f"model {REPO}: in the cache (offline" in offline.stderr, offline.stderr
    assert offline.stdout == first.stdout
    missing = download_in(hub_env(hub, tmp_path / "empty", offline=True))
    assert missing.returncode != 0 and "LocalEntryNotFoundError" in missing.stderr, missing.stderr
    assert hub.asked == []

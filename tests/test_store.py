"""The output store's pair (video + metadata) is all or nothing, and a request id never hands out another input's
bytes: a write that fails leaves nothing a reader sees, a video left without its metadata is replaced, and the
bytes fetched are checked against the result's hash. Retention and DELETE remove pairs, and only the ones they
should (the S3 store: test_s3.py)."""

import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import redis

from client.api import _app_for
from conftest import start_replicas
from helpers import SYNTHETIC, lasting, wait_for
from test_http import form_of, gateway, job_once, multipart
from replicadp_tasks.contract import StoreError
from replicadp_tasks.outputs.store import DirStore, RedisStore
from replicadp_tasks.outputs import fetch_video

# Writes in a process whose files may not grow past a limit (RLIMIT_FSIZE): the kernel fails the write with EFBIG,
# as a full disk fails it with ENOSPC. Prints what put raised.
LIMITED_PUT = """
import json, resource, signal, sys
from pathlib import Path
from replicadp_tasks.outputs.store import DirStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
try:
    DirStore(Path(sys.argv[1])).put("r1", b"v" * 1000, {"padding": "m" * int(sys.argv[3])})
except Exception as exc:
    print(type(exc).__name__)
"""


def limited_put(root, limit: int, padding: int) -> str:
    run = subprocess.run([sys.executable, "-c", LIMITED_PUT, str(root), str(limit), str(padding)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


@pytest.mark.parametrize("failing", ["video", "metadata"])
def test_a_failed_write_leaves_nothing(tmp_path, failing):
    """Whichever of the two files the disk refuses (the 1000-byte video, or metadata padded past the limit), put
    fails with StoreError and the folder holds neither file nor a temp file; the next put of the same request id
    stores its own pair."""
    padding = 10 if failing == "video" else 5000
    assert limited_put(tmp_path, 2000 if failing == "metadata" else 500, padding) == "StoreError"
    assert list(tmp_path.iterdir()) == []
    stored = DirStore(tmp_path).put("r1", b"second", {"n": 2})
    assert fetch_video(stored["video_uri"], "", sha256=None) == b"second" and stored["n"] == 2


def test_a_video_without_metadata_is_replaced(tmp_path):
    """An MP4 left without its JSON (a write that failed before this version, or a crash) is another request's
    bytes: the next put of that request id stores its own, which its JSON names, and the left-over is never
    served."""
    (tmp_path / "r1.mp4").write_bytes(b"left over from other inputs")
    stored = DirStore(tmp_path).put("r1", b"mine", {"n": 1})
    assert fetch_video(stored["video_uri"], "") == b"mine" and stored["n"] == 1
    assert DirStore(tmp_path).put("r1", b"later", {"n": 2})["n"] == 1  # the first complete pair wins


def test_fetch_refuses_bytes_that_are_not_the_results(tmp_path):
    """fetch_video with the result's hash refuses other bytes under the result's URI."""
    stored = DirStore(tmp_path).put("r1", b"mine", {})
    assert fetch_video(stored["video_uri"], "", hashlib.sha256(b"mine").hexdigest()) == b"mine"
    video_path(stored).write_bytes(b"swapped")
    with pytest.raises(StoreError, match="sha256"):
        fetch_video(stored["video_uri"], "", hashlib.sha256(b"mine").hexdigest())


def test_redis_store_is_all_or_nothing(redis_db):
    """The Redis store sets both keys in one transaction: a pair, and the first complete pair wins."""
    client = redis.Redis.from_url(redis_db())
    store = RedisStore(client, 60)
    first = store.put("r1", b"one", {"n": 1})
    assert store.put("r1", b"two", {"n": 2}) == first
    assert client.get("replicadp:store:r1.mp4") == b"one" and json.loads(client.get("replicadp:store:r1.json")) == first


def test_replica_replaces_a_left_over_video(redis_db, tmp_path):
    """A real replica: a request whose id has a video left without metadata in the output folder stores and
    returns its own video, and the bytes fetched are its own (the hash in its result)."""
    url, out = redis_db(), tmp_path / "outputs"
    out.mkdir()
    request_id = f"left-{uuid.uuid4()}"
    (out / f"{request_id}.mp4").write_bytes(os.urandom(4096))
    group = start_replicas(1, url, "store", model=SYNTHETIC, OUTPUT_DIR=str(out))
    try:
        result = _app_for(url).send_task("replicadp.generate",
                                         kwargs=lasting(0.25, request_id=request_id)).get(timeout=60)
    finally:
        group.stop()
    video = fetch_video(result["video_uri"], url, result["video_sha256"])
    assert hashlib.sha256(video).hexdigest() == result["video_sha256"] and video[4:8] == b"ftyp"


def video_path(stored: dict) -> Path:
    """The file a folder store's result names."""
    return Path(unquote(urlparse(stored["video_uri"]).path))


def backdate(root, request_id: str, seconds: float) -> None:
    """Make a stored pair look written `seconds` ago."""
    for path in (root / f"{request_id}.json", video_path(DirStore(root).get_meta(request_id))):
        then = path.stat().st_mtime - seconds
        os.utime(path, (then, then))


def test_dir_sweep_removes_only_what_is_older_than_the_cutoff(tmp_path):
    """The folder's sweep removes pairs, MP4s left without their JSON and temp files of writes that died, written
    before the cutoff; newer pairs stay, and so does what is not the store's."""
    store, now = DirStore(tmp_path), time.time()
    store.put("old", b"old", {})
    new = store.put("new", b"new", {})
    backdate(tmp_path, "old", 7200)
    orphan = f"orphan.{uuid.uuid4().hex}.mp4"
    (tmp_path / orphan).write_bytes(b"half")
    (tmp_path / ".replicadp-write-k3j_a9x.json").write_bytes(b"temp")
    (tmp_path / "notes.txt").write_bytes(b"not ours")
    for name in (orphan, ".replicadp-write-k3j_a9x.json", "notes.txt"):
        os.utime(tmp_path / name, (now - 7200, now - 7200))
    assert store.sweep(now - 3600) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["new.json", video_path(new).name, "notes.txt"])
    assert store.get_meta("old") is None and store.get_meta("new") is not None


# What an OUTPUT_DIR of `.` (a project folder, a home) holds beside replicadp's pairs: none of it is the store's.
USERS_FILES = {
    ".env": b"SECRET=1", ".bashrc": b"alias ll='ls -l'", ".gitignore": b"*.pyc", "package.json": b'{"name": "app"}',
    "config.json": b'{"video_uri": "file:///etc/passwd"}', "intro.mp4": b"the user's own video",
    "list.json": b"[1, 2]", "broken.json": b"{", "clip.0123.mp4": b"a user's numbered clip",
    ".vimrc.swp": b"swap", ".hidden.mp4.tmp": b"temp of another program",
}


def test_dir_sweep_touches_only_the_stores_own_files(tmp_path):
    """OUTPUT_DIR is a folder full of the user's files, all older than the TTL: the sweep removes the store's old
    pair only, and every other file stays, byte for byte (had been: every dotfile, .json and .mp4 older than the
    TTL was removed: .env, .bashrc, .gitignore, package.json)."""
    store, now = DirStore(tmp_path), time.time()
    for name, data in USERS_FILES.items():
        (tmp_path / name).write_bytes(data)
        os.utime(tmp_path / name, (now - 86400 * 30, now - 86400 * 30))
    store.put("old", b"old", {})
    backdate(tmp_path, "old", 86400 * 30)
    assert store.sweep(now - 3600) == 2
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == USERS_FILES


def test_dir_sweep_puts_back_what_a_put_wrote_since_the_listing(tmp_path):
    """A file the sweep saw old but that a put replaced before the sweep came to it (an MP4 replacing a failed
    write's) is put back, not removed, and the sweep leaves no file of its own behind."""
    (tmp_path / "r1.mp4").write_bytes(b"written just now")
    assert DirStore._remove_if_older(tmp_path / "r1.mp4", time.time() - 3600) is False
    assert [p.name for p in tmp_path.iterdir()] == ["r1.mp4"]
    assert (tmp_path / "r1.mp4").read_bytes() == b"written just now"


def test_delete_removes_the_pair(tmp_path, redis_db):
    """delete(request_id) removes a pair from the folder and from Redis; deleting what is not there is no error."""
    DirStore(tmp_path).put("r1", b"one", {})
    DirStore(tmp_path).delete("r1")
    DirStore(tmp_path).delete("r1")
    assert list(tmp_path.iterdir()) == []
    client = redis.Redis.from_url(redis_db())
    RedisStore(client, 0).put("r1", b"one", {})
    assert client.ttl("replicadp:store:r1.mp4") == -1  # TTL 0: kept until deleted
    RedisStore(client, 0).delete("r1")
    assert client.keys("*") == []


@pytest.fixture(scope="module")
def dir_cluster(redis_db, tmp_path_factory):
    """A folder holding the user's files and a pair written two days ago, a pair written now, then one replica of
    the synthetic backend storing there (REPLICADP_STORE_TTL: a day, the default) and a gateway in front of it."""
    url, out = redis_db(), tmp_path_factory.mktemp("outputs")
    for name, data in USERS_FILES.items():
        (out / name).write_bytes(data)
        os.utime(out / name, (time.time() - 2 * 86400, time.time() - 2 * 86400))
    DirStore(out).put("stale", b"stale", {})
    DirStore(out).put("fresh", b"fresh", {})
    backdate(out, "stale", 2 * 86400)
    group = start_replicas(1, url, "dir-sweep", model=SYNTHETIC, OUTPUT_DIR=str(out))
    try:
        with gateway(url, "dir") as gw:
            gw.out = out
            yield gw
    finally:
        group.stop()


def test_a_replica_sweeps_its_folder(dir_cluster):
    """A real replica removes the pair older than REPLICADP_STORE_TTL from its folder (its main process sweeps as
    it starts, then every STORE_SWEEP_S) and keeps the newer one and the user's files, as old as the stale pair."""
    wait_for(lambda: not (dir_cluster.out / "stale.json").exists(), "the replica to sweep the stale pair")
    fresh = DirStore(dir_cluster.out).get_meta("fresh")
    assert sorted(p.name for p in dir_cluster.out.iterdir()) == sorted(["fresh.json", video_path(fresh).name,
                                                                          *USERS_FILES])


def test_gateway_delete_removes_the_files(dir_cluster):
    """DELETE /v1/videos/{id} of a completed job removes its MP4 and JSON from the folder."""
    job = dir_cluster.client.post("/v1/videos", files=multipart(form_of(lasting(0.25, prompt="dir job")))).json()
    done = wait_for(job_once(dir_cluster, job["id"], lambda j: j["status"] in ("completed", "failed")),
                    "the job to end")
    assert done["status"] == "completed" and done["video_url"] is None, done
    video = video_path(DirStore(dir_cluster.out).get_meta(job["id"]))
    assert video.exists() and (dir_cluster.out / f"{job['id']}.json").exists()
    assert dir_cluster.client.delete(f"/v1/videos/{job['id']}").json()["deleted"] is True
    assert not video.exists() and not (dir_cluster.out / f"{job['id']}.json").exists()


# A writer of racing puts: for each request id read from stdin, put its own bytes under that id and print what put
# returned. Two of them are fed the same ids at the same moment.
RACING_PUT = """
import hashlib, json, sys
from pathlib import Path
from replicadp_tasks.outputs.store import DirStore
store, writer = DirStore(Path(sys.argv[1])), sys.argv[2]
for line in sys.stdin:
    request_id = line.strip()
    video = f"{writer} {request_id} ".encode() * 4096
    print(json.dumps(store.put(request_id, video, {"video_sha256": hashlib.sha256(video).hexdigest(),
                                                   "writer": writer})), flush=True)
"""


def test_racing_puts_of_one_id_keep_the_winners_bytes(tmp_path):
    """Two processes put 300 request ids, each id by both at the same moment with bytes of their own: for every
    id, both get the same metadata back (the first complete pair's), the MP4 that metadata names holds its bytes
    (their sha256 is its video_sha256, which the readers check), and the folder holds that pair only. (Had been:
    the losing write replaced the winner's MP4 before its JSON lost the race, and the stored MP4 was often the
    loser's.)"""
    writers = [subprocess.Popen([sys.executable, "-c", RACING_PUT, str(tmp_path), name], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for name in ("a", "b")]
    ids = [f"race-{n}" for n in range(300)]
    try:
        answers = []
        for request_id in ids:
            for w in writers:  # both told before either answers
                w.stdin.write(request_id + "\n")
                w.stdin.flush()
            answers.append([json.loads(w.stdout.readline()) for w in writers])
    finally:
        for w in writers:
            w.stdin.close()
            assert w.wait(timeout=60) == 0
    store = DirStore(tmp_path)
    mismatched = [request_id for request_id in ids
                  if hashlib.sha256(video_path(store.get_meta(request_id)).read_bytes()).hexdigest()
                  != store.get_meta(request_id)["video_sha256"]]
    assert not mismatched, f"{len(mismatched)} of {len(ids)} MP4s are not their metadata's bytes: {mismatched[:5]}"
    for request_id, (a, b) in zip(ids, answers):
        assert a == b == store.get_meta(request_id)
    winners = {store.get_meta(i)["writer"] for i in ids}
    print(f"\nwinners: {sorted(winners)}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        name for i in ids for name in (f"{i}.json", video_path(store.get_meta(i)).name))

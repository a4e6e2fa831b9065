"""The output store's pair (video + metadata) is all or nothing, and a request id never hands out another input's
bytes: a write that fails leaves nothing a reader sees, a video left without its metadata is replaced, and the
bytes fetched are checked against the result's hash."""

import hashlib
import json
import os
import subprocess
import sys
import uuid

import pytest
import redis

from client.api import _app_for
from conftest import start_replicas
from helpers import SYNTHETIC, lasting
from replicadp_tasks.errors import StoreError
from replicadp_tasks.store import DirStore, RedisStore, fetch_video

# Writes in a process whose files may not grow past a limit (RLIMIT_FSIZE): the kernel fails the write with EFBIG,
# as a full disk fails it with ENOSPC. Prints what put raised.
LIMITED_PUT = """
import json, resource, signal, sys
from pathlib import Path
from replicadp_tasks.store import DirStore
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
    bytes: the next put of that request id replaces it with its own."""
    (tmp_path / "r1.mp4").write_bytes(b"left over from other inputs")
    stored = DirStore(tmp_path).put("r1", b"mine", {"n": 1})
    assert (tmp_path / "r1.mp4").read_bytes() == b"mine" and stored["n"] == 1
    assert DirStore(tmp_path).put("r1", b"later", {"n": 2})["n"] == 1  # the first complete pair wins


def test_fetch_refuses_bytes_that_are_not_the_results(tmp_path):
    """fetch_video with the result's hash refuses other bytes under the result's URI."""
    stored = DirStore(tmp_path).put("r1", b"mine", {})
    assert fetch_video(stored["video_uri"], "", hashlib.sha256(b"mine").hexdigest()) == b"mine"
    (tmp_path / "r1.mp4").write_bytes(b"swapped")
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

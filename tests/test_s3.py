"""REPLICADP_STORE=s3 against a real S3-protocol server (moto's, a process of its own spoken to over HTTP): the pair
is first-writer-wins and all or nothing, results carry a presigned URL a plain HTTP client fetches, the bytes are
checked against the result's hash, retention removes old pairs, DELETE through the gateway removes the objects."""

import hashlib
import threading
import time
import urllib.request
import uuid

import pytest
from conftest import run_client_on, start_replicas
from helpers import SYNTHETIC, lasting, wait_for
from test_http import form_of, gateway, job_once, multipart

from client.api import _app_for
from replicadp_tasks.contract import StoreError
from replicadp_tasks.outputs import delete_stored, fetch_video, open_store
from replicadp_tasks.outputs.store import S3_MAX_URL_TTL_S, S3Store, new_s3_client
from replicadp_tasks.settings import Settings

PREFIX = "replicadp/"


def store_on(s3_server, bucket: str, url_ttl_s: int = 3600) -> S3Store:
    return S3Store(new_s3_client(s3_server.url), bucket, PREFIX, url_ttl_s)


def keys(s3_server, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in s3_server.client.list_objects_v2(Bucket=bucket).get("Contents", []))


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return answer.read()


def test_two_puts_of_one_id_one_pair_wins(s3_server, s3_bucket):
    """Two puts of one request id at once, with different bytes: both callers get the same stored Result, the
    winner's; its bytes are what fetch_video and the presigned URL give; the loser's MP4 is gone. Ten rounds."""
    store = store_on(s3_server, s3_bucket)
    for round_ in range(10):
        request_id, barrier, stored = f"race-{round_}", threading.Barrier(2), {}

        def put(n: int) -> None:
            barrier.wait()
            stored[n] = store.put(request_id, f"video {n}".encode(), {"n": n,
                                  "video_sha256": hashlib.sha256(f"video {n}".encode()).hexdigest()})

        threads = [threading.Thread(target=put, args=(n,)) for n in (1, 2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        winner = {k: v for k, v in stored[1].items() if not k.startswith("video_url")}
        assert winner == {k: v for k, v in stored[2].items() if not k.startswith("video_url")}
        video = f"video {winner['n']}".encode()
        assert fetch_video(winner["video_uri"], "", winner["video_sha256"], s3_endpoint_url=s3_server.url) == video
        assert http_get(stored[1]["video_url"]) == video == http_get(stored[2]["video_url"])
        assert [k for k in keys(s3_server, s3_bucket) if k.startswith(f"{PREFIX}{request_id}.")] == sorted(
            [f"{PREFIX}{request_id}.json", winner["video_uri"].split("/", 3)[3]])
        assert store.put(request_id, b"later", {"n": 3})["n"] == winner["n"]  # a later put gets the winner too


def test_results_carry_a_url_that_works_until_it_expires(s3_server, s3_bucket):
    """A Result from the store carries a presigned GET URL that plain HTTP fetches, and when it expires (the URL
    lifetime from now); the stored JSON carries none (it would expire with it)."""
    store = store_on(s3_server, s3_bucket, url_ttl_s=600)
    before = int(time.time())
    stored = store.put("r1", b"mp4 bytes", {"n": 1})
    assert stored["video_uri"].startswith(f"s3://{s3_bucket}/{PREFIX}r1.")
    assert http_get(stored["video_url"]) == b"mp4 bytes"
    assert before + 600 <= stored["video_url_expires_at"] <= int(time.time()) + 600
    raw = s3_server.client.get_object(Bucket=s3_bucket, Key=f"{PREFIX}r1.json")["Body"].read()
    assert b"video_url" not in raw


def test_fetch_refuses_bytes_that_are_not_the_results(s3_server, s3_bucket):
    """fetch_video reads s3:// URIs: with the result's hash it refuses other bytes under the result's key, and a
    removed object is a StoreError that says so."""
    stored = store_on(s3_server, s3_bucket).put("r1", b"mine", {})
    sha = hashlib.sha256(b"mine").hexdigest()
    assert fetch_video(stored["video_uri"], "", sha, s3_endpoint_url=s3_server.url) == b"mine"
    key = stored["video_uri"].split("/", 3)[3]
    s3_server.client.put_object(Bucket=s3_bucket, Key=key, Body=b"swapped")
    with pytest.raises(StoreError, match="sha256"):
        fetch_video(stored["video_uri"], "", sha, s3_endpoint_url=s3_server.url)
    s3_server.client.delete_object(Bucket=s3_bucket, Key=key)
    with pytest.raises(StoreError, match="not in the bucket"):
        fetch_video(stored["video_uri"], "", sha, s3_endpoint_url=s3_server.url)


def test_bad_settings_are_refused(s3_server):
    """No bucket, or a URL lifetime past SigV4's 7 days, is a StoreError naming the setting."""
    with pytest.raises(StoreError, match="REPLICADP_S3_BUCKET"):
        S3Store(new_s3_client(s3_server.url), "", PREFIX, 3600)
    with pytest.raises(StoreError, match=f"REPLICADP_S3_URL_TTL={S3_MAX_URL_TTL_S + 1}"):
        S3Store(new_s3_client(s3_server.url), "any", PREFIX, S3_MAX_URL_TTL_S + 1)


@pytest.mark.parametrize("prefix", ["", "replicadp", "videos/replicadp"])
def test_a_prefix_that_is_no_folder_is_refused_at_start(s3_server, s3_bucket, monkeypatch, prefix):
    """REPLICADP_S3_PREFIX empty or not ending in '/' stops the store from opening (a replica's start), naming the
    setting and its value: its sweep would remove other objects of the bucket (had been: `""` or `replicadp`
    swept every old `.json`/`.mp4` of the bucket, or of `replicadp-backups/`)."""
    monkeypatch.setenv("REPLICADP_STORE", "s3")
    monkeypatch.setenv("REPLICADP_S3_BUCKET", s3_bucket)
    monkeypatch.setenv("REPLICADP_S3_ENDPOINT_URL", s3_server.url)
    monkeypatch.setenv("REPLICADP_S3_PREFIX", prefix)
    with pytest.raises(StoreError, match=f"REPLICADP_S3_PREFIX={prefix!r}: must be a folder"):
        open_store(Settings.from_env())
    monkeypatch.setenv("REPLICADP_S3_PREFIX", prefix + "/")
    assert open_store(Settings.from_env()).prefix == prefix + "/"


def test_delete_removes_the_pair(s3_server, s3_bucket):
    """delete(request_id) removes the JSON and the MP4 it names; so does delete_stored from a Result (what the
    gateway's DELETE calls); deleting what is not there is no error."""
    store = store_on(s3_server, s3_bucket)
    store.put("r1", b"one", {})
    other = store.put("r2", b"two", {"request_id": "r2"})
    store.delete("r1")
    assert store.get_meta("r1") is None and all(not k.startswith(f"{PREFIX}r1.") for k in keys(s3_server, s3_bucket))
    delete_stored(other, "", s3_endpoint_url=s3_server.url)
    assert keys(s3_server, s3_bucket) == []
    store.delete("r1")


def test_sweep_removes_only_what_is_older_than_the_cutoff(s3_server, s3_bucket):
    """The sweep removes pairs and MP4s no JSON names (a write that failed half way) last written before the
    cutoff, and keeps newer pairs and what is not the store's (other prefixes, deeper "folders", other names, and
    objects named like the store's that it did not write, however old: had been, every old `.json` and `.mp4`
    under the prefix, then every old one named like the store's)."""
    store = store_on(s3_server, s3_bucket)
    old = store.put("old", b"old", {})
    # The MP4 of a put that died before its JSON: the store's own object (its metadata), named by no Result.
    s3_server.client.put_object(Bucket=s3_bucket, Key=f"{PREFIX}orphan.{uuid.uuid4().hex}.mp4", Body=b"half",
                                Metadata={"replicadp": "video"})
    s3_server.client.put_object(Bucket=s3_bucket, Key="elsewhere/old.mp4", Body=b"not ours")
    s3_server.client.put_object(Bucket=s3_bucket, Key=f"{PREFIX}notes.txt", Body=b"not ours")
    # Not the store's, whatever their age: other names, deeper "folders", and names like the store's that it did
    # not write (no metadata of its own: a `package.json` holding `{}` had been removed).
    others = [f"{PREFIX}package.json.bak", f"{PREFIX}intro.mp4", f"{PREFIX}team/old.json", f"{PREFIX}.env",
              f"{PREFIX}team/old.{uuid.uuid4().hex}.mp4", f"{PREFIX}clip.0123.mp4", f"{PREFIX}package.json",
              f"{PREFIX}clip.{uuid.uuid4().hex}.mp4"]
    for key in others:
        s3_server.client.put_object(Bucket=s3_bucket, Key=key, Body=b"not ours")
    written = {o["Key"]: o["LastModified"].timestamp()
               for o in s3_server.client.list_objects_v2(Bucket=s3_bucket)["Contents"]}
    # S3 times are whole seconds: the newer pair is written on a later second than all of those.
    wait_for(lambda: time.time() >= max(written.values()) + 2, "the clock to pass the old objects' second")
    new = store.put("new", b"new", {})
    cutoff = s3_server.client.head_object(Bucket=s3_bucket, Key=f"{PREFIX}new.json")["LastModified"].timestamp()
    assert store.sweep(cutoff) == 3
    assert store.get_meta("old") is None and store.get_meta("new") is not None
    with pytest.raises(StoreError, match="not in the bucket"):
        fetch_video(old["video_uri"], "", s3_endpoint_url=s3_server.url)
    assert fetch_video(new["video_uri"], "", s3_endpoint_url=s3_server.url) == b"new"
    assert keys(s3_server, s3_bucket) == sorted(["elsewhere/old.mp4", f"{PREFIX}notes.txt", f"{PREFIX}new.json",
                                                 new["video_uri"].split("/", 3)[3], *others])


def test_a_replica_sweeps_the_bucket(s3_server, s3_bucket, redis_db):
    """A real replica with REPLICADP_STORE_TTL=1 removes a pair older than that from its bucket (its main process
    sweeps as it starts, then every STORE_SWEEP_S)."""
    url, store = redis_db(), store_on(s3_server, s3_bucket)
    store.put("stale", b"stale", {})
    written = s3_server.client.head_object(Bucket=s3_bucket, Key=f"{PREFIX}stale.json")["LastModified"].timestamp()
    wait_for(lambda: time.time() >= written + 2, "the pair to be older than the TTL")
    group = start_replicas(1, url, "s3-sweep", model=SYNTHETIC, REPLICADP_STORE="s3", REPLICADP_S3_BUCKET=s3_bucket,
                           REPLICADP_STORE_TTL="1")
    try:
        wait_for(lambda: keys(s3_server, s3_bucket) == [], "the replica to sweep the stale pair")
    finally:
        group.stop()


@pytest.fixture(scope="module")
def s3_cluster(s3_server, redis_db):
    """One replica of the synthetic backend storing to a bucket of its own, and a gateway in front of it."""
    url, bucket = redis_db(), f"cluster-{uuid.uuid4().hex[:16]}"
    s3_server.client.create_bucket(Bucket=bucket)
    group = start_replicas(1, url, "s3", model=SYNTHETIC, REPLICADP_STORE="s3", REPLICADP_S3_BUCKET=bucket)
    try:
        with gateway(url, "s3") as gw:
            gw.bucket = bucket
            yield gw
    finally:
        group.stop()


def test_replicas_store_to_s3_and_clients_fetch_by_url(s3_cluster, s3_server):
    """A real replica stores its video in the bucket: its Result names it (s3://) and carries a presigned URL
    that plain HTTP fetches; the bytes are the result's (its sha256), by URL and by fetch_video. The producer API
    (run_requests, in a client process) hands the result out with a URL it made, which works too."""
    result = _app_for(s3_cluster.redis_url).send_task("replicadp.generate", kwargs=lasting(0.25)).get(timeout=60)
    assert result["video_uri"].startswith(f"s3://{s3_cluster.bucket}/{PREFIX}{result['request_id']}.")
    video = http_get(result["video_url"])
    assert hashlib.sha256(video).hexdigest() == result["video_sha256"] and video[4:8] == b"ftyp"
    assert fetch_video(result["video_uri"], "", result["video_sha256"], s3_endpoint_url=s3_server.url) == video
    [outcome] = run_client_on(s3_cluster.redis_url, [lasting(0.25, request_id=result["request_id"])], 1)
    assert outcome.ok and outcome.result["video_url_expires_at"] >= result["video_url_expires_at"]
    assert http_get(outcome.result["video_url"]) == video


def test_gateway_job_url_content_and_delete(s3_cluster, s3_server):
    """Through the gateway: a completed job carries a working presigned URL, /content answers its bytes, and
    DELETE removes its JSON and MP4 from the bucket (a later GET is a 404)."""
    job = s3_cluster.client.post("/v1/videos", files=multipart(form_of(lasting(0.25, prompt="s3 job")))).json()
    done = wait_for(job_once(s3_cluster, job["id"], lambda j: j["status"] in ("completed", "failed")),
                    "the job to end")
    assert done["status"] == "completed", done
    assert done["video_url_expires_at"] > time.time()
    content = s3_cluster.client.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and http_get(done["video_url"]) == content.content
    assert any(k.startswith(f"{PREFIX}{job['id']}.") for k in keys(s3_server, s3_cluster.bucket))
    assert s3_cluster.client.delete(f"/v1/videos/{job['id']}").json()["deleted"] is True
    assert not any(k.startswith(f"{PREFIX}{job['id']}.") for k in keys(s3_server, s3_cluster.bucket))
    assert s3_cluster.client.get(f"/v1/videos/{job['id']}").status_code == 404

"""The output store: where a request's MP4 and its metadata live, keyed by request_id.

Results are written once: the first delivery of a request to finish wins, and any later delivery of the
same request_id gets the stored result back (at-least-once delivery, one result).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

import redis

from .errors import StoreError
from .keys import STORE_KEY


class DirStore:
    """A folder (shared with the clients): `<request_id>.mp4` beside `<request_id>.json`. The JSON is written last
    and marks the pair complete; an MP4 without it is what a failed write left (a full disk), never served."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _temp(self, final: Path, data: bytes) -> Path:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{final.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        except BaseException:
            os.unlink(tmp)
            raise
        return Path(tmp)

    def get_meta(self, request_id: str) -> dict | None:
        try:
            return json.loads((self.root / f"{request_id}.json").read_text())
        except FileNotFoundError:
            return None

    def put(self, request_id: str, video: bytes, meta: dict) -> dict:
        """Store the video and its metadata, both or neither. Returns the stored metadata: `meta` with
        `video_uri` set, or the earlier winner's (the first complete pair wins)."""
        video_path, meta_path = self.root / f"{request_id}.mp4", self.root / f"{request_id}.json"
        meta = {**meta, "video_uri": video_path.as_uri()}
        done = self.get_meta(request_id)
        if done is not None:
            return done
        temps = []
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            # Both written in full before either is visible: a full disk fails here, leaving nothing behind.
            temps.append(self._temp(video_path, video))
            temps.append(self._temp(meta_path, json.dumps(meta).encode()))
            # An MP4 without its JSON is a failed write's (another request, maybe other inputs): replaced.
            os.replace(temps[0], video_path)
            try:
                os.link(temps[1], meta_path)  # fails if the JSON exists: the first complete pair wins
            except FileExistsError:
                return self.get_meta(request_id)
            return meta
        except OSError as exc:
            raise StoreError(f"cannot write {request_id} to {self.root}: {exc}") from exc
        finally:
            for tmp in temps:
                tmp.unlink(missing_ok=True)


class RedisStore:
    """Bytes in Redis under a TTL, for hosts that share no disk with the clients. Both keys are set in one
    transaction, or neither."""

    def __init__(self, client, ttl_s: int):
        self.client = client
        self.ttl_s = ttl_s

    def get_meta(self, request_id: str) -> dict | None:
        raw = self.client.get(f"{STORE_KEY}{request_id}.json")
        return json.loads(raw) if raw else None

    def put(self, request_id: str, video: bytes, meta: dict) -> dict:
        video_key, meta_key = f"{STORE_KEY}{request_id}.mp4", f"{STORE_KEY}{request_id}.json"
        meta = {**meta, "video_uri": f"redis-key:{video_key}"}
        with self.client.pipeline() as pipe:
            try:
                pipe.watch(meta_key)
                done = pipe.get(meta_key)
                if done:
                    return json.loads(done)
                pipe.multi()
                pipe.set(video_key, video, ex=self.ttl_s)
                pipe.set(meta_key, json.dumps(meta), ex=self.ttl_s)
                pipe.execute()
            except redis.WatchError:  # another delivery stored its pair meanwhile: the first complete pair wins
                return self.get_meta(request_id)
            except redis.ResponseError as exc:  # Redis refused a write (out of memory): nothing was stored
                raise StoreError(f"cannot write {request_id} to Redis: {exc}") from exc
        return meta


def outage_tolerant(url: str, outage_s: int):
    """A Redis client that rides out a Redis outage of up to about `outage_s` seconds (a restart: ~6 s) by
    retrying, instead of failing the request it is serving."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    # Retries 1 s apart once the backoff has grown (the first few are quicker).
    return redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30,
                                retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), outage_s + 5),
                                retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def open_store(kind: str, output_dir: Path, redis_url: str, ttl_s: int, outage_s: int):
    """The store a replica writes to, by REPLICADP_STORE."""
    if kind == "dir":
        return DirStore(output_dir)
    if kind == "redis":
        return RedisStore(outage_tolerant(redis_url, outage_s), ttl_s)
    raise StoreError(f"REPLICADP_STORE={kind!r}: must be 'dir' or 'redis'")


def fetch_video(video_uri: str, redis_url: str, sha256: str | None = None) -> bytes:
    """The MP4 bytes behind a result's video_uri, whatever the store; checked against the result's `sha256` when
    given, so that no other bytes are ever handed out under a result."""
    if video_uri.startswith("redis-key:"):
        data = redis.Redis.from_url(redis_url).get(video_uri[len("redis-key:"):])
        if data is None:
            raise StoreError(f"{video_uri}: not in Redis (expired after REPLICADP_STORE_TTL?)")
    else:
        parsed = urlparse(video_uri)
        if parsed.scheme != "file":
            raise StoreError(f"video_uri={video_uri!r}: unknown store")
        try:
            data = Path(unquote(parsed.path)).read_bytes()
        except OSError as exc:
            raise StoreError(f"{video_uri}: {exc}") from exc
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise StoreError(f"{video_uri}: the bytes there are not this result's video (sha256 differs)")
    return data

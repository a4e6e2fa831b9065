"""The output store: where a request's MP4 and its metadata live, keyed by request_id.

Results are written once: the first delivery of a request to finish wins, and any later delivery of the
same request_id gets the stored result back (at-least-once delivery, one result).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

from .errors import StoreError

REDIS_PREFIX = "replicadp:store:"


class DirStore:
    """A folder (shared with the clients): `<request_id>.mp4` beside `<request_id>.json`."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _write_once(self, final: Path, data: bytes) -> bool:
        """Write atomically; False if the file already exists (another delivery won)."""
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{final.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.link(tmp, final)  # fails if `final` exists: the first writer wins
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def get_meta(self, request_id: str) -> dict | None:
        try:
            return json.loads((self.root / f"{request_id}.json").read_text())
        except FileNotFoundError:
            return None

    def put(self, request_id: str, video: bytes, meta: dict) -> dict:
        """Store the video then its metadata (the metadata's presence marks the result complete).

        Returns the stored metadata: `meta` with `video_uri` set, or the earlier winner's.
        """
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            path = self.root / f"{request_id}.mp4"
            self._write_once(path, video)
            meta = {**meta, "video_uri": path.as_uri()}
            if self._write_once(self.root / f"{request_id}.json", json.dumps(meta).encode()):
                return meta
            return self.get_meta(request_id)
        except OSError as exc:
            raise StoreError(f"cannot write {request_id} to {self.root}: {exc}") from exc


class RedisStore:
    """Bytes in Redis under a TTL, for hosts that share no disk with the clients."""

    def __init__(self, client, ttl_s: int):
        self.client = client
        self.ttl_s = ttl_s

    def get_meta(self, request_id: str) -> dict | None:
        raw = self.client.get(f"{REDIS_PREFIX}{request_id}.json")
        return json.loads(raw) if raw else None

    def put(self, request_id: str, video: bytes, meta: dict) -> dict:
        key = f"{REDIS_PREFIX}{request_id}.mp4"
        self.client.set(key, video, ex=self.ttl_s, nx=True)
        meta = {**meta, "video_uri": f"redis-key:{key}"}
        if self.client.set(f"{REDIS_PREFIX}{request_id}.json", json.dumps(meta), ex=self.ttl_s, nx=True):
            return meta
        return self.get_meta(request_id)


def outage_tolerant(url: str):
    """A Redis client that rides out a Redis restart (seen: ~6 s) by retrying for about 30 s, instead of
    failing the request it is serving."""
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30,
                                retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 40),
                                retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def open_store(kind: str, output_dir: Path, redis_url: str, ttl_s: int):
    """The store a replica writes to, by REPLICADP_STORE."""
    if kind == "dir":
        return DirStore(output_dir)
    if kind == "redis":
        return RedisStore(outage_tolerant(redis_url), ttl_s)
    raise StoreError(f"REPLICADP_STORE={kind!r}: must be 'dir' or 'redis'")


def fetch_video(video_uri: str, redis_url: str) -> bytes:
    """The MP4 bytes behind a result's video_uri, whatever the store."""
    if video_uri.startswith("redis-key:"):
        import redis

        data = redis.Redis.from_url(redis_url).get(video_uri[len("redis-key:"):])
        if data is None:
            raise StoreError(f"{video_uri}: not in Redis (expired after REPLICADP_STORE_TTL?)")
        return data
    parsed = urlparse(video_uri)
    if parsed.scheme != "file":
        raise StoreError(f"video_uri={video_uri!r}: unknown store")
    try:
        return Path(unquote(parsed.path)).read_bytes()
    except OSError as exc:
        raise StoreError(f"{video_uri}: {exc}") from exc

"""The output store: where a request's MP4 and its metadata live, keyed by request_id.

Results are written once: the first delivery of a request to finish wins, and any later delivery of the
same request_id gets the stored result back (at-least-once delivery, one result). Every store keeps a pair for
REPLICADP_STORE_TTL seconds (0: forever): Redis expires its keys itself; a folder and a bucket are swept by the
replicas (`sweep_forever`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

import boto3
import redis
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from ..cluster import connection
from ..contract.errors import StoreError
from ..contract.keys import REQUEST_ID_RE, STORE_KEY, SWEEP_KEY

if TYPE_CHECKING:
    from ..settings import Settings

log = logging.getLogger("replicadp")

STORE_SWEEP_S = 300  # how often the output store is swept of what is older than REPLICADP_STORE_TTL (hours, a day)
S3_MAX_URL_TTL_S = 7 * 86400  # SigV4, the signature of presigned URLs, refuses a longer lifetime
S3_DELETE_BATCH = 1000  # the most keys one DeleteObjects call takes
# The user metadata (x-amz-meta-replicadp) of every object the S3 store writes, and the only objects its sweep
# removes: a name that looks like the store's is not proof (a bucket's `<prefix>package.json`).
S3_TAG = "replicadp"
# The names the folder and S3 stores write, and the only ones their sweeps remove: a folder or prefix may hold
# other files (an OUTPUT_DIR of `.`), and those are never touched. `<request_id>.<write id>.mp4`, a write id being
# uuid4().hex; a folder's temp files and sweep claims have a prefix of their own, never a user's dotfile.
_RESULT_NAME = re.compile(rf"(?P<rid>{REQUEST_ID_RE.pattern})\.json")
_VIDEO_NAME = re.compile(rf"(?P<rid>{REQUEST_ID_RE.pattern})\.[0-9a-f]{{32}}\.mp4")
_TEMP_NAME = re.compile(r"\.replicadp-(?:write|swept)-[A-Za-z0-9_]+\.(?:json|mp4)")


def _file_path(video_uri: str) -> Path:
    """The file a folder store's `file://` video_uri names."""
    return Path(unquote(urlparse(video_uri).path))


class DirStore:
    """A folder (shared with the clients): `<request_id>.json` (the Result) marks the pair complete and names its
    MP4, `<request_id>.<write id>.mp4`, a name of each write's own (as S3Store's keys), so that a write that loses
    the race never touches the winner's bytes. The JSON is linked into place only if absent: the first complete
    pair wins. An MP4 no JSON names (a write that died between its two files) is never served, and the retention
    sweep removes it. The folder may hold other files: the sweep removes only the names above (a JSON only if it is
    a Result naming its MP4 in this folder) and the store's own temp files (`.replicadp-…`)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _temp(self, final: Path, data: bytes) -> Path:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".replicadp-write-", suffix=final.suffix)
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
        done = self.get_meta(request_id)
        if done is not None:
            return done
        video_path = self.root / f"{request_id}.{uuid.uuid4().hex}.mp4"
        meta_path = self.root / f"{request_id}.json"
        meta = {**meta, "video_uri": video_path.as_uri()}
        temp = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            # Both written in full before the JSON names the MP4: a full disk fails here, and nothing is left.
            with open(video_path, "xb") as f:
                f.write(video)
            temp = self._temp(meta_path, json.dumps(meta).encode())
            try:
                os.link(temp, meta_path)  # fails if a JSON exists: the first complete pair wins
                return meta
            except FileExistsError:
                winner = self.get_meta(request_id)
            if winner is None:  # removed since it was seen (a DELETE): this pair is the first now
                os.link(temp, meta_path)
                return meta
            video_path.unlink()  # named by no JSON: nobody's
            return winner
        except OSError as exc:
            video_path.unlink(missing_ok=True)
            raise StoreError(f"cannot write {request_id} to {self.root}: {exc}") from exc
        finally:
            if temp is not None:
                temp.unlink(missing_ok=True)

    def delete(self, request_id: str) -> None:
        """Remove a request's pair: its JSON first (readers then find no result), then the MP4 it names (a name
        no later write uses)."""
        meta = self.get_meta(request_id)
        if meta is None:
            return
        try:
            (self.root / f"{request_id}.json").unlink(missing_ok=True)
            (self.root / _file_path(meta["video_uri"]).name).unlink(missing_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot delete {request_id} from {self.root}: {exc}") from exc

    def _named_video(self, meta_path: Path) -> Path | None:
        """The MP4 that the Result at `meta_path` names, in this folder; None if that file is no Result of this
        store's (a user's JSON that only looks like one: never swept)."""
        try:
            uri = json.loads(meta_path.read_bytes()).get("video_uri", "")
        except (ValueError, AttributeError):
            return None
        video = _file_path(uri) if isinstance(uri, str) and uri.startswith("file://") else None
        rid = meta_path.name[:-len(".json")]
        if video is None or video.parent != self.root.absolute():
            return None
        written = _VIDEO_NAME.fullmatch(video.name)
        # `<request_id>.mp4`: what a version without write ids wrote.
        return video if video.name == f"{rid}.mp4" or written and written["rid"] == rid else None

    def sweep(self, cutoff: float) -> int:
        """Remove what this store wrote before `cutoff` (unix seconds): pairs (a file's mtime is when its put wrote
        it), MP4s no JSON names, temp files of writes that died. Nothing else in the folder, whatever its age.
        Each Result first and then the MP4 it names, as in `delete`. Returns how many files it removed."""
        removed = 0
        try:
            entries = [e for e in os.scandir(self.root) if e.is_file(follow_symlinks=False)
                       and any(n.fullmatch(e.name) for n in (_RESULT_NAME, _VIDEO_NAME, _TEMP_NAME))]
            entries.sort(key=lambda e: not e.name.endswith(".json"))
            for entry in entries:
                path = Path(entry.path)
                try:
                    if entry.stat(follow_symlinks=False).st_mtime >= cutoff:
                        continue
                    if not _RESULT_NAME.fullmatch(entry.name):
                        removed += self._remove_if_older(path, cutoff)
                        continue
                    video = self._named_video(path)
                    if video is not None and self._remove_if_older(path, cutoff):
                        removed += 1
                        video.unlink()  # written before its JSON, and named by no later write
                        removed += 1
                except FileNotFoundError:  # gone since the listing (a put's temp file, a DELETE, an MP4 above)
                    continue
        except FileNotFoundError:  # no folder: nothing stored yet
            return 0
        except OSError as exc:
            raise StoreError(f"cannot sweep {self.root}: {exc}") from exc
        return removed

    @staticmethod
    def _remove_if_older(path: Path, cutoff: float) -> bool:
        """Remove `path` if what is there now was written before `cutoff`. Claimed by a rename first: a file a
        put wrote there since the listing (a JSON linked anew after a DELETE) is put back, never removed."""
        claimed = path.with_name(f".replicadp-swept-{uuid.uuid4().hex}{path.suffix}")
        try:
            os.rename(path, claimed)
        except FileNotFoundError:  # removed meanwhile (a DELETE)
            return False
        if claimed.stat().st_mtime < cutoff:
            claimed.unlink()
            return True
        try:
            os.link(claimed, path)
        except FileExistsError:  # a later put wrote it again: that one stays
            pass
        claimed.unlink()
        return False


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
        while True:
            with self.client.pipeline() as pipe:
                try:
                    pipe.watch(meta_key)
                    done = pipe.get(meta_key)
                    if done:
                        return json.loads(done)
                    pipe.multi()
                    pipe.set(video_key, video, ex=self.ttl_s or None)  # 0: kept until deleted
                    pipe.set(meta_key, json.dumps(meta), ex=self.ttl_s or None)
                    pipe.execute()
                    return meta
                except redis.WatchError:  # stored (the first complete pair wins: read it) or deleted meanwhile
                    continue
                except redis.ResponseError as exc:  # Redis refused a write (out of memory): nothing was stored
                    raise StoreError(f"cannot write {request_id} to Redis: {exc}") from exc

    def delete(self, request_id: str) -> None:
        self.client.delete(f"{STORE_KEY}{request_id}.mp4", f"{STORE_KEY}{request_id}.json")


def new_s3_client(endpoint_url: str | None):
    """An S3 client of boto3's; credentials and region come from boto3's own chain (AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, profiles, instance roles). SigV4, which presigned URLs need to live
    up to 7 days. A session of its own: boto3's default one is not safe to share between threads, nor with a pool
    child forked while a thread of its parent used it."""
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=Config(signature_version="s3v4"))


@functools.lru_cache(maxsize=None)
def _reader_s3(endpoint_url: str | None):
    """The client of a process that reads results (a producer, the gateway); boto3's clients are thread-safe.
    A replica's stores have clients of their own: a forked pool child must not inherit its parent's connections."""
    return new_s3_client(endpoint_url)


def _s3_location(video_uri: str) -> tuple[str, str]:
    parsed = urlparse(video_uri)
    return parsed.netloc, parsed.path.lstrip("/")


def _check_url_ttl(url_ttl_s: int) -> None:
    if not 1 <= url_ttl_s <= S3_MAX_URL_TTL_S:
        raise StoreError(f"REPLICADP_S3_URL_TTL={url_ttl_s}: must be 1 to {S3_MAX_URL_TTL_S} seconds (7 days, "
                         "the longest a SigV4 presigned URL lives)")


def _presigned(client, result: dict, url_ttl_s: int) -> dict:
    """`result` with a GET URL of its video signed now (`video_url`), and when that URL expires (unix seconds)."""
    _check_url_ttl(url_ttl_s)
    bucket, key = _s3_location(result["video_uri"])
    signed_at = int(time.time())  # the signature's own time is this second or the next: never expires earlier
    url = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=url_ttl_s)
    return {**result, "video_url": url, "video_url_expires_at": signed_at + url_ttl_s}


def with_video_url(result: dict, s3_endpoint_url: str | None, url_ttl_s: int) -> dict:
    """`result` with a presigned GET URL of its video made now, if its video is in S3; any other result as it
    is. Whoever hands a result out (client.api, the gateway) calls it as it does: the URL the replica made when it
    stored the video (so that a plain `generate.delay().get()` has one too) may have expired since. A process
    without S3 credentials hands out the replica's URL, whose `video_url_expires_at` says until when it works."""
    if not result.get("video_uri", "").startswith("s3://"):
        return result
    try:
        return _presigned(_reader_s3(s3_endpoint_url), result, url_ttl_s)
    except NoCredentialsError:
        return result


def _error_code(exc: ClientError) -> str:
    return exc.response.get("Error", {}).get("Code", "")


class S3Store:
    """Objects in an S3 bucket (AWS, or any S3 API at REPLICADP_S3_ENDPOINT_URL), under a key prefix:
    `<prefix><request_id>.json` (the Result) marks the pair complete and names its MP4,
    `<prefix><request_id>.<write id>.mp4`, a key of each write's own, so that a write that loses the race never
    overwrites the winner's bytes. The JSON is written only if absent (If-None-Match: *): the first complete pair
    wins. The Results it returns carry a presigned GET URL of the video (`video_url`, `video_url_expires_at`),
    made as it returns them; the stored JSON has none (it would expire)."""

    def __init__(self, client, bucket: str, prefix: str, url_ttl_s: int):
        if not bucket:
            raise StoreError("REPLICADP_STORE=s3 needs REPLICADP_S3_BUCKET")
        _check_url_ttl(url_ttl_s)
        self.client, self.bucket, self.prefix, self.url_ttl_s = client, bucket, prefix, url_ttl_s

    def _meta_key(self, request_id: str) -> str:
        return f"{self.prefix}{request_id}.json"

    def _where(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def _read_meta(self, request_id: str) -> dict | None:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._meta_key(request_id))["Body"].read()
        except ClientError as exc:
            if _error_code(exc) == "NoSuchKey":
                return None
            raise StoreError(f"cannot read {request_id} from {self._where()}: {exc}") from exc
        except BotoCoreError as exc:
            raise StoreError(f"cannot read {request_id} from {self._where()}: {exc}") from exc
        return json.loads(body)

    def get_meta(self, request_id: str) -> dict | None:
        meta = self._read_meta(request_id)
        return None if meta is None else _presigned(self.client, meta, self.url_ttl_s)

    def _put_meta_if_absent(self, request_id: str, meta: dict) -> bool:
        """Write the JSON unless one exists; whether this one was written."""
        while True:
            try:
                self.client.put_object(Bucket=self.bucket, Key=self._meta_key(request_id),
                                       Body=json.dumps(meta).encode(), ContentType="application/json",
                                       Metadata={S3_TAG: "result"}, IfNoneMatch="*")
                return True
            except ClientError as exc:
                if _error_code(exc) == "PreconditionFailed":  # another write's JSON is there
                    return False
                if _error_code(exc) != "ConditionalRequestConflict":  # (AWS: another conditional write in flight)
                    raise

    def put(self, request_id: str, video: bytes, meta: dict) -> dict:
        """Store the video and its metadata; the stored metadata: `meta` with `video_uri` set, or the earlier
        winner's. A write that fails raises StoreError; an MP4 it may leave is named by no JSON, never served,
        and the retention sweep removes it."""
        done = self.get_meta(request_id)
        if done is not None:
            return done
        video_key = f"{self.prefix}{request_id}.{uuid.uuid4().hex}.mp4"
        meta = {**meta, "video_uri": f"s3://{self.bucket}/{video_key}"}
        try:
            self.client.put_object(Bucket=self.bucket, Key=video_key, Body=video, ContentType="video/mp4",
                                   Metadata={S3_TAG: "video"})
            won = self._put_meta_if_absent(request_id, meta)
            if not won:  # its MP4 is nobody's
                self.client.delete_object(Bucket=self.bucket, Key=video_key)
        except (ClientError, BotoCoreError) as exc:
            raise StoreError(f"cannot write {request_id} to {self._where()}: {exc}") from exc
        return _presigned(self.client, meta, self.url_ttl_s) if won else self.get_meta(request_id)

    def delete(self, request_id: str) -> None:
        """Remove a request's pair: its JSON first (readers then find no result), then the MP4 it names (a key no
        later write uses)."""
        meta = self._read_meta(request_id)
        if meta is None:
            return
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._meta_key(request_id))
            self.client.delete_object(Bucket=self.bucket, Key=_s3_location(meta["video_uri"])[1])
        except (ClientError, BotoCoreError) as exc:
            raise StoreError(f"cannot delete {request_id} from {self._where()}: {exc}") from exc

    def _written_here(self, key: str) -> bool:
        """Whether the object at `key` carries the store's own metadata (S3_TAG): it wrote it."""
        try:
            return S3_TAG in self.client.head_object(Bucket=self.bucket, Key=key).get("Metadata", {})
        except ClientError as exc:
            if _error_code(exc) in ("404", "NoSuchKey"):  # removed since the listing
                return False
            raise

    def sweep(self, cutoff: float) -> int:
        """Remove the pairs, and MP4s no JSON names, written under the prefix before `cutoff` (unix seconds);
        metadata first, as in `delete`. Only objects this store wrote (their S3_TAG metadata, read with a HEAD each)
        under its own names right under the prefix: other objects there, and deeper "folders", are never touched.
        Returns how many objects it removed."""
        old = {"json": [], "mp4": []}
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(self.prefix):]
                    kind = "json" if _RESULT_NAME.fullmatch(name) else "mp4" if _VIDEO_NAME.fullmatch(name) else None
                    if kind and obj["LastModified"].timestamp() < cutoff and self._written_here(obj["Key"]):
                        old[kind].append(obj["Key"])
            for keys in (old["json"], old["mp4"]):
                for start in range(0, len(keys), S3_DELETE_BATCH):
                    answer = self.client.delete_objects(Bucket=self.bucket, Delete={
                        "Objects": [{"Key": k} for k in keys[start:start + S3_DELETE_BATCH]], "Quiet": True})
                    if answer.get("Errors"):
                        raise StoreError(f"cannot sweep {self._where()}: {answer['Errors'][0]}")
        except (ClientError, BotoCoreError) as exc:
            raise StoreError(f"cannot sweep {self._where()}: {exc}") from exc
        return len(old["json"]) + len(old["mp4"])


def open_store(settings: Settings):
    """The store a replica writes to, by REPLICADP_STORE. An S3 bucket it cannot reach fails here, at start."""
    if settings.store == "dir":
        return DirStore(settings.output_dir)
    if settings.store == "redis":
        return RedisStore(connection.outage_tolerant(settings.redis_url, settings.redis_outage_s), settings.store_ttl_s)
    if settings.store == "s3":
        if not settings.s3_prefix.endswith("/"):  # its sweep would remove other objects of the bucket
            raise StoreError(f"REPLICADP_S3_PREFIX={settings.s3_prefix!r}: must be a folder of replicadp's own, "
                             "ending in '/' (such as 'replicadp/'): the retention sweep removes what the store "
                             "wrote under it")
        store = S3Store(new_s3_client(settings.s3_endpoint_url), settings.s3_bucket, settings.s3_prefix,
                        settings.s3_url_ttl_s)
        try:
            store.client.head_bucket(Bucket=store.bucket)
        except (ClientError, BotoCoreError) as exc:
            raise StoreError(f"REPLICADP_S3_BUCKET={store.bucket!r}: cannot reach it: {exc}") from exc
        return store
    raise StoreError(f"REPLICADP_STORE={settings.store!r}: must be 'dir', 'redis' or 's3'")


def sweep_forever(store, client: redis.Redis, replica: str, ttl_s: int) -> None:
    """In a replica's main process, for a store that keeps what it holds (dir, s3): every STORE_SWEEP_S, remove
    what is older than `ttl_s`. One replica of the cluster sweeps at a time, the one that took SWEEP_KEY (it
    expires after STORE_SWEEP_S): two sweeps at once could each remove a pair that a put wrote anew after the
    other had removed the old one."""
    while True:
        try:
            if client.set(SWEEP_KEY, replica, nx=True, ex=STORE_SWEEP_S):
                removed = store.sweep(time.time() - ttl_s)
                if removed:
                    log.info("output store: removed %d files older than REPLICADP_STORE_TTL=%d s", removed, ttl_s)
        except Exception:  # noqa: BLE001 (a store or Redis down now: the next sweep tries again)
            log.exception("output store: the retention sweep failed; next try in %d s", STORE_SWEEP_S)
        time.sleep(STORE_SWEEP_S)


def delete_stored(result: dict, redis_url: str, s3_endpoint_url: str | None = None) -> None:
    """Remove a stored result's video and metadata from the store its video_uri names (a replica wrote it, no
    request did)."""
    uri, request_id = result["video_uri"], result["request_id"]
    if uri.startswith("redis-key:"):
        RedisStore(connection.client(redis_url), 0).delete(request_id)
    elif uri.startswith("s3://"):
        bucket, key = _s3_location(uri)
        stem = key.rsplit(".", 2)[0]  # `<prefix><request_id>` of `<prefix><request_id>.<write id>.mp4`
        S3Store(_reader_s3(s3_endpoint_url), bucket, stem[:len(stem) - len(request_id)],
                S3_MAX_URL_TTL_S).delete(request_id)  # (it makes no URL)
    else:
        DirStore(_file_path(uri).parent).delete(request_id)


def fetch_video(video_uri: str, redis_url: str, sha256: str | None = None, s3_endpoint_url: str | None = None) -> bytes:
    """The MP4 bytes behind a result's video_uri, whatever the store; checked against the result's `sha256` when
    given, so that no other bytes are ever handed out under a result."""
    if video_uri.startswith("redis-key:"):
        data = connection.client(redis_url).get(video_uri[len("redis-key:"):])
        if data is None:
            raise StoreError(f"{video_uri}: not in Redis (expired after REPLICADP_STORE_TTL?)")
    elif video_uri.startswith("s3://"):
        bucket, key = _s3_location(video_uri)
        try:
            data = _reader_s3(s3_endpoint_url).get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if _error_code(exc) == "NoSuchKey":
                raise StoreError(f"{video_uri}: not in the bucket (removed after REPLICADP_STORE_TTL, or "
                                 "deleted?)") from exc
            raise StoreError(f"{video_uri}: {exc}") from exc
        except BotoCoreError as exc:
            raise StoreError(f"{video_uri}: {exc}") from exc
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

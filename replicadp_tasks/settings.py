"""replicadp's settings: each a named default with the reason for it, overridable by an environment
variable, read once when the process starts (`SETTINGS`). Celery's own settings live in celeryconfig.py
and take their values from here."""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from .cluster.connection import parse
from .contract.errors import RedisURLError
from .logs import LogFormat
from .model.memory import Offload
from .model.parallel import Layout
from .model.quantization import Quantize
from .contract.scheduling import Scheduling
from .model.step_cache import CacheMethod, mag_ratios_file

# Where `replicadp up` records the embedded server's URL, so that a plain `generate.delay()` finds it.
STATE_DIR = Path(os.environ.get("REPLICADP_STATE_DIR", Path.home() / ".replicadp"))
STATE_FILE = STATE_DIR / "state.json"


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"replicadp: environment variable {name}={raw!r} is not an integer") from None


# One webhook attempt takes at most webhooks.CONNECT_TIMEOUT_S per address and SEND_TIMEOUT_S (8 s for one
# address): a claim shorter than this would let a second sender take an event while the first still sends it.
MIN_WEBHOOK_CLAIM_S = 10


def _at_least(name: str, default: int, low: int) -> int:
    value = _int(name, default)
    if value < low:
        raise SystemExit(f"replicadp: environment variable {name}={value} is below {low}")
    return value


def _nice(name: str, default: int) -> int:
    value = _int(name, default)
    if not 0 <= value <= 19:
        raise SystemExit(f"replicadp: environment variable {name}={value} is not a nice increment from 0 to 19")
    return value


def _optional(name: str, kind: type[int] | type[float]) -> int | float | None:
    """A number, or None when unset or empty (the default then depends on another setting)."""
    raw = os.environ.get(name, "").strip()
    if raw == "":
        return None
    try:
        return kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise SystemExit(f"replicadp: environment variable {name}={raw!r} is not {what}") from None


def _positive(name: str) -> float | None:
    value = _optional(name, float)
    if value is not None and not value > 0:
        raise SystemExit(f"replicadp: environment variable {name}={value} is not above 0")
    return value


def _layout(name: str) -> Layout:
    try:
        return Layout.parse(os.environ.get(name, ""))
    except ValueError as exc:
        raise SystemExit(f"replicadp: environment variable {name}={os.environ[name]!r}: {exc}") from None


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise SystemExit(f"replicadp: environment variable {name}={raw!r} is not a boolean (use 1 or 0)")


def _networks(name: str) -> tuple:
    """Comma-separated CIDRs, e.g. `10.0.0.0/8,fd00::/8`; unset or empty: none."""
    nets = []
    for part in os.environ.get(name, "").split(","):
        if part.strip():
            try:
                nets.append(ipaddress.ip_network(part.strip()))
            except ValueError as exc:
                raise SystemExit(f"replicadp: environment variable {name}: {part.strip()!r} is not a network "
                                 f"({exc})") from None
    return tuple(nets)


def _choice(name: str, kind: type[StrEnum], default: StrEnum) -> StrEnum:
    """One of the values of the StrEnum `kind`."""
    raw = os.environ.get(name) or default
    try:
        return kind(raw)
    except ValueError:
        raise SystemExit(f"replicadp: environment variable {name}={raw!r} is not one of {', '.join(kind)}") from None


def _redis_url() -> str:
    """REDIS_URL wins; else the embedded server that `replicadp up` started; else a local Redis."""
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    try:
        return json.loads(STATE_FILE.read_text())["redis_url"]
    except (OSError, ValueError, KeyError):
        return "redis://127.0.0.1:6379/0"


def _checked_redis_url() -> str:
    url = _redis_url()
    try:
        parse(url)
    except RedisURLError as exc:
        raise SystemExit(f"replicadp: {exc}") from None
    return url


@dataclass(frozen=True)
class Settings:
    redis_url: str
    model: str
    queue: str
    output_dir: Path
    store: str
    store_ttl_s: int
    result_ttl_s: int
    threads: int
    encode_threads: int
    finisher_nice: int
    finisher_wait_ms: int
    vae_tiling: bool
    attention: str
    compile: str
    cache: CacheMethod
    cache_threshold: float | None
    cache_interval: int | None
    mag_ratios: Path
    quantize: Quantize
    offload: Offload
    device_memory_gib: float | None
    parallel: Layout
    parallel_timeout_s: float
    deterministic: bool
    soft_time_limit_s: int
    time_limit_s: int
    load_timeout_s: int
    max_prompt_chars: int
    max_work: int
    max_attempts: int
    lease_s: int
    replica_stale_s: int
    redis_outage_s: int
    redis_replicas: int
    redis_ack_timeout_ms: int
    max_image_bytes: int
    image_timeout_s: int
    fetch_allow: tuple
    image_dir: Path | None
    loras_file: str | None
    model_cache: Path
    scheduling: Scheduling
    s3_bucket: str
    s3_prefix: str
    s3_endpoint_url: str | None
    s3_url_ttl_s: int
    log_format: LogFormat
    webhooks: bool
    webhook_claim_s: int
    webhook_secret: str = field(repr=False)  # signs every webhook POST; never printed

    @classmethod
    def from_env(cls) -> "Settings":
        image_dir = os.environ.get("REPLICADP_IMAGE_DIR")
        # The production model; `tiny` is the offline stand-in that tests and the demo use.
        model = os.environ.get("REPLICADP_MODEL", "Wan-AI/Wan2.2-TI2V-5B-Diffusers")
        # Where `tiny` models are built on first use; shared by the replicas of a host.
        model_cache = Path(os.environ.get("REPLICADP_MODEL_CACHE", Path.home() / ".cache" / "replicadp" / "models"))
        return cls(
            redis_url=_checked_redis_url(),
            model=model,
            # One shared queue that every replica pulls from: routing is work-conserving by construction.
            queue=os.environ.get("REPLICADP_QUEUE", "video"),
            # Absolute, so that video URIs mean the same to every process on the host.
            output_dir=Path(os.environ.get("OUTPUT_DIR", "outputs")).resolve(),
            # "dir" needs a disk shared with the clients; "redis" keeps the bytes in Redis under a TTL; "s3": a bucket.
            store=os.environ.get("REPLICADP_STORE", "dir"),
            # A day: long enough to fetch a video, short enough not to fill Redis, a disk or a bill. 0: forever.
            store_ttl_s=_int("REPLICADP_STORE_TTL", 86400),
            # Results are metadata only (a few hundred bytes); keep them as long as the videos.
            result_ttl_s=_int("REPLICADP_RESULT_TTL", 86400),
            # CPU replicas: threads per replica, so that N replicas share the cores without oversubscription.
            threads=_int("REPLICADP_THREADS", 1),
            # libx264's threads on a GPU replica, whose host has cores to spare: each request ends sooner, and the
            # finisher keeps ahead of few-step requests (832x480x33: 426 ms on one thread, 288 ms on two of this
            # 2-core machine). Fixed, not x264's count from the cores: the count changes the bytes. A CPU replica
            # encodes on its REPLICADP_THREADS.
            encode_threads=_at_least("REPLICADP_ENCODE_THREADS", 4, 1),
            # A GPU replica's finisher (its encode) is off the GPU's path, its next request's hand-over on it:
            # where replicas share too few cores, the kernel runs the hand-over first (docs/benchmarks.md,
            # section 15). 0: equal.
            finisher_nice=_nice("REPLICADP_FINISHER_NICE", 10),
            # A finish waits for the next request's compute to begin, at most this long, so that the hand-over runs
            # first: a little longer than a hand-over takes (7 ms, the median from one request's frames to the next
            # one's compute on a 2-core host). A request with none behind it is answered this much later; at 20 ms
            # that cost 8 replicas' last requests more than they gained (docs/benchmarks.md, section 15). 0: at once.
            finisher_wait_ms=_at_least("REPLICADP_FINISHER_WAIT_MS", 10, 0),
            # Decoding 832x480 in tiles lowers the VAE's peak memory at some speed cost; off by default.
            vae_tiling=_bool("REPLICADP_VAE_TILING", False),
            # diffusers' attention backend for the transformer ("native": torch's SDPA, which picks flash or
            # cuDNN kernels itself; "_native_cudnn", "flex", "flash" with flash-attn installed, ...). The
            # H200 comparison is scripts/gpu_check.sh's; nothing chosen there yet, so torch's own choice stays.
            attention=os.environ.get("REPLICADP_ATTENTION", "native"),
            # torch.compile of the transformer: "none", "blocks" (each of its 30 identical blocks, compiled once:
            # regional compilation, seconds) or "full" (the whole forward). Compiling pays only on a GPU, once
            # per request shape; off until an H200 run shows the gain against the compile time.
            compile=os.environ.get("REPLICADP_COMPILE", "none"),
            # The fast path (step_cache.py): a step cache that requests asking for quality=fast run with. None by
            # default: each method trades fidelity for speed (docs/benchmarks.md), a deployment chooses it.
            cache=_choice("REPLICADP_CACHE", CacheMethod, CacheMethod.NONE),
            # The method's knob; unset: diffusers' default for it (step_cache.THRESHOLDS, INTERVALS).
            cache_threshold=_optional("REPLICADP_CACHE_THRESHOLD", float),
            cache_interval=_optional("REPLICADP_CACHE_INTERVAL", int),
            # MagCache's ratios for the served model: `replicadp calibrate-mag` writes them, replicas read them.
            mag_ratios=Path(os.environ.get("REPLICADP_MAG_RATIOS") or mag_ratios_file(model_cache, model)),
            # FP8 transformer (quantization.py): ~1.2x on GPUs that have it, a different video for every request.
            quantize=_choice("REPLICADP_QUANTIZE", Quantize, Quantize.NONE),
            # Where the models a replica is not running wait (memory.py): "none" keeps all of them on the GPU, the
            # fastest; "expert", "model" and "group" trade seconds per request for the memory of a 14B expert, of
            # all but one model, of all but one block. Checked at load against what the GPU has.
            offload=_choice("REPLICADP_OFFLOAD", Offload, Offload.NONE),
            # The memory a replica may fill on each of its GPUs (GiB; the allocator is held to it): for a GPU shared
            # with another process, or to try a smaller GPU's limit on a larger one. Unset: what each has free at
            # load. On a CPU replica only the load-time check reads it.
            device_memory_gib=_positive("REPLICADP_DEVICE_MEMORY_GIB"),
            # One replica over K processes (parallel.py), e.g. "ulysses:2", "ring:2", "cfg:2,ulysses:2": each
            # request's denoising split over K GPUs, for a lower latency; N replicas x K GPUs. "none": one process.
            parallel=_layout("REPLICADP_PARALLEL"),
            # Seconds a rank waits for another inside a collective, and for the group to form: past it the replica's
            # attempt ends and its request is requeued. A collective waits one layer's compute, never a request's.
            parallel_timeout_s=_positive("REPLICADP_PARALLEL_TIMEOUT") or 60.0,
            # The same input gives the same frames in every replica (determinism.py): the isolation check needs
            # it. 0 trades that for the libraries' fastest kernels (gpu_check.sh measures the difference).
            deterministic=_bool("REPLICADP_DETERMINISTIC", True),
            # Past the soft limit the request fails cleanly with SoftTimeLimitExceeded; a 5B request is minutes.
            # 0 disables it (the hard limit then acts alone). Keep it below the hard limit: Celery arms the hard
            # timer only once the soft one has fired.
            soft_time_limit_s=_int("REPLICADP_SOFT_TIME_LIMIT", 1740),
            # Past the hard limit the pool child is killed and replaced (a hung CUDA kernel).
            time_limit_s=_int("REPLICADP_TIME_LIMIT", 1800),
            # A replacement pool child that loads for longer than this is killed; a 5B model loads in ~1-2 min.
            load_timeout_s=_int("REPLICADP_LOAD_TIMEOUT", 900),
            # Wan's text encoder sees 512 tokens; 4000 characters is well past that and bounds the message.
            max_prompt_chars=_int("REPLICADP_MAX_PROMPT_CHARS", 4000),
            # Budget per request, height x width x frames x steps: 1280x720, 121 frames, 50 steps (Wan2.2's
            # largest preset); larger requests are refused before they reach the GPU.
            max_work=_int("REPLICADP_MAX_WORK", 1280 * 720 * 121 * 50),
            # A request whose process dies (OOM kill, CUDA crash) is requeued; past this many starts it is
            # declared poison and failed, instead of killing replicas forever.
            max_attempts=_int("REPLICADP_MAX_ATTEMPTS", 3),
            # A replica whose heartbeat is this many seconds old is dead: its requests go back to the queue.
            # Renewed every second by the replica's main process (not the busy child), so 5 ticks may be missed.
            lease_s=_int("REPLICADP_LEASE", 6),
            # A replica whose serving heartbeat (heartbeat.py, a beat a second) is this many seconds old is no longer
            # listed as live: a SIGKILLed one drops out within it, a busy one may miss 4 beats.
            replica_stale_s=_int("REPLICADP_REPLICA_STALE", 5),
            # A replica waits this long for Redis to come back before it fails the request it serves (its result is
            # kept meanwhile: computing a 5B request again costs minutes); a Redis restart takes seconds.
            redis_outage_s=_int("REPLICADP_REDIS_OUTAGE", 300),
            # Writes a guarantee rests on (a queued request, a fence, a result, a cancel) wait until this many Redis
            # replicas hold them, so that a failover keeps them (replication.durable). A Sentinel URL: 1, which
            # the replica Sentinel promotes (the most up to date) has; a single server: 0 (nothing to wait for).
            # Give 1 for a managed Redis with a replica behind one endpoint.
            redis_replicas=_int("REPLICADP_REDIS_REPLICAS", 1 if parse(_redis_url()).is_sentinel else 0),
            # A replica answers WAIT in well under a millisecond; one that does not answer in this is down or
            # cut off, and the write goes on with the master's copy alone (logged).
            redis_ack_timeout_ms=_int("REPLICADP_REDIS_ACK_TIMEOUT_MS", 1000),
            # A first frame is at most a few MB; larger inputs are refused before decoding.
            max_image_bytes=_int("REPLICADP_MAX_IMAGE_BYTES", 20 * 1024 * 1024),
            # A slow image server must not hold a GPU: seconds for the whole download, all redirects included.
            image_timeout_s=_int("REPLICADP_IMAGE_TIMEOUT", 10),
            # Networks a request's URL may reach although they are not public (loopback, private, link-local,
            # ...): none, so that a request cannot make a replica read the services of its own host or network.
            fetch_allow=_networks("REPLICADP_FETCH_ALLOW"),
            # Local image paths are refused unless they lie under this folder.
            image_dir=Path(image_dir).resolve() if image_dir else None,
            # The LoRA adapters a replica loads at start and a request may name (adapters.py): a TOML file the
            # operator writes. Unset: none, and a request naming one is refused.
            loras_file=os.environ.get("REPLICADP_LORAS") or None,
            model_cache=model_cache,
            # Where a producer places a request (scheduling.py): "fair" (priorities, then round robin across
            # users) or "fifo" (one list in arrival order: the baseline the scheduling benchmark compares with).
            scheduling=_choice("REPLICADP_SCHEDULING", Scheduling, Scheduling.FAIR),
            # REPLICADP_STORE=s3: the bucket (no default: it is the operator's), and the key prefix the videos go
            # under, so that a bucket can hold other things too (retention removes only what lies under it).
            s3_bucket=os.environ.get("REPLICADP_S3_BUCKET", ""),
            s3_prefix=os.environ.get("REPLICADP_S3_PREFIX", "replicadp/"),
            # Unset: AWS itself; set for MinIO, Ceph, R2 or any other S3 API (credentials: boto3's own chain).
            s3_endpoint_url=os.environ.get("REPLICADP_S3_ENDPOINT_URL") or None,
            # An hour: a client fetches a video soon after it reads the result; readers make a fresh URL on each
            # read (store.with_video_url). At most 7 days, SigV4's limit (store.S3Store refuses more).
            s3_url_ttl_s=_int("REPLICADP_S3_URL_TTL", 3600),
            # Today's text lines by default (a person reads them); json: one object per line for a log shipper.
            log_format=_choice("REPLICADP_LOG_FORMAT", LogFormat, LogFormat.TEXT),
            # Webhooks (webhooks.py) are on where a secret is set: 0 refuses every request that names one.
            webhooks=_bool("REPLICADP_WEBHOOKS", True),
            # No default: an unsigned webhook could be forged by anyone who learns its URL, so without a secret
            # a request naming a webhook is refused (set the same one on the gateways and the replicas).
            webhook_secret=os.environ.get("REPLICADP_WEBHOOK_SECRET", ""),
            # A webhook event a sender took is due again this long after (webhooks.py): well past one attempt, and
            # soon enough after a sender's death or a Redis reply lost after the attempt.
            webhook_claim_s=_at_least("REPLICADP_WEBHOOK_CLAIM", 60, MIN_WEBHOOK_CLAIM_S),
        )


SETTINGS = Settings.from_env()

"""replicadp's settings: each a named default with the reason for it, overridable by an environment variable,
read once when the process starts (`SETTINGS`). Celery's own settings live in celeryconfig.py and take their
values from here. docs/configuration.md is this table, as `replicadp settings --markdown` writes it.

Each setting is a field of `Settings` declared with `setting(VARIABLE, default, why, parse)`: a variable that
is unset (or empty, for all but plain texts) takes the default, which may be computed from the settings declared
before it; one that is set is parsed, and a value that is not one stops the process with a message naming the
variable and the value.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Callable

from .cluster.connection import REPLY_TIMEOUT_S, parse as parse_redis_url
from .cluster.replication import Durability
from .contract.errors import InvalidRequest, RedisURLError
from .contract.models import check_model_name
from .contract.scheduling import Scheduling
from .logs import LogFormat
from .model.layout import Layout
from .model.memory import Offload
from .model.options import ModelOptions
from .model.quantization import Quantize
from .model.step_cache import CacheMethod, StepCache, mag_ratios_file

# Where `replicadp up` records the embedded server's URL, so that a plain `generate.delay()` finds it.
STATE_DIR = Path(os.environ.get("REPLICADP_STATE_DIR", Path.home() / ".replicadp"))
STATE_FILE = STATE_DIR / "state.json"
# One webhook attempt takes at most webhooks/sender.py's CONNECT_TIMEOUT_S per address and SEND_TIMEOUT_S (8 s for
# one address): a claim shorter than this would let a second sender take an event while the first still sends it.
MIN_WEBHOOK_CLAIM_S = 10

Parse = Callable[[str, str], object]  # (variable, its text) -> the value; SystemExit naming both if it is not one


def refuse(name: str, shown, why: str):
    raise SystemExit(f"replicadp: environment variable {name}={shown} {why}")


def text(name: str, raw: str) -> str:
    return raw


def integer(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        refuse(name, repr(raw), "is not an integer")


def at_least(low: int) -> Parse:
    def parse(name: str, raw: str) -> int:
        value = integer(name, raw)
        return value if value >= low else refuse(name, value, f"is below {low}")
    return parse


# A WAIT's own timeout leaves half a second of the reply's for the answer to come back.
_ACK_TIMEOUT_MAX_MS = int(REPLY_TIMEOUT_S * 1000) - 500


def between(low: int, high: int) -> Parse:
    def parse(name: str, raw: str) -> int:
        value = integer(name, raw)
        return value if low <= value <= high else refuse(name, value, f"is not from {low} to {high}")
    return parse


def nice(name: str, raw: str) -> int:
    value = integer(name, raw)
    return value if 0 <= value <= 19 else refuse(name, value, "is not a nice increment from 0 to 19")


def number(name: str, raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        refuse(name, repr(raw.strip()), "is not a number")


def non_negative(name: str, raw: str) -> float:
    value = number(name, raw)
    return value if value >= 0 else refuse(name, value, "is below 0")


def positive(name: str, raw: str) -> float:
    value = number(name, raw)
    return value if value > 0 else refuse(name, value, "is not above 0")


def boolean(name: str, raw: str) -> bool:
    raw = raw.strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    refuse(name, repr(raw), "is not a boolean (use 1 or 0)")


def choice(kind: type[StrEnum]) -> Parse:
    def parse(name: str, raw: str) -> StrEnum:
        try:
            return kind(raw)
        except ValueError:
            refuse(name, repr(raw), f"is not one of {', '.join(kind)}")
    return parse


def layout(name: str, raw: str) -> Layout:
    try:
        return Layout.parse(raw)
    except ValueError as exc:
        raise SystemExit(f"replicadp: environment variable {name}={raw!r}: {exc}") from None


def networks(name: str, raw: str) -> tuple:
    """Comma-separated CIDRs, e.g. `10.0.0.0/8,fd00::/8`."""
    nets = []
    for part in (p.strip() for p in raw.split(",")):
        if part:
            try:
                nets.append(ipaddress.ip_network(part))
            except ValueError as exc:
                raise SystemExit(f"replicadp: environment variable {name}: {part!r} is not a network ({exc})") from None
    return tuple(nets)


def model_name(name: str, raw: str) -> str:
    try:
        return check_model_name(raw.strip(), name)
    except InvalidRequest as exc:
        raise SystemExit(f"replicadp: environment variable {exc}") from None


def model_names(name: str, raw: str) -> tuple[str, ...]:
    """Comma-separated model names, e.g. `tiny,tiny-a14b`."""
    return tuple(dict.fromkeys(model_name(name, part) for part in raw.split(",") if part.strip()))


def path(name: str, raw: str) -> Path:
    return Path(raw)


def folder(name: str, raw: str) -> Path:
    return Path(raw).resolve()


def redis_url(name: str, raw: str) -> str:
    try:
        parse_redis_url(raw)
    except RedisURLError as exc:
        raise SystemExit(f"replicadp: {exc}") from None
    return raw


def started_redis(_read: dict) -> str:
    """The embedded server that `replicadp up` started, else a local Redis."""
    try:
        url = json.loads(STATE_FILE.read_text())["redis_url"]
    except (OSError, ValueError, KeyError):
        url = "redis://127.0.0.1:6379/0"
    return redis_url("REDIS_URL", url)


@dataclass(frozen=True)
class Setting:
    """How one setting is read: its variable, its default (a value, or a function of the settings read before
    it), why that default, and how a text is parsed."""

    variable: str
    default: object
    why: str
    parse: Parse = text
    empty: bool = False  # an empty variable is a value (a plain text's), not unset
    default_text: str | None = None  # how docs/configuration.md shows a computed default


def setting(variable: str, default, why: str, parse: Parse = text, *, empty: bool = False,
            default_text: str | None = None, secret: bool = False):
    """A field of Settings read from `variable` (see Setting); `secret`: never printed."""
    return field(repr=not secret, metadata={"setting": Setting(variable, default, why, parse, empty, default_text)})


@dataclass(frozen=True)
class Settings:
    redis_url: str = setting(
        "REDIS_URL", started_redis, "The one Redis that every producer and replica uses (broker, results, leases, the "
        "output store's records). Unset: the embedded server `replicadp up` started, else a local Redis.",
        redis_url, default_text="`replicadp up`'s server, else redis://127.0.0.1:6379/0")
    model: str = setting(
        "REPLICADP_MODEL", "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
        "The production model; `tiny` is the offline stand-in that tests and the demo use.", empty=True)
    model_cache: Path = setting(
        "REPLICADP_MODEL_CACHE", Path.home() / ".cache" / "replicadp" / "models",
        "Where `tiny` models are built on first use; shared by the replicas of a host.", path, empty=True)
    served_model_name: str = setting(
        "REPLICADP_SERVED_MODEL_NAME", lambda read: read["model"], "The name requests give for this replica's model "
        "(`model`), which names its queue too: an alias for the spec (vLLM's --served-model-name). Replicas of one "
        "checkpoint with other memory or speed options are one model; a checkpoint with adapters fused in is another "
        "and needs a name of its own.", model_name, default_text="REPLICADP_MODEL")
    models: tuple = setting(
        "REPLICADP_MODELS", (), "Models the deployment serves although none of their replicas may have started yet "
        "(comma-separated names): a request for one waits in its queue (an autoscaler starts a replica), one for a "
        "model neither declared nor started is refused. A replica declares its own model when it starts.",
        model_names)
    default_model: str | None = setting(
        "REPLICADP_DEFAULT_MODEL", None, "The model of a request that names none. Unset: the one model the "
        "deployment serves; with several, such a request is refused naming them.", model_name)
    queue: str = setting(
        "REPLICADP_QUEUE", "video", "The prefix of every model's queue (`video.<model>`): each model's replicas pull "
        "from its own queue, so routing is work-conserving within each model.", empty=True)
    output_dir: Path = setting(
        "OUTPUT_DIR", lambda _: Path("outputs").resolve(),
        "The folder store's folder; absolute, so that video URIs mean the same to every process on the host.", folder,
        empty=True, default_text="./outputs")
    store: str = setting(
        "REPLICADP_STORE", "dir", "`dir` needs a disk shared with the clients; `redis` keeps the bytes in Redis under "
        "a TTL; `s3`: a bucket.", empty=True)
    store_ttl_s: int = setting(
        "REPLICADP_STORE_TTL", 86400,
        "A day: long enough to fetch a video, short enough not to fill Redis, a disk or a bill. 0: forever.", integer)
    result_ttl_s: int = setting(
        "REPLICADP_RESULT_TTL", 86400, "Results are metadata only (a few hundred bytes); kept as long as the videos.",
        integer)
    threads: int = setting(
        "REPLICADP_THREADS", 1,
        "CPU replicas: threads per replica, so that N replicas share the cores without oversubscription.", integer)
    encode_threads: int = setting(
        "REPLICADP_ENCODE_THREADS", 4, "libx264's threads on a GPU replica, whose host has cores to spare: each "
        "request ends sooner, and the finisher keeps ahead of few-step requests (docs/benchmarks.md, figure 7). "
        "Fixed, not x264's count from the cores: the count changes the bytes. A CPU replica encodes on its "
        "REPLICADP_THREADS.", at_least(1))
    finisher_nice: int = setting(
        "REPLICADP_FINISHER_NICE", 10, "A GPU replica's finisher (its encode) is off the GPU's path, its next "
        "request's hand-over on it: where replicas share too few cores, the kernel runs the hand-over first "
        "(docs/benchmarks.md, section 15). 0: equal.", nice)
    finisher_wait_ms: int = setting(
        "REPLICADP_FINISHER_WAIT_MS", 10, "A finish waits at most this long for the next request's compute to begin, "
        "so that the hand-over runs first: a little longer than a hand-over takes; a request with none behind it is "
        "answered this much later (docs/benchmarks.md, section 15, measures 0, 10 and 20). 0: at once.", at_least(0))
    vae_tiling: bool = setting(
        "REPLICADP_VAE_TILING", False, "Decoding in tiles lowers the VAE's peak memory at some speed cost.", boolean)
    attention: str = setting(
        "REPLICADP_ATTENTION", "native", "diffusers' attention backend for the transformer (`native`: torch's SDPA, "
        "which picks flash or cuDNN kernels itself; `_native_cudnn`, `flex`, `flash` with flash-attn installed, ...). "
        "scripts/gpu_check.sh measures the backends on a GPU; torch's own choice stays until one is shown faster.",
        empty=True)
    compile: str = setting(
        "REPLICADP_COMPILE", "none", "torch.compile of the transformer: `none`, `blocks` (each of its identical "
        "blocks, compiled once: regional compilation, seconds) or `full` (the whole forward). Compiling pays only on "
        "a GPU, once per request shape; off until a GPU run shows the gain against the compile time.", empty=True)
    cache: CacheMethod = setting(
        "REPLICADP_CACHE", CacheMethod.NONE, "The fast path (model/step_cache.py): a step cache that requests asking "
        "for quality=fast run with. None by default: each method trades fidelity for speed (docs/benchmarks.md), a "
        "deployment chooses it.", choice(CacheMethod))
    cache_threshold: float | None = setting(
        "REPLICADP_CACHE_THRESHOLD", None, "The step cache's knob; unset: diffusers' default for the method.", number)
    cache_interval: int | None = setting(
        "REPLICADP_CACHE_INTERVAL", None, "The step cache's interval; unset: the method's default.", integer)
    mag_ratios: Path = setting(
        "REPLICADP_MAG_RATIOS", lambda read: mag_ratios_file(read["model_cache"], read["model"]),
        "MagCache's ratios for the served model: `replicadp calibrate-mag` writes them, replicas read them.", path,
        default_text="a file per model in REPLICADP_MODEL_CACHE")
    quantize: Quantize = setting(
        "REPLICADP_QUANTIZE", Quantize.NONE, "FP8 transformer (model/quantization.py): faster on GPUs that have it, "
        "a different video for every request.", choice(Quantize))
    offload: Offload = setting(
        "REPLICADP_OFFLOAD", Offload.NONE, "Where the models a replica is not running wait (model/memory.py): `none` "
        "keeps all of them on the GPU, the fastest; `expert`, `model` and `group` trade seconds per request for the "
        "memory of a 14B expert, of all but one model, of all but one block. Checked at load against what the GPU "
        "has.", choice(Offload))
    device_memory_gib: float | None = setting(
        "REPLICADP_DEVICE_MEMORY_GIB", None, "The memory a replica may fill on each of its GPUs (GiB; the allocator "
        "is held to it): for a GPU shared with another process, or to try a smaller GPU's limit on a larger one. "
        "Unset: what each has free at load. On a CPU replica only the load-time check reads it.", positive)
    parallel: Layout = setting(
        "REPLICADP_PARALLEL", Layout(), "One replica over K processes (model/parallel.py), e.g. `ulysses:2`, "
        "`ring:2`, `cfg:2,ulysses:2`: each request's denoising split over K GPUs, for a lower latency; N replicas x K "
        "GPUs. `none`: one process.", layout)
    parallel_timeout_s: float = setting(
        "REPLICADP_PARALLEL_TIMEOUT", 60.0, "Seconds a rank waits for another inside a collective, and for the group "
        "to form: past it the replica's attempt ends and its request is requeued. A collective waits one layer's "
        "compute, never a request's.", positive)
    deterministic: bool = setting(
        "REPLICADP_DETERMINISTIC", True, "The same input gives the same frames in every replica "
        "(model/determinism.py): the isolation check needs it. 0 trades that for the libraries' fastest kernels "
        "(scripts/gpu_check.sh measures the difference).", boolean)
    soft_time_limit_s: int = setting(
        "REPLICADP_SOFT_TIME_LIMIT", 1740, "Past the soft limit the request fails cleanly with "
        "SoftTimeLimitExceeded; a 5B request is minutes. 0 disables it (the hard limit then acts alone). Keep it "
        "below the hard limit: Celery arms the hard timer only once the soft one has fired.", integer)
    time_limit_s: int = setting(
        "REPLICADP_TIME_LIMIT", 1800, "Past the hard limit the pool child is killed and replaced (a hung CUDA "
        "kernel).", integer)
    load_timeout_s: int = setting(
        "REPLICADP_LOAD_TIMEOUT", 900, "A replacement pool child that loads for longer than this is killed; a 5B "
        "model loads in a minute or two.", integer)
    max_prompt_chars: int = setting(
        "REPLICADP_MAX_PROMPT_CHARS", 4000, "Wan's text encoder sees 512 tokens; 4000 characters is well past that "
        "and bounds the message.", integer)
    max_work: int = setting(
        "REPLICADP_MAX_WORK", 1280 * 720 * 121 * 50, "Budget per request, height x width x frames x steps: 1280x720, "
        "121 frames, 50 steps (Wan2.2's largest preset); larger requests are refused before they reach the GPU.",
        integer)
    max_attempts: int = setting(
        "REPLICADP_MAX_ATTEMPTS", 3, "A request whose process dies (OOM kill, CUDA crash) is requeued; past this many "
        "starts it is declared poison and failed, instead of killing replicas forever.", integer)
    preempt_after_s: float | None = setting(
        "REPLICADP_PREEMPT_AFTER_S", None, "Preemption by priority (replica/preemption.py): a request of a higher "
        "priority that would wait longer than this many seconds behind lower-priority work of its model stops the "
        "one with the most time left at its next step; it goes on from there later. Unset: off, because each "
        "preempted request's state waits in Redis (about 11 MB at 832x480x33 on TI2V-5B, some 80 MB at "
        "1280x720x81 on A14B): a deployment turns it on (30 is a good start) once its Redis has that room.",
        non_negative)
    max_preemptions: int = setting(
        "REPLICADP_MAX_PREEMPTIONS", 2, "A request stopped this many times for ones of a higher priority runs to its "
        "end: each preemption costs it a wait in the queue, and a batch request must finish some day.", integer)
    preempt_on_shutdown: bool = setting(
        "REPLICADP_PREEMPT_ON_SHUTDOWN", False, "At a warm shutdown (SIGTERM: a deploy, a scale-down, a reclaimed "
        "spot GPU), the running request stops at its next step, its state saved, and is queued again to go on "
        "elsewhere, so the replica leaves in seconds instead of after its request. Off: the state waits in Redis "
        "(see REPLICADP_PREEMPT_AFTER_S), and a fast-path request (a step cache) starts again from its first step.",
        boolean)
    lease_s: int = setting(
        "REPLICADP_LEASE", 6, "A replica whose heartbeat is this many seconds old is dead: its requests go back to "
        "the queue. Renewed every second by the replica's main process (not the busy child), so 5 ticks may be "
        "missed.", integer)
    replica_stale_s: int = setting(
        "REPLICADP_REPLICA_STALE", 5, "A replica whose serving heartbeat (cluster/heartbeat.py, a beat a second) is "
        "this many seconds old is no longer listed as live: a SIGKILLed one drops out within it, a busy one may miss "
        "4 beats.", integer)
    redis_outage_s: int = setting(
        "REPLICADP_REDIS_OUTAGE", 300, "A replica waits this long for Redis to come back before it fails the request "
        "it serves (its result is kept meanwhile: computing a 5B request again costs minutes); a Redis restart takes "
        "seconds.", integer)
    redis_replicas: int = setting(
        "REPLICADP_REDIS_REPLICAS", lambda read: 1 if parse_redis_url(read["redis_url"]).is_sentinel else 0,
        "Writes a guarantee rests on (a queued request, a fence, a result, a cancel) wait until this many Redis "
        "replicas hold them, so that a failover keeps them (cluster/replication.durable). A Sentinel URL: 1, which "
        "the replica Sentinel promotes (the most up to date) has; a single server: 0 (nothing to wait for). Give 1 "
        "for a managed Redis with a replica behind one endpoint.", integer,
        default_text="1 with a Sentinel URL, else 0")
    redis_ack_timeout_ms: int = setting(
        "REPLICADP_REDIS_ACK_TIMEOUT_MS", 1000, "A replica answers WAIT in well under a millisecond; one that does not "
        "answer in this is down or cut off, and the write goes on with the master's copy alone (logged). From 0 to "
        f"{_ACK_TIMEOUT_MAX_MS}: below the time a Redis reply may take ({REPLY_TIMEOUT_S:g} s, "
        "cluster/connection.REPLY_TIMEOUT_S), or a WAIT would be taken for a frozen server.",
        between(0, _ACK_TIMEOUT_MAX_MS))
    max_image_bytes: int = setting(
        "REPLICADP_MAX_IMAGE_BYTES", 20 * 1024 * 1024, "A first frame is at most a few MB; larger inputs are refused "
        "before decoding.", integer)
    image_timeout_s: int = setting(
        "REPLICADP_IMAGE_TIMEOUT", 10, "A slow image server must not hold a GPU: seconds for the whole download, all "
        "redirects included.", integer)
    fetch_allow: tuple = setting(
        "REPLICADP_FETCH_ALLOW", (), "Networks (CIDRs, comma-separated) a request's URL may reach although they are "
        "not public (loopback, private, link-local, ...): none, so that a request cannot make a replica read the "
        "services of its own host or network.", networks)
    image_dir: Path | None = setting(
        "REPLICADP_IMAGE_DIR", None, "Local image paths are refused unless they lie under this folder.", folder)
    loras_file: str | None = setting(
        "REPLICADP_LORAS", None, "The LoRA adapters a replica loads at start and a request may name "
        "(model/adapters.py): a TOML file the operator writes. Unset: none, and a request naming one is refused. An "
        "adapter marked `fuse = true` is fused into the weights at load instead: the replica serves a model of its "
        "own (a few-step one, with the adapter's recipe).")
    recipe: str | None = setting(
        "REPLICADP_RECIPE", None, "The model's sampling recipe, as a TOML inline table (contract/recipe.py), for a "
        "distilled checkpoint whose steps, guidance and scheduler are part of it (a FastWan-style folder): requests "
        "get them by default and are refused other ones. Unset: the checkpoint's own scheduler, and a request's "
        "steps and guidance are its own.")
    scheduling: Scheduling = setting(
        "REPLICADP_SCHEDULING", Scheduling.FAIR, "Where a producer places a request (broker/placement.py): `fair` "
        "(priorities, then round robin across tenants and users) or `fifo` (one list in arrival order: the baseline "
        "the scheduling benchmark compares with).", choice(Scheduling))
    s3_bucket: str = setting(
        "REPLICADP_S3_BUCKET", "", "REPLICADP_STORE=s3: the bucket (no default: it is the operator's).", empty=True)
    s3_prefix: str = setting(
        "REPLICADP_S3_PREFIX", "replicadp/", "The key prefix the videos go under, so that a bucket can hold other "
        "things too (retention removes only what lies under it).", empty=True)
    s3_endpoint_url: str | None = setting(
        "REPLICADP_S3_ENDPOINT_URL", None, "Unset: AWS itself; set for MinIO, Ceph, R2 or any other S3 API "
        "(credentials: boto3's own chain).")
    s3_url_ttl_s: int = setting(
        "REPLICADP_S3_URL_TTL", 3600, "An hour: a client fetches a video soon after it reads the result; readers make "
        "a fresh URL on each read (outputs/store.with_video_url). At most 7 days, SigV4's limit.", integer)
    log_format: LogFormat = setting(
        "REPLICADP_LOG_FORMAT", LogFormat.TEXT, "Text lines by default (a person reads them); `json`: one object per "
        "line for a log shipper.", choice(LogFormat))
    webhooks: bool = setting(
        "REPLICADP_WEBHOOKS", True, "Webhooks (replicadp_tasks/webhooks/) are on where a secret is set: 0 refuses "
        "every request that names one.", boolean)
    webhook_claim_s: int = setting(
        "REPLICADP_WEBHOOK_CLAIM", 60, "A webhook event a sender took is due again this long after: well past one "
        "attempt, and soon enough after a sender's death or a Redis reply lost after the attempt.",
        at_least(MIN_WEBHOOK_CLAIM_S))
    webhook_secret: str = setting(
        "REPLICADP_WEBHOOK_SECRET", "", "Signs every webhook POST. No default: an unsigned webhook could be forged by "
        "anyone who learns its URL, so without a secret a request naming a webhook is refused (set the same one on "
        "the gateways and the replicas).", empty=True, secret=True)

    @classmethod
    def from_env(cls, environ=os.environ) -> "Settings":
        """Every setting, read from `environ`, in the order declared (a default may use those before it)."""
        read: dict = {}
        for f in fields(cls):
            s: Setting = f.metadata["setting"]
            raw = environ.get(s.variable)
            if raw is not None and (s.empty or raw.strip() != ""):
                read[f.name] = s.parse(s.variable, raw)
            else:
                read[f.name] = s.default(read) if callable(s.default) else s.default
        return cls(**read)

    @property
    def durability(self) -> Durability:
        """How writes that a guarantee rests on are kept across a failover (cluster/replication.py)."""
        return Durability(self.redis_replicas, self.redis_ack_timeout_ms, self.redis_outage_s)

    def model_options(self) -> ModelOptions:
        """The served model and how it loads and runs (model/options.py). Reads MagCache's ratios where
        REPLICADP_CACHE=mag: ModelLoadError saying how to make them."""
        return ModelOptions(
            self.model, model_cache=self.model_cache, threads=self.threads, vae_tiling=self.vae_tiling,
            attention=self.attention, compile=self.compile, deterministic=self.deterministic,
            cache=StepCache.of(self.cache, self.cache_threshold, self.cache_interval, self.mag_ratios, self.model),
            quantize=self.quantize, offload=self.offload, memory_gib=self.device_memory_gib, layout=self.parallel,
            parallel_timeout_s=self.parallel_timeout_s, load_timeout_s=self.load_timeout_s, loras_file=self.loras_file,
            recipe=self.recipe)


def reference() -> list[Setting]:
    """Every setting, as docs/configuration.md lists them."""
    return [f.metadata["setting"] for f in fields(Settings)]


SETTINGS = Settings.from_env()

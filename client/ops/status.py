"""`replicadp status`: each model the deployment serves (its replicas, queue depth, wait, throughput), and the live
replicas, what each is running and at which step. Also the read side that `metrics` and `health` share: a model's
queue depth and its next request; and what the live replicas of a model accept, which `generate` and `submit`
check a request against before sending it."""

from __future__ import annotations

import json
import time
import redis
from celery.result import AsyncResult
from rich.progress_bar import ProgressBar
from rich.table import Table

from replicadp_tasks import app
from replicadp_tasks.broker import next_request
from replicadp_tasks.cluster import connection, fleet, heartbeat
from replicadp_tasks.contract import Accepts, Phase, Priority, Quality, Recipe, keys, queue_for
from replicadp_tasks.settings import SETTINGS

from ..api import live_replicas, redis_client, redis_url, replica_info

THROUGHPUT_WINDOWS_MIN = (1, 5, 15)  # videos/min over these recent windows (completions are kept an hour)


def fast_path(info: dict) -> str | None:
    """The step cache a replica runs `quality=fast` requests with (its ReplicaInfo's `cache`, e.g. `mag
    threshold=0.06`); None when it serves no fast path."""
    return info.get("cache") if Quality.FAST in (info.get("qualities") or []) else None


def recipe_of(info: dict) -> str | None:
    """A replica's sampling recipe in one line (Recipe.describe), None for none."""
    return None if not info.get("recipe") else Recipe.from_wire(info["recipe"]).describe()


def accepted_by(infos: list[dict]) -> Accepts:
    """What the replicas of these ReplicaInfos all accept (any of them may take a request), as the gateway and the
    CLI check a request before sending it: the largest size multiple, the qualities all of them serve, the fewest
    experts (1 refuses the two-expert fields), a first frame required if some serve an image-to-video model, the
    adapters every one of them registered, and the sampling recipe of their model (of each adapter) where they
    agree on it. With none live: Accepts(), and the task checks."""
    if not infos:
        return Accepts()
    served = set.intersection(*(set(i.get("qualities") or [Quality.STANDARD]) for i in infos))
    everywhere = set.intersection(*({a["name"] for a in i.get("loras") or []} for i in infos))
    loras = {a["name"]: a["scale"] for a in infos[0].get("loras") or [] if a["name"] in everywhere}
    recipes = {json.dumps(i.get("recipe"), sort_keys=True) for i in infos}
    recipe = infos[0].get("recipe") if len(recipes) == 1 else None
    return Accepts(size_multiple=max(int(i.get("size_multiple") or 16) for i in infos),
                   qualities=tuple(sorted(served, reverse=True)), experts=min(int(i.get("experts") or 1) for i in infos),
                   requires_image=any(i.get("requires_image") for i in infos), loras=loras,
                   recipe=None if recipe is None else Recipe.from_wire(recipe),
                   lora_recipes={a["name"]: Recipe.from_wire(a["recipe"]) for a in infos[0].get("loras") or []
                                 if a["name"] in everywhere and a.get("recipe")})


def live_accepted(model: str, timeout: float = 1.0) -> Accepts:
    """What the live replicas of `model` accept, read once from Redis; Accepts() while none is live or Redis is
    unreachable (the send that follows says which)."""
    try:
        infos = replica_info(redis_client(redis_url(), timeout), live_replicas(timeout)).values()
    except redis.RedisError:
        return Accepts()
    return accepted_by([info for info in infos if info.get("model") == model])


def models(client) -> list[str]:
    """Every model the deployment serves (cluster/fleet.py): declared in Redis, each live replica's among them, or
    by this process's REPLICADP_MODELS."""
    return sorted(fleet.served(client, SETTINGS.models))


def queue_head(client, model: str) -> tuple[dict[Priority, int], dict | None]:
    """How many requests wait for `model` at each priority, and the headers of the request one of its replicas
    takes next (None when its queue is empty, {} when that is not a request): the head of the highest priority's
    list that is not empty (broker/placement.py)."""
    depths, raw = next_request(client, queue_for(SETTINGS.queue, model))
    if raw is None:
        return depths, None
    try:  # anything can be pushed onto the queue; a replica refuses what is not a request, a reader shows none
        headers = json.loads(raw).get("headers")
    except (ValueError, AttributeError):
        headers = None
    return depths, headers if isinstance(headers, dict) else {}


def waited_s(headers: dict | None, now: float) -> float | None:
    """How long a queued request has waited (sender's clock), from the header the producer stamps;
    0 for an empty queue, None when the request carries no stamp (sent by another producer)."""
    if headers is None:
        return 0.0
    sent_at = headers.get("replicadp_sent_at")
    return max(0.0, now - sent_at) if isinstance(sent_at, (int, float)) else None


def model_row(client, model: str, infos: dict, serving: list[str], now: float) -> dict:
    """One model as `status` shows it: its live replicas (serving, and loading), its queue, its videos/min."""
    depths, head = queue_head(client, model)
    mine = [name for name, info in infos.items() if info.get("model") == model]
    return {"name": model, "queue": queue_for(SETTINGS.queue, model), "replicas": len(mine),
            "serving": sum(name in serving for name in mine), "queue_depth": sum(depths.values()),
            "queue_by_priority": {str(p): n for p, n in depths.items()}, "oldest_wait_s": waited_s(head, now),
            **videos_per_min(client, keys.completed_key(model), now)}


def videos_per_min(client, completed: str, now: float) -> dict[str, float]:
    """`videos_per_min_<m>m` over each of THROUGHPUT_WINDOWS_MIN, from the completions in the sorted set
    `completed`."""
    pipe = client.pipeline()
    for minutes in THROUGHPUT_WINDOWS_MIN:
        pipe.zcount(completed, now - 60 * minutes, now)
    return {f"videos_per_min_{m}m": n / m for m, n in zip(THROUGHPUT_WINDOWS_MIN, pipe.execute())}


def snapshot() -> dict:
    """Every model the deployment serves (its replicas, queue and throughput), every live replica (serving, or
    loading its model), what it runs and at which step, and the totals: from Redis alone (the replicas'
    heartbeats, heartbeat.py), a few milliseconds."""
    client = connection.client(redis_url(), socket_connect_timeout=3)
    beats = heartbeat.read(client, SETTINGS.replica_stale_s)
    names = sorted(beats.serving + beats.standby)
    info = replica_info(client, names)
    replicas = []
    for name in names:
        running = beats.running.get(name)
        progress = AsyncResult(running["task_id"], app=app).info if running else None
        progress = progress if isinstance(progress, dict) else {}
        replicas.append({
            "name": name, "model": info[name].get("model"), "device": info[name].get("device"),
            "serving": name in beats.serving, "qualities": info[name].get("qualities"),
            "fast_path": fast_path(info[name]), "offload": info[name].get("offload"),
            "parallel": info[name].get("parallel"),
            "loras": [a["name"] for a in info[name].get("loras") or []],
            "fused": [a["name"] for a in info[name].get("fused") or []], "recipe": recipe_of(info[name]),
            "request_id": progress.get("request_id") or (running or {}).get("task_id"),
            "phase": progress.get("phase"), "step": progress.get("step"), "total_steps": progress.get("total_steps"),
            "running_s": time.time() - running["started_at"] if running else None,
        })
    now = time.time()
    rows = [model_row(client, model, info, beats.serving, now) for model in models(client)]
    return {"models": rows, "replicas": replicas, "queue_depth": sum(r["queue_depth"] for r in rows),
            **videos_per_min(client, keys.COMPLETED_KEY, now)}


def models_table(snap: dict) -> Table:
    """A snapshot's models as `replicadp status` prints them: one row per model, the totals in the title."""
    rates = ", ".join(f"{snap[f'videos_per_min_{m}m']:.1f} ({m} min)" for m in THROUGHPUT_WINDOWS_MIN)
    t = Table(title=f"{snap['queue_depth']} waiting; videos/min {rates}")
    for col in ("model", "replicas", "queue", "waiting", "next waited", "videos/min (1, 5, 15 min)"):
        t.add_column(col)
    for m in snap["models"]:
        split = ", ".join(f"{p} {n}" for p, n in m["queue_by_priority"].items() if n)
        wait = m["oldest_wait_s"]
        t.add_row(m["name"], f"{m['serving']} serving" + (f", {m['replicas'] - m['serving']} loading"
                                                           if m["replicas"] > m["serving"] else ""),
                  m["queue"], f"{m['queue_depth']}" + (f" ({split})" if split else ""),
                  f"{wait:.0f} s" if m["queue_depth"] and wait is not None else "-",
                  ", ".join(f"{m[f'videos_per_min_{n}m']:.1f}" for n in THROUGHPUT_WINDOWS_MIN))
    if not snap["models"]:
        t.caption = "no model declared or served"
    return t


def table(snap: dict) -> Table:
    """A snapshot's replicas as the table `replicadp status` prints: one row per replica."""
    t = Table(title="replicas")
    for col in ("replica", "device", "model", "fast path", "serving", "request", "denoising", "step", "running"):
        t.add_column(col)
    for r in snap["replicas"]:
        total = r["total_steps"]
        step = f"{r['step']}/{total}" if total else ("starting" if r["request_id"] else "idle")
        if r["phase"] not in (None, Phase.DENOISING):
            step = r["phase"]  # past the last step: decoding, encoding, storing
        bar = ProgressBar(total=total, completed=r["step"] or 0, width=24) if total else ""
        running = "-" if r["running_s"] is None else f"{r['running_s']:.0f} s"
        ways = [f"offload {r['offload']}" if r["offload"] not in (None, "none") else "",
                r["parallel"] if r["parallel"] not in (None, "none") else "",
                f"LoRA {', '.join(r['loras'])}" if r.get("loras") else "",
                f"fused {', '.join(r['fused'])}" if r.get("fused") else "", r.get("recipe") or ""]
        model = str(r["model"]) + (f" ({', '.join(w for w in ways if w)})" if any(ways) else "")
        t.add_row(r["name"], str(r["device"]), model, r["fast_path"] or "-", "yes" if r["serving"] else "no",
                  str(r["request_id"] or "-"), bar, step, running)
    if not snap["replicas"]:
        t.caption = "no live replica"
    return t

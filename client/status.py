"""`replicadp status`: live replicas, what each is running and at which step, queue depth, throughput."""

from __future__ import annotations

import json
import time

import redis
from celery.result import AsyncResult

from replicadp_tasks import app
from replicadp_tasks.settings import SETTINGS
from replicadp_tasks.worker import COMPLETED_KEY, REPLICA_KEY

from .api import redis_url


def replica_info(client, names) -> dict:
    """What each replica published when it loaded its model (model, device, pid)."""
    raws = client.mget([REPLICA_KEY + n for n in names]) if names else []
    return {n: json.loads(r) if r else {} for n, r in zip(names, raws)}


def snapshot() -> dict:
    client = redis.Redis.from_url(redis_url(), socket_connect_timeout=3)
    inspect = app.control.inspect(timeout=1.0)
    active = inspect.active() or {}
    queues = inspect.active_queues() or {}
    names = sorted(set(active) | set(queues))
    info = replica_info(client, names)
    replicas = []
    for name in names:
        running = (active.get(name) or [None])[0]
        progress = AsyncResult(running["id"], app=app).info if running else None
        progress = progress if isinstance(progress, dict) else {}
        replicas.append({
            "name": name, "model": info[name].get("model"), "device": info[name].get("device"),
            "serving": any(q["name"] == SETTINGS.queue for q in queues.get(name, [])),
            "request_id": progress.get("request_id") or (running or {}).get("id"),
            "step": progress.get("step"), "total_steps": progress.get("total_steps"),
        })
    now = time.time()
    done_1m = client.zcount(COMPLETED_KEY, now - 60, now)
    done_5m = client.zcount(COMPLETED_KEY, now - 300, now)
    return {"replicas": replicas, "queue": SETTINGS.queue, "queue_depth": client.llen(SETTINGS.queue),
            "videos_per_min_1m": done_1m, "videos_per_min_5m": done_5m / 5.0}

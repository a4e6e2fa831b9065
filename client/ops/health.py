"""`replicadp health --replica NAME`: is a replica serving, not merely alive? For docker-compose's healthcheck.

A known Celery failure: after a broker reconnect a worker can go on answering control commands (alive to
`celery inspect ping` and in Flower) while it no longer takes requests from the queue. A ping cannot see that,
so the check asks for progress too. Healthy means all of:
  - the replica answers a ping (its main process and event loop run);
  - it consumes its model's queue;
  - running a request: the request's denoising step changed within `stall_s` (a hung pool child fails this);
  - idle: the request a replica takes next has not waited `stall_s` (idle beside waiting work fails this).
A PROGRESS update carries no time, so the step last seen, and since when, is kept in Redis between checks.
Run with Docker's `retries`: one failed check can be a race (a replica that became idle a millisecond ago
beside a request that waited while every replica was busy); a real stall fails every check.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from celery.result import AsyncResult
from celery.utils.nodenames import host_format

from replicadp_tasks import app
from replicadp_tasks.cluster import connection
from replicadp_tasks.contract import keys, queue_for
from replicadp_tasks.settings import SETTINGS

from ..api import redis_url, replica_info
from .status import queue_head, waited_s

# No progress for this long is unhealthy: well above one denoising step or the VAE decode of the largest
# request (1280x720, 121 frames) on a slow GPU, well below the hard time limit (1800 s).
STALL_S = 300.0
# A replica answers control commands from its main process even while its GPU is busy: seconds, not minutes.
REPLY_TIMEOUT_S = 5.0


@dataclass
class Verdict:
    healthy: bool
    reason: str


def check(name: str, stall_s: float = STALL_S, timeout: float = REPLY_TIMEOUT_S) -> Verdict:
    """The health of replica `name` (a node name; %h, %n, %d expand as in `celery worker -n`)."""
    name = host_format(name)
    if not app.control.ping(destination=[name], timeout=timeout):
        return Verdict(False, f"{name}: no reply to ping within {timeout:.0f} s (process gone or its event loop stuck)")
    inspect = app.control.inspect(destination=[name], timeout=timeout)
    queues, active = inspect.active_queues() or {}, inspect.active() or {}
    if name not in queues or name not in active:
        return Verdict(False, f"{name}: answered a ping but not an inspect within {timeout:.0f} s")
    client = connection.client(redis_url(), socket_connect_timeout=timeout, socket_timeout=timeout)
    now = time.time()
    if active[name]:
        return _progress(client, name, active[name][0]["id"], stall_s, now)
    client.delete(keys.SEEN_KEY + name)
    model = replica_info(client, [name])[name].get("model")
    queue = queue_for(SETTINGS.queue, model) if model else None
    if queue is None or not any(q["name"] == queue for q in queues[name]):
        return Verdict(False, f"{name}: idle and not consuming " + (f"queue {queue!r}" if queue else "its model's "
                              "queue") + " (still loading its model, or its consumer was lost)")
    _, head = queue_head(client, model)
    waited = waited_s(head, now)
    if waited is not None and waited > stall_s:
        return Verdict(False, f"{name}: idle while request {head.get('id')} has waited {waited:.0f} s in queue "
                              f"{queue!r} (alive but not consuming)")
    return Verdict(True, f"{name}: idle, consuming {queue!r}")


def _progress(client, name: str, task_id: str, stall_s: float, now: float) -> Verdict:
    """A running replica is healthy while its request's step keeps changing."""
    info = AsyncResult(task_id, app=app).info
    step = info.get("step") if isinstance(info, dict) else None
    total = info.get("total_steps") if isinstance(info, dict) else None
    key = keys.SEEN_KEY + name
    seen = json.loads(client.get(key) or "{}")
    if (seen.get("task"), seen.get("step")) != (task_id, step):
        seen = {"task": task_id, "step": step, "since": now}
        client.set(key, json.dumps(seen))
    # Outlives the longest stall it must measure; a replica that goes away leaves no key behind for long.
    client.expire(key, int(2 * stall_s) + 60)
    at = f"step {step}/{total}" if total else "before its first step"
    stalled = now - seen["since"]
    if stalled > stall_s:
        return Verdict(False, f"{name}: request {task_id} has been at {at} for {stalled:.0f} s (stuck)")
    return Verdict(True, f"{name}: running request {task_id}, {at}")

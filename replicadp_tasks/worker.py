"""A replica's life cycle: load the pipeline in the pool child, then start taking requests.

The main process would reserve a request as soon as it starts consuming, while its child is still
loading the model (seen: a request waited 12 s on a loading replica beside an idle, ready one). So a
replica starts on a private standby queue, and the child, once its model is resident, asks its own main
process to consume the shared queue.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import redis
from celery import bootsteps, signals
from celery.worker import state as worker_state
from kombu import Queue

from .app import app
from .lease import Keeper
from .pipeline import PipelineHolder, describe_device
from .settings import SETTINGS
from .store import open_store, outage_tolerant

log = logging.getLogger("replicadp")

REPLICA_KEY = "replicadp:replica:"  # + node name: what each replica serves (for `replicadp status`)
COMPLETED_KEY = "replicadp:completed"  # request_id -> completion time, the last hour (recent throughput)
ATTEMPTS_KEY = "replicadp:attempts:"  # + task id: how many times a delivery of it has started
DEAD_KEY = "replicadp:dead"  # JSON records of requests failed as poison, newest first
CANCEL_KEY = "replicadp:cancel:"  # + task id: set by client.api.cancel_request
STATS_KEY = "replicadp:stats"  # counters: duplicate_executions (a second delivery computed a stored result)
_state: dict = {"name": None, "holder": None, "store": None, "redis": None, "keeper": None}


def holder() -> PipelineHolder:
    if _state["holder"] is None:
        raise RuntimeError("no pipeline loaded: generate runs only in a replica's pool child")
    return _state["holder"]


def store():
    return _state["store"]


def start_attempt(task_id: str) -> int:
    """Count one more start of this task (redeliveries keep the task id); returns the count."""
    key = ATTEMPTS_KEY + task_id
    pipe = _state["redis"].pipeline()
    pipe.incr(key)
    pipe.expire(key, SETTINGS.result_ttl_s)
    return pipe.execute()[0]


def record_dead(task_id: str, kwargs: dict, attempts: int) -> None:
    record = {"task_id": task_id, "kwargs": kwargs, "attempts": attempts, "at": time.time()}
    _state["redis"].lpush(DEAD_KEY, json.dumps(record, default=repr))


def redis_client() -> redis.Redis:
    return _state["redis"]


def cancelled(task_id: str) -> bool:
    return bool(_state["redis"].exists(CANCEL_KEY + task_id))


def record_completion(request_id: str) -> None:
    now = time.time()
    pipe = _state["redis"].pipeline()
    pipe.zadd(COMPLETED_KEY, {request_id: now})
    pipe.zremrangebyscore(COMPLETED_KEY, 0, now - 3600)
    pipe.execute()


@signals.celeryd_init.connect
def _start_on_standby(sender, instance, conf, **_):
    """In the main process, before it consumes: listen only on this replica's standby queue."""
    _state["name"] = sender
    conf.task_queues = [Queue(f"replicadp.standby.{sender}")]


class LeaseStep(bootsteps.StartStopStep):
    """In the main process: heartbeat, lease renewal and the dead-holder sweep (see lease.py). A thread, not
    a timer on the event loop: a warm shutdown stops the loop while the running request finishes, and that
    request's lease must stay alive until it has."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c):
        keeper = _state["keeper"] or Keeper(c.hostname, SETTINGS.redis_url, SETTINGS.lease_s)
        keeper.qos = c.task_consumer.channel.qos  # kombu's requeue; a new one after each broker reconnect
        if _state["keeper"] is None:
            _state["keeper"] = keeper
            threading.Thread(target=keeper.run, name="replicadp-lease", daemon=True,
                             args=(lambda: worker_state.reserved_requests | worker_state.active_requests,)).start()


@signals.task_received.connect
def _record_holder(request, **_):
    """In the main process, as a message arrives: record that this replica holds it."""
    if _state["keeper"] is not None:
        _state["keeper"].hold(request.message.delivery_tag)


@signals.worker_process_init.connect
def _load_then_consume(**_):
    """In the pool child: load the model, publish what this replica serves, then open the shared queue."""
    name = _state["name"]
    started = time.time()
    pipeline = PipelineHolder(SETTINGS.model, model_cache=SETTINGS.model_cache,
                              threads=SETTINGS.threads, vae_tiling=SETTINGS.vae_tiling)
    try:
        pipeline.load()
        _state["store"] = open_store(SETTINGS.store, SETTINGS.output_dir, SETTINGS.redis_url, SETTINGS.store_ttl_s)
    except Exception:
        # A replica that cannot load its model must not serve: stop the whole worker so that its
        # supervisor sees the failure, instead of the pool restarting this child in a loop.
        log.exception("replica %s cannot load model %r; stopping", name, SETTINGS.model)
        os.kill(os.getppid(), signal.SIGQUIT)
        os._exit(1)
    _state["holder"] = pipeline
    info = {"name": name, "model": SETTINGS.model, "device": describe_device(pipeline.device),
            "size_multiple": pipeline.size_multiple, "accepts_image": pipeline.accepts_image,
            "pid": os.getpid(), "load_s": round(time.time() - started, 3), "loaded_at": time.time()}
    _state["redis"] = outage_tolerant(SETTINGS.redis_url)
    _state["redis"].set(REPLICA_KEY + name, json.dumps(info))
    log.info("replica %s loaded %r on %s in %.1f s", name, SETTINGS.model, info["device"], info["load_s"])
    # The main process answers control commands from its event loop, which may not run yet: retry.
    while not app.control.add_consumer(SETTINGS.queue, destination=[name], reply=True, timeout=1.0):
        pass


app.steps["consumer"].add(LeaseStep)

"""A replica's life cycle: load the pipeline in the pool child, then start taking requests.

The main process would reserve a request as soon as it starts consuming, while its child is still
loading the model (seen: a request waited 12 s on a loading replica beside an idle, ready one). So a
replica starts on a private standby queue, and the child, once its model is resident, asks its own main
process to consume the shared queue. When the child dies (killed, or past the hard time limit), the main
process stops consuming the shared queue before it lets go of the request, and the replacement child
opens it again once it has reloaded the model: meanwhile the request runs on a replica that is ready.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import threading
import time

import redis
from billiard.exceptions import WorkerLostError
from celery import bootsteps, signals
from celery.worker import state as worker_state
from celery.worker.request import Request
from kombu import Queue
from kombu.exceptions import OperationalError
from kombu.transport import virtual

from .app import app
from .lease import FenceKeeper, Keeper
from .pipeline import PipelineHolder, describe_device
from .settings import SETTINGS
from .store import open_store, outage_tolerant
from .transport import STANDBY_PREFIX, record_dead

log = logging.getLogger("replicadp")

REPLICA_KEY = "replicadp:replica:"  # + node name: what each replica serves (for `replicadp status`)
COMPLETED_KEY = "replicadp:completed"  # request_id -> completion time, the last hour (recent throughput)
ATTEMPTS_KEY = "replicadp:attempts:"  # + task id: how many times a delivery of it has started
CANCEL_KEY = "replicadp:cancel:"  # + task id: set by client.api.cancel_request
_state: dict = {"name": None, "holder": None, "store": None, "redis": None, "keeper": None, "consumer": None,
                "stopping": None, "fences": None}


def holder() -> PipelineHolder:
    if _state["holder"] is None:
        raise RuntimeError("no pipeline loaded: generate runs only in a replica's pool child")
    return _state["holder"]


def store():
    return _state["store"]


def fences() -> FenceKeeper:
    """The pool child's renewer of the fence it computes under."""
    return _state["fences"]


def start_attempt(task_id: str) -> int:
    """Count one more start of this task (redeliveries keep the task id); returns the count."""
    key = ATTEMPTS_KEY + task_id
    pipe = _state["redis"].pipeline()
    pipe.incr(key)
    pipe.expire(key, SETTINGS.result_ttl_s)
    return pipe.execute()[0]


def record_poison(task_id: str, kwargs: dict, attempts: int) -> None:
    record_dead(_state["redis"], {"task_id": task_id, "reason": f"poison: ended its replica's process {attempts} "
                                  "times", "kwargs": kwargs, "attempts": attempts})


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
    _state["stopping"] = multiprocessing.RawValue("b", 0)  # shared memory: pool children see it set
    conf.task_queues = [Queue(STANDBY_PREFIX + sender)]


@signals.worker_shutting_down.connect
def _stopping(**_):
    """In the main process, at SIGTERM/SIGINT: tell a child still loading not to wait for an answer that a
    stopping main process no longer gives (seen: a warm shutdown during a reload hung until SIGKILL)."""
    if _state["stopping"] is not None:
        _state["stopping"].value = 1


class LeaseStep(bootsteps.StartStopStep):
    """In the main process: heartbeat, lease renewal and the dead-holder sweep (see lease.py). A thread, not
    a timer on the event loop: a warm shutdown stops the loop while the running request finishes, and that
    request's lease must stay alive until it has."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c):
        keeper = _state["keeper"] or Keeper(c.hostname, SETTINGS.redis_url, SETTINGS.lease_s)
        keeper.qos = c.task_consumer.channel.qos  # kombu's requeue; a new one after each broker reconnect
        _state["consumer"] = c
        if _state["keeper"] is None:
            _state["keeper"] = keeper
            threading.Thread(target=keeper.run, name="replicadp-lease", daemon=True,
                             args=(lambda: worker_state.reserved_requests | worker_state.active_requests,)).start()


class ReplicaRequest(Request):
    """A request as the main process sees it. When the pool child running it dies, the replica stops taking
    requests until a replacement child has loaded the model; a request lost with its child goes back to the
    head of the queue (Celery's own requeue would put it at the back, behind requests sent after it)."""

    def on_failure(self, exc_info, send_failed_event=True, return_ok=False):
        exc = getattr(exc_info.exception, "exc", exc_info.exception)  # unwrap ExceptionWithTraceback
        if isinstance(exc, WorkerLostError):
            _pause("its pool child was lost")
            if self.task.acks_late and self.task.reject_on_worker_lost and _state["keeper"] is not None:
                # Instead of Celery's reject. If Redis is down, Celery's reject fails too, and the lease sweep
                # requeues it within two ticks.
                try:
                    _state["keeper"].lost(self)
                except redis.RedisError as err:
                    log.warning("cannot requeue %s now: %s", self.id, err)
                else:
                    # Requeued: settle the message in this process only. Celery's reject would restore it by its
                    # delivery tag once more, and the tag stays the same on redelivery: a replica that received
                    # the message meanwhile (a few ms) would have its delivery put back as a second copy (seen:
                    # every such kill gave two deliveries, each counted as a start, so that a request killed
                    # twice was failed as poison).
                    virtual.QoS.ack(self.message.channel.qos, self.message.delivery_tag)
                    self.acknowledged = True
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def on_timeout(self, soft, timeout):
        if not soft:  # the pool kills the child next
            _pause("its pool child passed the hard time limit")
        return super().on_timeout(soft, timeout)


def _pause(why: str) -> None:
    """In the main process: stop consuming the shared queue, before the lost request frees its prefetch slot
    (else this replica would take a request, maybe that very one, and hold it through the reload)."""
    if _state["consumer"] is not None:
        log.warning("replica %s stops taking requests until its pool child has reloaded the model: %s",
                    _state["name"], why)
        _state["consumer"].cancel_task_queue(SETTINGS.queue)


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
    pipeline = PipelineHolder(SETTINGS.model, model_cache=SETTINGS.model_cache, threads=SETTINGS.threads,
                              vae_tiling=SETTINGS.vae_tiling, attention=SETTINGS.attention, compile=SETTINGS.compile,
                              deterministic=SETTINGS.deterministic)
    try:
        pipeline.load()
        _state["store"] = open_store(SETTINGS.store, SETTINGS.output_dir, SETTINGS.redis_url, SETTINGS.store_ttl_s,
                                     SETTINGS.redis_outage_s)
    except Exception:
        # A replica that cannot load its model must not serve: stop the whole worker so that its
        # supervisor sees the failure, instead of the pool restarting this child in a loop.
        log.exception("replica %s cannot load model %r; stopping", name, SETTINGS.model)
        os.kill(os.getppid(), signal.SIGQUIT)
        os._exit(1)
    _state["holder"] = pipeline
    info = {"name": name, "model": SETTINGS.model, "device": describe_device(pipeline.device),
            "size_multiple": pipeline.size_multiple, "accepts_image": pipeline.accepts_image,
            "attention": SETTINGS.attention, "compile": SETTINGS.compile, "deterministic": SETTINGS.deterministic,
            "pid": os.getpid(), "load_s": round(time.time() - started, 3), "loaded_at": time.time()}
    _state["redis"] = outage_tolerant(SETTINGS.redis_url, SETTINGS.redis_outage_s)
    _state["fences"] = FenceKeeper(SETTINGS.redis_url, SETTINGS.lease_s)
    threading.Thread(target=_state["fences"].run, name="replicadp-fence", daemon=True).start()
    log.info("replica %s loaded %r on %s in %.1f s", name, SETTINGS.model, info["device"], info["load_s"])
    # Publish what this replica serves, then ask the main process, which answers control commands from its
    # event loop (it may not run yet), to consume the shared queue. Redis may be down or restarting: wait it
    # out, on a fresh connection each time. Celery logs and drops an exception raised here, and the replica
    # would never consume again (seen in a chaos run: a replica idle beside its loaded model).
    while not _state["stopping"].value:
        with app.connection_for_write() as conn:
            try:
                _state["redis"].set(REPLICA_KEY + name, json.dumps(info))
                if app.control.add_consumer(SETTINGS.queue, destination=[name], reply=True, timeout=1.0,
                                            connection=conn):
                    break
            except conn.connection_errors + conn.channel_errors + (OperationalError, OSError) as exc:
                log.warning("replica %s: cannot reach Redis to start consuming (%r); retrying", name, exc)
                time.sleep(1.0)


app.steps["consumer"].add(LeaseStep)

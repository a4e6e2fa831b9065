"""A replica's life cycle: load the pipeline in the pool child, then start taking requests.

The main process would reserve a request as soon as it starts consuming, while its child is still
loading the model, and the request would wait beside an idle, ready replica. So a replica starts on a
private standby queue, and the child, once its model is resident, asks its own main process to consume the
shared queue. When the child dies (killed, or past the hard time limit), the main
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
from dataclasses import dataclass

import redis
from billiard.exceptions import WorkerLostError
from celery import bootsteps, signals
from celery.worker import state as worker_state
from celery.worker.request import Request
from kombu import Exchange, Queue
from kombu.exceptions import OperationalError
from kombu.transport import virtual

from . import child
from .app import app
from .keys import REPLICA_KEY, STANDBY_PREFIX
from .lease import FenceKeeper, Keeper
from .pipeline import PipelineHolder, describe_device
from .records import ReplicaInfo
from .settings import SETTINGS
from .store import open_store, outage_tolerant

log = logging.getLogger("replicadp")



@dataclass
class MainProcess:
    """A replica's main process: it holds the messages (Celery's consumer), renews the leases and restarts the
    pool child. The pool child's own state is child.PoolChild."""

    name: str | None = None  # the replica's node name
    stopping: object = None  # a RawValue in shared memory, set at shutdown; the pool children read it
    keeper: Keeper | None = None  # the leases (lease.py), ticking in a thread
    consumer: object = None  # Celery's consumer, to stop consuming the shared queue


MAIN = MainProcess()


@signals.celeryd_init.connect
def _start_on_standby(sender, instance, conf, **_):
    """In the main process, before it consumes: listen only on this replica's standby queue."""
    MAIN.name = sender
    MAIN.stopping = multiprocessing.RawValue("b", 0)  # shared memory: pool children see it set
    # An exchange of its own: by default Celery binds a queue to the default exchange, `video`, with the routing
    # key `video`, and a request published through that exchange would be copied into every standby queue.
    standby = STANDBY_PREFIX + sender
    conf.task_queues = [Queue(standby, Exchange(standby), routing_key=standby)]


@signals.worker_shutting_down.connect
def _stopping(**_):
    """In the main process, at SIGTERM/SIGINT: tell a child still loading not to wait for an answer that a
    stopping main process no longer gives (it would hang the warm shutdown until SIGKILL)."""
    if MAIN.stopping is not None:
        MAIN.stopping.value = 1


class LeaseStep(bootsteps.StartStopStep):
    """In the main process: heartbeat, lease renewal and the dead-holder sweep (see lease.py). A thread, not
    a timer on the event loop: a warm shutdown stops the loop while the running request finishes, and that
    request's lease must stay alive until it has."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c):
        keeper = MAIN.keeper or Keeper(c.hostname, SETTINGS.redis_url, SETTINGS.lease_s)
        keeper.qos = c.task_consumer.channel.qos  # kombu's requeue; a new one after each broker reconnect
        MAIN.consumer = c
        if MAIN.keeper is None:
            MAIN.keeper = keeper
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
            if self.task.acks_late and self.task.reject_on_worker_lost and MAIN.keeper is not None:
                # Instead of Celery's reject. If Redis is down, Celery's reject fails too, and the lease sweep
                # requeues it within two ticks.
                try:
                    MAIN.keeper.lost(self)
                except redis.RedisError as err:
                    log.warning("cannot requeue %s now: %s", self.id, err)
                else:
                    # Requeued: settle the message in this process only. Celery's reject would restore it by its
                    # delivery tag, which a redelivery keeps, putting back a second copy (docs/reliability.md).
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
    if MAIN.consumer is not None:
        log.warning("replica %s stops taking requests until its pool child has reloaded the model: %s",
                    MAIN.name, why)
        MAIN.consumer.cancel_task_queue(SETTINGS.queue)


@signals.task_received.connect
def _record_holder(request, **_):
    """In the main process, as a message arrives: record that this replica holds it."""
    if MAIN.keeper is not None:
        MAIN.keeper.hold(request.message.delivery_tag)


@signals.worker_process_init.connect
def _load_then_consume(**_):
    """In the pool child: load the model, publish what this replica serves, then open the shared queue."""
    name = MAIN.name  # inherited from the main process at fork
    started = time.time()
    pipeline = PipelineHolder(SETTINGS.model, model_cache=SETTINGS.model_cache, threads=SETTINGS.threads,
                              vae_tiling=SETTINGS.vae_tiling, attention=SETTINGS.attention, compile=SETTINGS.compile,
                              deterministic=SETTINGS.deterministic)
    try:
        pipeline.load()
        store = open_store(SETTINGS.store, SETTINGS.output_dir, SETTINGS.redis_url, SETTINGS.store_ttl_s,
                           SETTINGS.redis_outage_s)
    except Exception:
        # A replica that cannot load its model must not serve: stop the whole worker so that its
        # supervisor sees the failure, instead of the pool restarting this child in a loop.
        log.exception("replica %s cannot load model %r; stopping", name, SETTINGS.model)
        os.kill(os.getppid(), signal.SIGQUIT)
        os._exit(1)
    fences = FenceKeeper(SETTINGS.redis_url, SETTINGS.lease_s)
    me = child.PoolChild(pipeline, store, outage_tolerant(SETTINGS.redis_url, SETTINGS.redis_outage_s), fences)
    child.become(me)
    threading.Thread(target=fences.run, name="replicadp-fence", daemon=True).start()
    info = ReplicaInfo(name=name, model=SETTINGS.model, device=describe_device(pipeline.device),
                       size_multiple=pipeline.size_multiple, accepts_image=pipeline.accepts_image,
                       attention=SETTINGS.attention, compile=SETTINGS.compile, deterministic=SETTINGS.deterministic,
                       pid=os.getpid(), load_s=round(time.time() - started, 3), loaded_at=time.time())
    log.info("replica %s loaded %r on %s in %.1f s", name, SETTINGS.model, info["device"], info["load_s"])
    # Publish what this replica serves, then ask the main process, which answers control commands from its
    # event loop (it may not run yet), to consume the shared queue. Redis may be down or restarting: wait it
    # out, on a fresh connection each time: Celery logs and drops an exception raised here, and the replica
    # would never consume.
    while not MAIN.stopping.value:
        with app.connection_for_write() as conn:
            try:
                me.redis.set(REPLICA_KEY + name, json.dumps(info))
                if app.control.add_consumer(SETTINGS.queue, destination=[name], reply=True, timeout=1.0,
                                            connection=conn):
                    break
            except conn.connection_errors + conn.channel_errors + (OperationalError, OSError) as exc:
                log.warning("replica %s: cannot reach Redis to start consuming (%r); retrying", name, exc)
                time.sleep(1.0)


app.steps["consumer"].add(LeaseStep)

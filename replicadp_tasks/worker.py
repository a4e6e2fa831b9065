"""A replica's life cycle: load the pipeline in the pool child, then start taking requests.

The main process would reserve a request as soon as it starts consuming, while its child is still
loading the model, and the request would wait beside an idle, ready replica. So a replica starts on a
private standby queue, and the child, once its model is resident, asks its own main process to consume its
model's queue (MODEL_QUEUE: contract/models.py). When the child dies (killed, or past the hard time limit), the main
process stops consuming that queue before it lets go of the request, and the replacement child
opens it again once it has reloaded the model: meanwhile the request runs on a replica that is ready.
Whether it consumes it, the main process tells producers through its heartbeat (cluster/heartbeat.py).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import redis
from billiard.exceptions import WorkerLostError
from celery import bootsteps, signals
from celery.utils.log import get_multiprocessing_logger
from celery.worker import state as worker_state
from celery.worker.request import Request
from kombu import Exchange, Queue
from kombu.exceptions import OperationalError
from kombu.transport import virtual

from . import logs, webhooks
from .app import app
from .broker import transport
from .cluster import connection, preempt
from .cluster.connection import outage_tolerant
from .cluster.heartbeat import Heartbeat, Running
from .contract.keys import REPLICA_KEY, REQUEST_ID_RE, STANDBY_PREFIX
from .contract.models import queue_for
from .contract.scheduling import Priority
from .contract.records import ReplicaInfo
from .model import open_pipeline
from .model.devices import describe_device
from .outputs.store import open_store, sweep_forever
from .replica import child
from .replica.fences import FenceKeeper
from .replica.finisher import Finisher
from .replica.leases import Keeper
from .replica.outcomes import Exit, Finishing, Parked, Preempted, exit_process
from .replica.preemption import Preemptor
from .replica.reporter import Reporter
from .settings import SETTINGS

log = logging.getLogger("replicadp")
# The queue this replica takes requests from: its model's.
MODEL_QUEUE = queue_for(SETTINGS.queue, SETTINGS.served_model_name)


@dataclass
class MainProcess:
    """A replica's main process: it holds the messages (Celery's consumer), renews the leases and restarts the
    pool child. The pool child's own state is child.PoolChild."""

    name: str | None = None  # the replica's node name
    stopping: object = None  # a RawValue in shared memory, set at shutdown; the pool children read it
    load_failed: object = None  # a RawValue in shared memory, set by a pool child that cannot load its model
    worker: object = None  # Celery's WorkController, whose exitcode the process exits with
    keeper: Keeper | None = None  # the leases (replica/leases.py), ticking in a thread
    consumer: object = None  # Celery's consumer, to stop consuming its model's queue
    heartbeat: Heartbeat | None = None  # whether it serves (cluster/heartbeat.py), beating in a thread
    events: redis.Redis | None = None  # queues a failed request's webhook event; inherited by the pool children


MAIN = MainProcess()


@signals.celeryd_init.connect
def _start_on_standby(sender, instance, conf, **_):
    """In the main process, before it consumes: listen only on this replica's standby queue."""
    MAIN.name = transport.HOLDER = sender
    MAIN.worker = instance
    MAIN.stopping = multiprocessing.RawValue("b", 0)  # shared memory: pool children see it set
    MAIN.load_failed = multiprocessing.RawValue("b", 0)  # and the main process sees theirs
    # An exchange of its own: by default Celery binds a queue to the default exchange, `video`, with the routing
    # key `video`, and a request published through that exchange would be copied into every standby queue.
    standby = STANDBY_PREFIX + sender
    conf.task_queues = [Queue(standby, Exchange(standby), routing_key=standby)]


@signals.worker_ready.connect
def _sweep_the_store(**_):
    """In the main process, once: the output store's retention sweep (outputs/store.sweep_forever), in a thread. Redis
    expires its keys itself."""
    if SETTINGS.store_ttl_s and SETTINGS.store != "redis":
        threading.Thread(target=sweep_forever, name="replicadp-sweep", daemon=True, args=(
            open_store(SETTINGS), outage_tolerant(SETTINGS.redis_url, SETTINGS.redis_outage_s), MAIN.name,
            SETTINGS.store_ttl_s)).start()


@signals.worker_shutting_down.connect
def _stopping(how, **_):
    """In the main process, at SIGTERM/SIGINT: tell a child still loading not to wait for an answer that a
    stopping main process no longer gives (it would hang the warm shutdown until SIGKILL); with
    REPLICADP_PREEMPT_ON_SHUTDOWN, have the request it runs stop at its next step and go back to the queue. At the
    SIGQUIT of a pool child that could not load its model: exit with Exit.CONFIG (Celery's cold shutdown exits 0),
    so that the supervisor tells a configuration to fix from a crash to restart (worker_launch.sh stops restarting
    it)."""
    if MAIN.stopping is not None:
        MAIN.stopping.value = 1
    if MAIN.load_failed is not None and MAIN.load_failed.value:
        MAIN.worker.exitcode = Exit.CONFIG
    running = _running() if how == "Warm" and SETTINGS.preempt_on_shutdown else None
    if running is not None:
        # From a thread: this is a signal handler, and the ask is a Redis round trip.
        threading.Thread(target=_preempt_for_shutdown, args=(running["task_id"],), daemon=True).start()


def _preempt_for_shutdown(task_id: str) -> None:
    """Ask that the running request `task_id` be preempted (cluster/preempt.py); if Redis cannot be reached, the
    warm shutdown waits for the request as it would without."""
    try:
        preempt.ask(connection.client(SETTINGS.redis_url, socket_timeout=2, socket_connect_timeout=2), task_id)
    except redis.RedisError as exc:
        log.warning("stopping: cannot preempt request %s (%s); it runs to its end first", task_id, exc)
        return
    log.info("stopping: request %s stops at its next step and goes back to the queue, to go on from there",
             task_id)


def _consuming() -> bool:
    """Whether this replica takes requests from its model's queue now: not once it is stopping, nor while its
    consumer is being rebuilt (a broker reconnect). Read from the heartbeat's thread: lookups only."""
    tasks = getattr(MAIN.consumer, "task_consumer", None)
    return not MAIN.stopping.value and tasks is not None and tasks.consuming_from(MODEL_QUEUE)


def _running() -> Running | None:
    """The request the pool child runs, if any (one: concurrency 1)."""
    # A copy: the event loop changes the set meanwhile (set.copy runs no Python code, so it is not interrupted).
    started = [req for req in worker_state.active_requests.copy() if req.time_start]
    if not started:
        return None
    priority = (started[0].kwargs or {}).get("priority")
    return Running(task_id=started[0].id, started_at=started[0].time_start,
                   priority=priority if priority in list(Priority) else Priority.NORMAL)


@signals.worker_ready.connect
def _beat(**_):
    """In the main process, once its consumer runs: the heartbeat that tells producers whether it serves."""
    MAIN.heartbeat = Heartbeat(MAIN.name, SETTINGS.redis_url, SETTINGS.replica_stale_s, _consuming, _running,
                               (SETTINGS.served_model_name, *SETTINGS.models), SETTINGS.queue).start()
    if SETTINGS.preempt_after_s is not None:
        preemptor = Preemptor(MAIN.name, SETTINGS.redis_url, SETTINGS.served_model_name, MODEL_QUEUE,
                              SETTINGS.preempt_after_s, SETTINGS.max_preemptions, SETTINGS.replica_stale_s)
        threading.Thread(target=preemptor.run, name="replicadp-preemption", daemon=True).start()


@signals.worker_shutdown.connect
def _leave(**_):
    """In the main process, at the end of a shutdown: out of the heartbeats now, not once its beat is stale."""
    if MAIN.heartbeat is not None:
        MAIN.heartbeat.leave()


@signals.celeryd_init.connect
def _json_from_the_start(sender, instance, **_):
    """In the main process, before Celery sets up logging. In JSON: no start-up banner, which is text (`celery
    inspect stats` and `replicadp status` report the same); the warnings raised until then (SecurityWarning, as
    root) as JSON lines; and no shutdown notices ("worker: Warm shutdown"), which Celery's signal handlers write
    raw to sys.__stdout__, not through logging (a signal handler must not take the logging locks)."""
    if SETTINGS.log_format == logs.LogFormat.JSON:
        instance.quiet = True
        logging.captureWarnings(True)
        early = logging.StreamHandler()
        logs.configure([early], SETTINGS.log_format, logs.Role.REPLICA, sender)
        logging.getLogger().addHandler(early)  # until Celery replaces the root's handlers with its own
        sys.__stdout__ = open(os.devnull, "w")


@signals.after_setup_logger.connect
def _log_lines(logger, **_):
    """In the main process, once Celery has set up logging (a pool child inherits it at fork): every line
    (Celery's, billiard's, ours, stdout and stderr redirected) in REPLICADP_LOG_FORMAT, naming this replica."""
    logs.configure([*logger.handlers, *get_multiprocessing_logger().handlers], SETTINGS.log_format,
                   logs.Role.REPLICA, MAIN.name)


@signals.after_setup_task_logger.connect
def _task_log_lines(logger, **_):
    """Celery's task logger, which does not propagate: the same, and in text its format names the request
    (celeryconfig's worker_task_log_format)."""
    logs.configure(logger.handlers, SETTINGS.log_format, logs.Role.REPLICA, MAIN.name)


@signals.task_prerun.connect
def _request_started(task_id, kwargs=None, **_):
    """In the pool child: the lines it logs until the request ends name it, by the caller's request_id if it
    is a valid one (as replica/delivery.py names the request), else its task id."""
    asked = (kwargs or {}).get("request_id")
    logs.request_started(task_id, asked if isinstance(asked, str) and REQUEST_ID_RE.fullmatch(asked) else task_id)


@signals.task_postrun.connect
def _request_ended(**_):
    logs.request_ended()


@signals.celeryd_init.connect
def _webhook_events(**_):
    """In the main process, before the pool forks: the Redis client that queues failures' webhook events, in
    the main process and (inherited: redis-py reconnects after a fork) in every pool child. It rides out an
    outage as the pool child's own client, which queues the other events, does (up to REPLICADP_REDIS_OUTAGE)."""
    MAIN.events = outage_tolerant(SETTINGS.redis_url, SETTINGS.redis_outage_s)


@signals.worker_ready.connect
def _send_webhooks(**_):
    """In the main process, once: the webhook senders (replicadp_tasks/webhooks/), threads that POST the events its pool
    child and the other replicas' queue: the pool child never waits on a receiver."""
    if webhooks.available():
        webhooks.Sender(SETTINGS.redis_url, SETTINGS.webhook_secret, SETTINGS.fetch_allow,
                        SETTINGS.webhook_claim_s).start()
    elif SETTINGS.webhooks:
        log.info("webhooks are off: REPLICADP_WEBHOOK_SECRET is not set; requests naming one are refused")


@signals.task_failure.connect
def _tell_failure(sender=None, task_id=None, exception=None, kwargs=None, **_):
    """A request failed for good: queue its webhook's `failed` event. Celery sends task_failure in the pool child
    for what the task raised (invalid input, cancelled, poison, the soft time limit, a pipeline error) and in the
    main process for the hard time limit; never for a request that it requeues (its pool child was lost)."""
    if getattr(sender, "name", None) == "replicadp.generate" and MAIN.events is not None:
        webhooks.emit_failure(MAIN.events, kwargs or {}, task_id, MAIN.name, exception)


class LeaseStep(bootsteps.StartStopStep):
    """In the main process: heartbeat, lease renewal and the dead-holder sweep (see replica/leases.py). A thread, not
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
    head of the queue (Celery's own requeue would put it at the back, behind requests sent after it). A request
    whose delivery was parked (outcomes.Parked: another delivery computes its request_id) leaves its message in
    Redis, parked on that request's fence (leases.Keeper.park), and frees the replica. So does a request whose
    frames are computed and whose pool child finishes it (outcomes.Finishing), but its message stays this
    replica's (leases.Keeper.finishing) until the child acknowledges it. A preempted request (outcomes.Preempted)
    goes back to the head of its priority list at once."""

    def _settle_here(self) -> None:
        """Settle the message in this process only, leaving Redis as it is: Celery's ack would remove it from
        kombu's `unacked`, its reject restore it by its delivery tag, which a redelivery keeps."""
        virtual.QoS.ack(self.message.channel.qos, self.message.delivery_tag)
        self.acknowledged = True

    def on_failure(self, exc_info, send_failed_event=True, return_ok=False):
        exc = getattr(exc_info.exception, "exc", exc_info.exception)  # unwrap ExceptionWithTraceback
        if isinstance(exc, Finishing) and MAIN.keeper is not None:
            worker_state.task_ready(self)
            MAIN.keeper.finishing(self)  # held, as a running request is, until the pool child acknowledges it
            self._settle_here()
        elif isinstance(exc, Parked) and MAIN.keeper is not None:
            worker_state.task_ready(self)  # first: the lease thread renews the holders of the requests it lists
            try:
                MAIN.keeper.park(self)
            except redis.RedisError as err:  # still recorded as this replica's: the sweep requeues it when back
                log.warning("cannot park %s now: %s", self.id, err)
            self._settle_here()
        elif isinstance(exc, Preempted) and MAIN.keeper is not None:
            worker_state.task_ready(self)
            try:
                MAIN.keeper.requeue(self.message.delivery_tag, MAIN.keeper.name, "preempted")
            except redis.RedisError as err:  # still recorded as this replica's: the sweep requeues it when back
                log.warning("cannot requeue %s now: %s", self.id, err)
            self._settle_here()
        elif isinstance(exc, WorkerLostError):
            _pause("its pool child was lost")
            if self.task.acks_late and self.task.reject_on_worker_lost and MAIN.keeper is not None:
                # Instead of Celery's reject. If Redis is down, Celery's reject fails too, and the lease sweep
                # requeues it within two ticks.
                try:
                    MAIN.keeper.lost(self)
                except redis.RedisError as err:
                    log.warning("cannot requeue %s now: %s", self.id, err)
                else:
                    # Requeued: Celery's reject would put back a second copy (docs/reliability.md).
                    self._settle_here()
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def on_timeout(self, soft, timeout):
        if not soft:  # the pool kills the child next
            _pause("its pool child passed the hard time limit")
        return super().on_timeout(soft, timeout)


def _pause(why: str) -> None:
    """In the main process: stop consuming its model's queue, before the lost request frees its prefetch slot
    (else this replica would take a request, maybe that very one, and hold it through the reload)."""
    if MAIN.consumer is not None:
        log.warning("replica %s stops taking requests until its pool child has reloaded the model: %s",
                    MAIN.name, why)
        MAIN.consumer.cancel_task_queue(MODEL_QUEUE)


@signals.worker_process_shutdown.connect
def _end_followers(**_):
    """In a pool child that ends normally (a warm shutdown, a recycle): answer the request its finisher holds, if
    any (else its message would wait for a sweep to go back to the queue, and be computed again); then end its
    follower ranks and remove their rendezvous file (model/parallel.py), instead of leaving them to PDEATHSIG and the
    file to the next group's sweep."""
    try:
        me = child.current()
    except RuntimeError:  # it never loaded
        return
    me.finisher.drain()
    if me.pipeline.followers is not None:
        me.pipeline.followers.close()


def _end_attempt(why: str) -> None:
    """A follower of this multi-process replica died (model/parallel.py): end this pool child as a killed one ends, so
    that its request is requeued and the pool's next child rebuilds the group."""
    exit_process(Exit.GROUP_LOST, f"replica {MAIN.name}: {why}")


@signals.worker_process_init.connect
def _load_then_consume(**_):
    """In the pool child: load the model, publish what this replica serves, then open its model's queue."""
    name, started = MAIN.name, time.time()  # the name: inherited from the main process at fork
    # 1. The model and the output store. A replica that cannot load them must not serve: it stops the whole worker,
    #    so that its supervisor sees the failure, instead of the pool restarting this child in a loop.
    try:
        pipeline = open_pipeline(SETTINGS.model_options(), on_group_lost=_end_attempt)
        pipeline.load()
        store = open_store(SETTINGS)
    except Exception:
        log.exception("replica %s cannot load model %r; stopping (exit status %d: a configuration to fix)", name,
                      SETTINGS.model, Exit.CONFIG)
        MAIN.load_failed.value = 1
        os.kill(os.getppid(), signal.SIGQUIT)
        os._exit(Exit.CONFIG)
    # 2. The pool child's state, and its threads: the fence keeper, the reporter, the finisher.
    child.become(_pool_child(name, pipeline, store))
    # 3. Publish what it serves, then consume its model's queue.
    info = _replica_info(name, pipeline, started)
    log.info("replica %s loaded %r on %s in %.1f s", name, SETTINGS.model, info["device"], info["load_s"])
    _publish_then_consume(name, info)


def _pool_child(name: str, pipeline, store) -> child.PoolChild:
    """The pool child's state, its threads started."""
    fences, reporter = FenceKeeper(SETTINGS.redis_url, SETTINGS.lease_s), Reporter(app.backend)
    # Below the pipeline's priority where it computes off the CPU (a GPU; the synthetic backend, which stands in
    # for one); a CPU pipeline's next request is the same kind of work as the encode, and no more urgent.
    finisher = Finisher(app, name, SETTINGS.finisher_nice if pipeline.device != "cpu" else 0,
                        SETTINGS.finisher_wait_ms / 1000)
    for thread_name, run in (("fence", fences.run), ("reporter", reporter.run), ("finisher", finisher.run)):
        threading.Thread(target=run, name=f"replicadp-{thread_name}", daemon=True).start()
    return child.PoolChild(pipeline, store, outage_tolerant(SETTINGS.redis_url, SETTINGS.redis_outage_s), fences,
                           reporter, finisher)


def _replica_info(name: str, pipeline, started: float) -> ReplicaInfo:
    """What this replica serves, as producers read it."""
    accepts, options = pipeline.accepts, pipeline.options
    return ReplicaInfo(name=name, model=SETTINGS.served_model_name, checkpoint=options.spec,
                       device=describe_device(pipeline.device),
                       size_multiple=accepts.size_multiple, accepts_image=bool(accepts.takes_image),
                       requires_image=accepts.requires_image, experts=accepts.experts, attention=options.attention,
                       compile=options.compile, deterministic=options.deterministic, qualities=list(accepts.qualities),
                       cache=str(options.cache), quantize=options.quantize, offload=options.offload,
                       parallel=str(options.layout), loras=[a.info() for a in pipeline.adapters],
                       fused=[a.info() for a in pipeline.fused],
                       recipe=None if pipeline.recipe is None else pipeline.recipe.to_wire(), pid=os.getpid(),
                       load_s=round(time.time() - started, 3), loaded_at=time.time())


def _publish_then_consume(name: str, info: ReplicaInfo) -> None:
    """Publish what this replica serves, then ask the main process, which answers control commands from its event
    loop (it may not run yet), to consume its model's queue (which its heartbeat has declared). Redis may be down or restarting: wait it out, on a
    fresh connection each time: Celery logs and drops an exception raised here, and the replica would never
    consume."""
    while not MAIN.stopping.value:
        with app.connection_for_write() as conn:
            try:
                child.current().redis.set(REPLICA_KEY + name, json.dumps(info))
                if app.control.add_consumer(MODEL_QUEUE, destination=[name], reply=True, timeout=1.0,
                                            connection=conn):
                    break
            except conn.connection_errors + conn.channel_errors + (OperationalError, OSError) as exc:
                log.warning("replica %s: cannot reach Redis to start consuming (%r); retrying", name, exc)
                time.sleep(1.0)


app.steps["consumer"].add(LeaseStep)

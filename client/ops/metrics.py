"""`replicadp metrics`: a Prometheus endpoint with what Flower's /metrics lacks.

Read from Redis on each scrape, for each model the deployment serves (label `model`): its queue's depth, at each
priority, how long its next request has waited, and how many requests its replicas run (their heartbeats): what an
autoscaler scales each model's replicas on (waiting + running: deploy/kubernetes/). Kept from
Celery's event stream (task events are on, celeryconfig.py): each replica's busy/idle state (its heartbeat
carries how many requests it runs), requests completed and failed per replica, and histograms of latency
(sent to succeeded) and queue wait (sent to started). Counters and histograms start at zero with the exporter
and count what it saw, as Prometheus counters do; a request sent before the exporter started is counted when
it ends but has no sending time to measure from. Times are the senders' clocks: keep hosts on NTP.
"""

from __future__ import annotations

import logging
import time

import redis
from kombu.exceptions import OperationalError
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from replicadp_tasks import app
from replicadp_tasks.cluster import connection, heartbeat
from replicadp_tasks.contract import keys
from replicadp_tasks.settings import SETTINGS

from ..api import redis_url, replica_info
from .status import models, queue_head, waited_s

log = logging.getLogger("replicadp.metrics")

# Seconds. A tiny test request is ~0.1 s, Wan2.2-TI2V-5B at 832x480x33x30 ~14 s on an A800 (vllm-omni's figure),
# the largest allowed request tens of minutes.
LATENCY_BUCKETS = (0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800)
WAIT_BUCKETS = (0.01, 0.05, 0.25, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
RECONNECT_S = 2.0  # pause before reconnecting the event stream (Redis restarting)


class Exporter:
    """Counters and histograms fed by task events; gauges computed when scraped."""

    def __init__(self, registry: CollectorRegistry):
        self.state = app.events.State()
        self.completed = Counter("replicadp_requests_completed", "Requests that succeeded, by replica",
                                 ["replica"], registry=registry)
        self.failed = Counter("replicadp_requests_failed", "Requests that failed, by replica",
                              ["replica"], registry=registry)
        self.latency = Histogram("replicadp_request_latency_seconds", "Sent to succeeded, seconds",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_wait = Histogram("replicadp_queue_wait_seconds", "Sent to started on a replica, seconds",
                                    buckets=WAIT_BUCKETS, registry=registry)
        self.redis = connection.client(redis_url(), socket_connect_timeout=5, socket_timeout=5)
        registry.register(self)

    def on_event(self, event: dict) -> None:
        self.state.event(event)
        kind = event["type"]
        if kind == "task-succeeded":
            self.completed.labels(event["hostname"]).inc()
        elif kind == "task-failed":
            self.failed.labels(event["hostname"]).inc()
        task = self.state.tasks.get(event["uuid"]) if kind.startswith("task-") else None
        if task is None or task.sent is None:
            return
        # The producer sends task-sent after the request itself, so a replica's started (even succeeded) event
        # can arrive first (seen with short requests): time each pair when its second event arrives.
        if kind in ("task-sent", "task-started") and task.started:
            self.queue_wait.observe(max(0.0, task.started - task.sent))
        if kind in ("task-sent", "task-succeeded") and task.succeeded:
            self.latency.observe(max(0.0, task.succeeded - task.sent))

    def collect(self):
        """Called on each scrape."""
        up = GaugeMetricFamily("replicadp_redis_up", "1 if Redis answered this scrape")
        try:
            served = models(self.redis)
            heads = {model: queue_head(self.redis, model) for model in served}
            running = running_by_model(self.redis, served)
            stats, dead = self.redis.hgetall(keys.STATS_KEY), self.redis.llen(keys.DEAD_KEY)
        except redis.exceptions.RedisError as exc:
            log.warning("scrape: Redis: %s", exc)
            up.add_metric([], 0)
            yield up
        else:
            up.add_metric([], 1)
            yield up
            yield from self.queues(heads, time.time())
            yield self.running(running)
            # Kept in Redis by the replicas, so these count since the data began, not since this exporter did.
            yield CounterMetricFamily("replicadp_messages_refused", "Messages on the queue that replicas refused "
                                      "(not a request they serve; see replicadp:dead)",
                                      value=int(stats.get(b"refused_messages", 0)))
            yield CounterMetricFamily("replicadp_duplicate_executions", "Requests computed to the end a second "
                                      "time (0 unless fencing failed)", value=int(stats.get(b"duplicate_executions", 0)))
            yield CounterMetricFamily("replicadp_webhook_give_ups", "Webhook events given up: every attempt "
                                      "failed, or a final answer (4xx, 3xx, an address not allowed)",
                                      value=int(stats.get(b"webhook_give_ups", 0)))
            yield CounterMetricFamily("replicadp_webhook_progress_dropped", "Webhook progress events dropped: "
                                      "their one attempt failed, or past a request's cap on queued events",
                                      value=int(stats.get(b"webhook_progress_dropped", 0)))
            yield GaugeMetricFamily("replicadp_dead_letters", "Records in replicadp:dead: requests failed as poison "
                                    "and refused messages, the most recent 1000", value=dead)
        busy = GaugeMetricFamily("replicadp_replica_busy", "1 while the replica runs a request, 0 idle",
                                 labels=["replica"])
        # Under the state's lock: the event thread adds workers while a scrape reads them.
        live = self.state.freeze_while(lambda: [(w.hostname, w.active) for w in self.state.workers.values() if w.alive])
        for hostname, active in live:
            busy.add_metric([hostname], 1 if active else 0)
        yield busy

    @staticmethod
    def queues(heads: dict, now: float):
        """The gauges of each model's queue, from {model: queue_head(model)}."""
        depth = GaugeMetricFamily("replicadp_queue_depth", f"Requests waiting in a model's queue "
                                  f"({SETTINGS.queue}.<model>)", labels=["model"])
        by_priority = GaugeMetricFamily("replicadp_queue_depth_by_priority", "Requests waiting in a model's queue "
                                        "at each priority", labels=["model", "priority"])
        next_age = GaugeMetricFamily("replicadp_queue_next_age_seconds", "How long the request a model's replica "
                                     "takes next has waited (0: its queue is empty)", labels=["model"])
        # Its old name: the next request is not the oldest (fair queuing puts other users' newer ones first).
        oldest = GaugeMetricFamily("replicadp_queue_oldest_age_seconds", "Deprecated, not the oldest: "
                                   "replicadp_queue_next_age_seconds under its old name", labels=["model"])
        for model, (depths, head) in heads.items():
            depth.add_metric([model], sum(depths.values()))
            for priority, n in depths.items():
                by_priority.add_metric([model, str(priority)], n)
            waited = waited_s(head, now)
            for family in (next_age, oldest):
                family.add_metric([model], float("nan") if waited is None else waited)
        yield from (depth, by_priority, next_age, oldest)

    @staticmethod
    def running(counts: dict[str, int]) -> GaugeMetricFamily:
        family = GaugeMetricFamily("replicadp_requests_running", "Requests a model's live replicas run now (their "
                                   "heartbeats)", labels=["model"])
        for model, n in counts.items():
            family.add_metric([model], n)
        return family

    def receive_forever(self) -> None:
        """Consume the event stream; reconnect when Redis goes away."""
        while True:
            try:
                with app.connection_for_read() as conn:
                    receiver = app.events.Receiver(conn, handlers={"*": self.on_event})
                    # wakeup: every replica sends a heartbeat now, so busy/idle is known before the first one is due.
                    receiver.capture(limit=None, timeout=None, wakeup=True)
            except (OSError, OperationalError, redis.exceptions.RedisError) as exc:
                log.warning("event stream lost (%s); reconnecting in %.0f s", exc, RECONNECT_S)
                time.sleep(RECONNECT_S)


def running_by_model(client, served: list[str]) -> dict[str, int]:
    """How many requests each model in `served` has running: one per live replica of it whose heartbeat names a
    request (cluster/heartbeat.py; a replica's model from its info)."""
    running = heartbeat.read(client, SETTINGS.replica_stale_s).running
    infos = replica_info(client, list(running))
    counts = dict.fromkeys(served, 0)
    for name in running:
        model = infos[name].get("model")
        if model in counts:
            counts[model] += 1
    return counts


def serve(host: str, port: int) -> None:
    """Serve /metrics on host:port and consume events until the process is stopped."""
    registry = CollectorRegistry()
    exporter = Exporter(registry)
    start_http_server(port, addr=host, registry=registry)
    exporter.receive_forever()

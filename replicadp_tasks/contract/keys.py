"""The Redis key schema: every key replicadp reads or writes, who writes it, and the fence's token.

Imported by replicas, the producer API, the HTTP gateway and the operations tools alike; it imports nothing, so
that learning a key name starts no Celery machinery. docs/architecture.md draws who writes which.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A request_id becomes a file name and a Redis key: a conservative alphabet, no separators, bounded.
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")

# --- written by the replica's pool child ------------------------------------------------------------------
REPLICA_KEY = "replicadp:replica:"  # + replica name: JSON ReplicaInfo, what it serves (after its model loaded)
COMPLETED_KEY = "replicadp:completed"  # sorted set, request_id -> completion time, the last hour (throughput)
# + ":" + model name: the same, of one model's requests (its videos/min)
ATTEMPTS_KEY = "replicadp:attempts:"  # + task id: how many times a delivery of it has started
CHECKPOINT_KEY = "replicadp:checkpoint:"  # + request_id: hash of a preempted request's state (input_key, step, data)
PREEMPTIONS_KEY = "replicadp:preemptions:"  # + task id: how many times it was preempted
FENCE_KEY = "replicadp:lock:"  # + request_id: the FenceToken of the delivery computing it (cluster/fence.py)
STORE_KEY = "replicadp:store:"  # + request_id + ".mp4" / ".json": the video and its Result (REPLICADP_STORE=redis)

# --- written by a replica's main process, by `up` and by any process that REPLICADP_MODELS names models for ---
MODELS_KEY = "replicadp:models"  # hash, model name -> JSON cluster.fleet.Declared: the models the deployment serves

# --- written by the replica's main process ----------------------------------------------------------------
ALIVE_KEY = "replicadp:alive:"  # + replica name: the lease heartbeat (replica/leases.py), expires a lease after its last renewal
# Who serves (heartbeat.py): sorted sets, replica name -> Redis's time of its last beat (every second), in
# SERVING_KEY while it consumes its model's queue, in STANDBY_KEY while it does not (its pool child loading)
SERVING_KEY = "replicadp:serving"
STANDBY_KEY = "replicadp:standby"
RUNNING_KEY = "replicadp:running"  # hash, replica name -> JSON heartbeat.Running: the request its pool child runs
HOLDERS_KEY = "replicadp:holders"  # hash, delivery tag -> replica name holding that message, or PARKED + fence key
PARKED = "parked:"  # + fence key: a holder that is no replica, a message waiting for that fence (lease.Keeper.park)
STANDBY_PREFIX = "replicadp.standby."  # + replica name: the private queue a replica starts on (worker.py)
SWEEP_KEY = "replicadp:store-sweep"  # replica name, expiring: the one replica that sweeps the output store now

# --- written by both: refused messages by the main process, poison requests and duplicates by the pool child
DEAD_KEY = "replicadp:dead"  # list of JSON records of requests failed as poison or refused, newest first
STATS_KEY = "replicadp:stats"  # hash of counters: refused_messages, duplicate_executions, webhook_give_ups,
# webhook_progress_dropped
# Webhook events (webhooks.py), queued by the pool child (a failure's by the main process too), sent by the main
# processes' senders:
WEBHOOK_SENT_KEY = "replicadp:webhook:sent:"  # + task id: hash of the ids of the events queued for it, once each
WEBHOOK_DUE_KEY = "replicadp:webhook:due"  # sorted set, event id -> when it is due (Redis's clock); a sender that
# takes one makes it due again REPLICADP_WEBHOOK_CLAIM later, so that another takes it if this one dies sending
WEBHOOK_EVENTS_KEY = "replicadp:webhook:events"  # hash, event id -> JSON webhooks.Queued (URL, payload, tenant)
WEBHOOK_ATTEMPTS_KEY = "replicadp:webhook:attempts"  # hash, event id -> attempts taken so far (counted when taken)
WEBHOOK_SENDING_KEY = "replicadp:webhook:sending:"  # + destination host:port: sorted set, event id -> claim end
WEBHOOK_BACKOFF_KEY = "replicadp:webhook:backoff"  # sorted set, destination -> until when it is not tried
WEBHOOK_FAILS_KEY = "replicadp:webhook:fails"  # hash, destination -> failed attempts in a row (its backoff)

# --- written by kombu (the broker side of Celery), read by the lease sweep --------------------------------
UNACKED_KEY = "unacked"  # hash, delivery tag -> message delivered and not yet acknowledged
UNACKED_INDEX_KEY = "unacked_index"  # sorted set of the same tags, scored by delivery time
# Celery's result backend: `celery-task-meta-<task id>`, a Result or Progress (records.py) under its state.

# --- written by producers ---------------------------------------------------------------------------------
CANCEL_KEY = "replicadp:cancel:"  # + task id: set by client.api.cancel_request, read by the replica (lease.FenceKeeper)
CANCEL_CHANNEL = "replicadp:cancels"  # pub/sub: the task id of each cancel or preemption, as it is set (FenceKeeper)
PREEMPT_KEY = "replicadp:preempt:"  # + task id: the step from which to preempt it (client.api.preempt_request)
REPLICATED_KEY = "replicadp:replicated"  # a counter: written before a WAIT and by each new connection (connection.py)
# The queue's lists are kombu's, one per priority (scheduling.queue_lists); each has its fairness state here:
FAIR_KEY = "replicadp:fair:"  # + list name: hash, user -> last fair tag, and ~hwm (scheduling.place)

# --- written by the HTTP gateways (shared by all of them) -------------------------------------------------
JOBS_KEY = "replicadp:http:jobs"  # sorted set: job id -> creation time; + ":" + API key owner: that key's jobs
JOB_KEY = "replicadp:http:job:"  # + job id: the job's request as created (JSON), kept REPLICADP_RESULT_TTL
POSTER_KEY = "replicadp:http:poster:"  # + job id: its video's first frame, a small JPEG (made on first ask)
ADMITTING_KEY = "replicadp:http:admitting:"  # + queue: sorted set, task id -> admission time (client/http)

# --- written by `replicadp health` ------------------------------------------------------------------------
SEEN_KEY = "replicadp:health:"  # + replica name: {"task", "step", "since"}, the progress last seen


def completed_key(model: str) -> str:
    """COMPLETED_KEY of one model's requests."""
    return f"{COMPLETED_KEY}:{model}"


def fence_key(request_id: str) -> str:
    return FENCE_KEY + request_id


@dataclass(frozen=True)
class FenceToken:
    """Who computes a request: one pool child running one delivery. The pool child takes the fence with it and
    renews it; its main process renews and releases the same fence from its own view of the request (replica/leases.py).
    Both build it here: a token that differed by a character would silently stop the main process's renewal."""

    replica: str
    pid: int
    task_id: str

    def __str__(self) -> str:
        return f"{self.replica}:{self.pid}:{self.task_id}"

    @classmethod
    def parse(cls, text: str) -> "FenceToken":
        replica, pid, task_id = text.rsplit(":", 2)
        return cls(replica, int(pid), task_id)

"""kombu's Redis transport, with three additions on request queues.

Producers: a request is placed by its priority, tenant and user (placement.py), not pushed at the end of one list.

Replicas: every message popped is checked (message.py) before Celery reads it. A refused message is consumed
here: recorded as dead with its reason, counted, and failed under its task id when it has one, so that its
client gets an answer; the replica's main process goes on. The check sits on the BRPOP reply (redis-py's
response callback of the channel's client), the one place that holds the raw bytes of every message the worker
consumes; a refusal reads as an empty poll to kombu. And a message popped whose delivery record cannot be
written is kept to be put back (QoS), not lost; one whose acknowledgement Redis refuses still frees its prefetch
slot (QoS), so that the consumer goes on. In a replica, the record of a delivery names its holder too (replica/leases.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque

import redis
from celery import current_app
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

from ..cluster import connection, replication
from ..contract import scheduling
from ..contract.errors import InvalidRequest, MessageRefused
from ..contract.keys import DEAD_KEY, HOLDERS_KEY, STANDBY_PREFIX, STATS_KEY
from ..settings import SETTINGS
from . import message, placement

log = logging.getLogger("replicadp")

# A request not held by a Redis replica after this long of putting it again is not accepted (NotReplicated):
# its producer is told, within Celery's publish retries, rather than blocked for a whole outage.
PUBLISH_GIVE_UP_S = 10.0
DEAD_KEEP = 1000  # records kept: the reasons of recent failures, bounded however much garbage arrives
RAW_KEEP_CHARS = 500  # of a refused message, in its record: enough to recognise it

# (payload, exchange, routing key) of the messages this process took off a queue and could not record as
# delivered (QoS.append), oldest first, until put_back_orphans puts them back.
ORPHANS: deque[tuple[dict, str, str]] = deque()
# In a replica's main process, its name: QoS.append records it as the holder of each message it delivers
# (replica/leases.py), in the transaction that records the delivery.
HOLDER: str | None = None


def record_dead(client, record: dict) -> None:
    """Add a dead-letter record (a request failed as poison, or a message refused), newest first."""
    pipe = client.pipeline()
    pipe.lpush(DEAD_KEY, json.dumps({**record, "at": time.time()}, default=repr))
    pipe.ltrim(DEAD_KEY, 0, DEAD_KEEP - 1)
    pipe.execute()


def refuse(raw: bytes, exc: MessageRefused, queue: str) -> None:
    """Record, count and answer a refused message, in the replica's main process, through its Celery app's result
    backend (the app that consumes with this transport: Celery's current one)."""
    log.error("refused a message on queue %r (task id %r): %s", queue, exc.task_id, exc)
    try:
        backend = current_app.backend
        client = backend.client
        record_dead(client, {"task_id": exc.task_id, "reason": f"refused: {exc}", "queue": queue,
                             "raw": raw[:RAW_KEEP_CHARS].decode("utf-8", "replace")})
        client.hincrby(STATS_KEY, "refused_messages", 1)
        if exc.task_id is not None:
            backend.mark_as_failure(exc.task_id, exc)
    except Exception:  # Redis just went away: the message is gone either way, and this process must go on
        log.exception("cannot record the refused message (task id %r)", exc.task_id)


def serves(queue: str) -> bool:
    """Whether `queue` carries requests (a model's queue, `<REPLICADP_QUEUE>.<model>`, or a replica's standby
    queue; else: a control reply a client waits for, which is not checked)."""
    return queue == SETTINGS.queue or queue.startswith((f"{SETTINGS.queue}.", STANDBY_PREFIX))


class QoS(kombu_redis.QoS):
    """kombu's, without losing a message between its BRPOP and its delivery record, nor the consumer after an
    acknowledgement that failed. The BRPOP takes the message off the queue and the record (`unacked`, from which
    kombu and the sweep restore it) is a second write: when Redis dies or fails over between the two, the message
    is in Redis nowhere, and the failed write dropped it from this process too (docs/reliability.md, "Redis
    failover"). Here it is kept in ORPHANS, and the replica's lease thread puts it back at the head of its queue
    once Redis answers."""

    def append(self, message, delivery_tag):
        try:
            if HOLDER is None:
                super().append(message, delivery_tag)
                return
            # kombu's append, and the holder: one round trip, before the request is handed to the pool child.
            info = message.delivery_info
            with self.pipe_or_acquire() as pipe:
                pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()})
                pipe.hset(self.unacked_key, delivery_tag, dumps([message._raw, info["exchange"], info["routing_key"]]))
                pipe.hset(HOLDERS_KEY, delivery_tag, HOLDER)
                pipe.execute()
            virtual.QoS.append(self, message, delivery_tag)
        except (redis.ConnectionError, redis.TimeoutError):
            info = message.delivery_info
            ORPHANS.append((message._raw, info["exchange"], info["routing_key"]))
            log.warning("request %s: taken off the queue as Redis failed, and recorded nowhere: kept here to be put "
                        "back", message.headers.get("id"))
            raise

    def ack(self, delivery_tag):
        try:
            super().ack(delivery_tag)
        except (redis.ConnectionError, redis.TimeoutError):
            # The record stays in Redis (the sweep requeues the message, whose redelivery returns the stored
            # result), but the message is settled in this process: unsettled, it held the replica's one prefetch
            # slot, and the consumer polled no more until its connection broke (a stopped primary that resumed
            # refusing writes holds it until Sentinel demotes it: docs/reliability.md).
            virtual.QoS.ack(self, delivery_tag)
            raise


def put_back_orphans(channel, client) -> None:
    """Put the ORPHANS back at the head of their queues (kombu's restore, through `channel`'s bindings) with
    `client`; one that no Redis replica acknowledges stays for the next call (made again, a second copy is one
    more delivery of its task id, which the fence runs once)."""
    while ORPHANS:
        payload, exchange, routing_key = ORPHANS[0]
        channel._do_restore_message(payload, exchange, routing_key, client)
        what = f"request {payload['headers'].get('id')} put back"
        if not replication.replicated(client, SETTINGS.durability.replicas, SETTINGS.durability.ack_timeout_ms,
                                        what):
            return
        ORPHANS.popleft()
        log.warning("%s at the head of its queue", what)


class Channel(kombu_redis.Channel):
    QoS = QoS

    def _put(self, queue, message, **kwargs):
        """Publish: a request goes where its priority, tenant and user put it (REPLICADP_SCHEDULING=fifo: at the
        end of one list); other messages (control replies) as kombu does. Raises InvalidRequest, in the producer,
        for a priority, tenant or user a replica would refuse."""
        if not serves(queue):
            return super()._put(queue, message, **kwargs)
        headers, props = message["headers"], message["properties"]
        if props.get("priority"):
            raise InvalidRequest.of("priority", "Celery's apply_async priority option is not read; give the "
                                                "request's priority field (interactive, normal, batch)",
                                    value=props["priority"])
        priority = scheduling.check_priority(headers.get("replicadp_priority"))
        tenant = scheduling.check_tenant(headers.get(placement.TENANT_HEADER))
        user = scheduling.check_user(headers.get("replicadp_user"))
        if SETTINGS.scheduling == scheduling.Scheduling.FIFO:
            put = super()._put
            return self._durably(lambda: put(queue, message, **kwargs), headers.get("id"))
        # Placed one at a time (kombu's publish batches only LPUSH): each place reads the list as it is now.
        kwargs.pop("_publish_batch", None)
        # A copy: kombu hands the same message to every queue bound to the exchange. The tenant, user-order and
        # order headers last, in that order: after them come only the properties, so each is the message's last
        # occurrence of its key (the script reads and rewrites them there). kombu restores a requeued request to
        # the list of its properties' priority.
        lane = {} if tenant is None else {placement.TENANT_HEADER: tenant}
        lane |= {placement.USER_ORDER_HEADER: placement.USER_ORDER_PLACEHOLDER,
                 placement.ORDER_HEADER: placement.ORDER_PLACEHOLDER}
        rest = {k: v for k, v in headers.items() if k not in lane}
        placed = {**message, "headers": {**rest, **lane}, "properties": {**props, "priority": priority.level}}

        def place():
            with self.conn_or_acquire() as client:
                placement.place(client, self._q_for_pri(queue, priority.level), dumps(placed), tenant, user)
        self._durably(place, headers.get("id"))

    def _durably(self, put, task_id) -> None:
        """A request its producer is told is queued survives a failover: put again until the replicas hold it (a
        second copy, after a slow acknowledgement, is one more delivery of one task id, which the fence runs once)."""
        with self.conn_or_acquire() as client:
            replication.durable(client, put, f"request {task_id} queued", SETTINGS.durability, PUBLISH_GIVE_UP_S)

    def _create_client(self, asynchronous=False):
        client = super()._create_client(asynchronous)
        if asynchronous:  # the client that BRPOPs
            client.set_response_callback("BRPOP", self._checked)
        return client

    def _checked(self, reply):
        """redis-py's BRPOP callback: (queue key, message) if the message may go on to Celery, else None."""
        if not reply:
            return None
        key, raw = reply
        queue = key.decode().rsplit(self.sep, 1)[0]  # a priority level's list is `<queue><sep><level>`
        if serves(queue):
            try:
                message.check(raw)
            except MessageRefused as exc:
                refuse(raw, exc, queue)
                return None
        return tuple(reply)


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """Channel, on the master that Sentinel names; a connection to a server that stopped being the master is
    dropped (connection.MasterConnection) and the next goes to the new one."""

    connection_class = connection.MasterConnection


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


# kombu takes the transport from a URL's scheme again when it moves on to the next URL of a list (`a;b`, which a
# Sentinel URL is: at the first failover a producer would move to kombu's own Sentinel transport), so in
# replicadp's processes the schemes name these transports too, not only Celery's broker_transport.
TRANSPORT_ALIASES.update(redis=f"{__name__}:Transport", rediss=f"{__name__}:Transport",
                         sentinel=f"{__name__}:SentinelTransport")


def transport_for(url: str) -> str | None:
    """Celery's broker_transport for `url`: these for redis://, rediss:// and sentinel://; kombu's own for the
    others, which go unchecked."""
    scheme = url.partition("://")[0]
    if scheme == connection.SENTINEL_SCHEME:
        return f"{__name__}:SentinelTransport"
    return f"{__name__}:Transport" if scheme in ("redis", "rediss") else None

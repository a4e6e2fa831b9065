"""The order in which replicas take requests: by priority, then round robin across tenants, then across users
within a tenant, FIFO within a user.

A request's `priority` picks one of kombu's priority lists of the queue (`video`, `video\\x06\\x163`, ...); a
replica's BRPOP names them in order, so it takes from the first one that is not empty, and a requeued request
goes back to the head of its own list (kombu's restore reads the level from the message). Within one list the
producer's transport (`place`) puts each message where two-level start-time fair queuing says, one unit per
request. A tenant (the API key's owner, `tenant`; requests without one are the unnamed tenant) gets a slot at

    tag = max(V, the tenant's previous tag + 1)

where V is the tag of the request at the head of the list (or, for an empty list, the highest tag given out);
the slots of one tenant then hold its requests in the order of their user tags, the same rule one level down
(V: the user tag of the tenant's first waiting request). So tenants alternate whatever number of users each
names, users alternate within a tenant, ties keep their arrival order, and without tenants it is round robin
across users as before. docs/scheduling.md says how the script keeps that order, what it costs, why online
traffic is not reordered by cost, and what round robin costs a big batch.
"""

from __future__ import annotations

import hashlib

from redis.exceptions import NoScriptError

from ..cluster.scripts import lua
from ..contract.keys import FAIR_KEY
from ..contract.scheduling import Priority, queue_lists

# The headers `place` fills: the slot's tenant tag (which orders the list) and the request's user tag (which
# orders the tenant's requests among its slots). The producer sends these texts in their place.
ORDER_HEADER = "replicadp_order"
USER_ORDER_HEADER = "replicadp_user_order"
TENANT_HEADER = "replicadp_tenant"
ORDER_PLACEHOLDER = "@@replicadp-order@@"
USER_ORDER_PLACEHOLDER = "@@replicadp-user-order@@"
ORDER_SLOT = f'"{ORDER_PLACEHOLDER}"'  # as JSON
USER_ORDER_SLOT = f'"{USER_ORDER_PLACEHOLDER}"'
PRUNE_ABOVE = 1000  # fields in one list's state: past this, tenants and users that would gain nothing are dropped
PLACE = lua(__package__, "place")
PLACE_SHA = hashlib.sha1(PLACE.encode()).hexdigest()
QUEUE_ORDER = lua(__package__, "queue_order")


def tenant_key(tenant: str | None) -> str:
    return "-" if tenant is None else tenant  # a tenant id starts with a letter or digit: never "-"


def user_field(user: str | None) -> str:
    return "-" if user is None else "u:" + user


def place(client, list_key: str, raw: str, tenant: str | None, user: str | None) -> tuple[int, int, int, int]:
    """Put the message `raw` (whose user-order and order headers hold USER_ORDER_SLOT and ORDER_SLOT, in that
    order, as their last occurrences) into `list_key` by its tenant's and user's fair tags. Returns (the tenant
    tag of its slot, its user tag, how many requests of the list go before it, how many of its tenant's requests
    it moved one slot later)."""
    order = raw.rindex(ORDER_SLOT)
    user_order = raw.rindex(USER_ORDER_SLOT, 0, order)
    args = (2, list_key, FAIR_KEY + list_key, tenant_key(tenant), user_field(user), raw[:user_order],
            raw[user_order + len(USER_ORDER_SLOT):order], raw[order + len(ORDER_SLOT):], PRUNE_ABOVE)
    try:
        placed = client.evalsha(PLACE_SHA, *args)
    except NoScriptError:  # the first time on this server (or after a SCRIPT FLUSH or a restart)
        placed = client.eval(PLACE, *args)
    return tuple(placed)


def next_request(client, queue: str) -> tuple[dict[Priority, int], bytes | None]:
    """How many requests wait in `queue` at each priority, and the raw message a replica takes next."""
    pipe = client.pipeline()
    for key in queue_lists(queue):
        pipe.llen(key)
        pipe.lindex(key, -1)
    replies = pipe.execute()
    heads = [raw for raw in replies[1::2] if raw is not None]
    return dict(zip(Priority, replies[::2])), heads[0] if heads else None


def queue_order_call(queue: str, first: int) -> tuple:
    """The arguments of an EVAL of QUEUE_ORDER over `queue`'s lists, reading the first `first` messages of each:
    `client.eval(*queue_order_call(...))`, with a client of either kind (the gateway's is async)."""
    lists = queue_lists(queue)
    return (QUEUE_ORDER, len(lists), *lists, first)


def queue_order(reply) -> list[tuple[Priority, int, list[str]]]:
    """QUEUE_ORDER's reply: per priority, in the order replicas take them, its list's length and the task ids of
    its first messages, the next one first (an id is empty for a message that is not a request)."""
    return [(level, length, [task_id.decode() for task_id in ids])
            for level, length, ids in zip(Priority, reply[::2], reply[1::2])]


def waiting(client, queue: str, first: int) -> list[tuple[Priority, str]]:
    """The task ids and priorities of the requests in `queue` that its replicas take next, in that order: the
    first `first` of each priority's list (an id is empty for a message that is not a request)."""
    return [(level, task_id) for level, _, ids in queue_order(client.eval(*queue_order_call(queue, first)))
            for task_id in ids]

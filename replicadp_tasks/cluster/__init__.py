"""Redis, and who is alive: clients of the one Redis URL that follow a Sentinel failover (connection.py), writes
that a failover keeps (replication.py), the fence that lets one delivery compute a request (fence.py), each
replica's heartbeat (heartbeat.py), the models the deployment serves (fleet.py), the ask that a running request be
preempted (preempt.py), and the Lua scripts' loader (scripts.py)."""

from . import connection, fleet, heartbeat, preempt, replication
from .connection import CONNECT_TIMEOUT_S, REPLY_TIMEOUT_S, client, outage_tolerant, redacted
from .replication import NotReplicated, durable
from .scripts import lua

__all__ = ["CONNECT_TIMEOUT_S", "REPLY_TIMEOUT_S", "NotReplicated", "client", "connection", "durable", "fleet",
           "heartbeat", "lua", "outage_tolerant", "preempt", "redacted", "replication"]

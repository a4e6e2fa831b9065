"""Celery's Redis result backends, with two changes.

One round trip per state written. Celery's own reads a task's result before each write of it, and leaves it if it
is SUCCESS (a lost duplicate must not overwrite a result), then writes and publishes it: two round trips for each
of a request's records (STARTED, each PROGRESS, the result). Here one script does the three, atomically: the same
rule, and no write can slip in between the read and the write.

An answer (a SUCCESS, FAILURE or REVOKED state) is kept across a Redis failover: written until replicas hold it
(replication.durable), as the message is acknowledged after it, on another connection, which may already reach
the new primary while this one wrote to the old. Progress and STARTED are written again soon and not waited for.

Sentinel: connections that leave a server that stopped being the master. Celery's own drops a connection on
READONLY only, so a result or progress write on a connection kept from before a failover reached the resumed old
master, which refused it (NOREPLICAS), and failed the request; here the write goes to the new master instead.

connection.celery_backend_url names these classes (Celery's `module:Class+url`).
"""

from celery import states
from celery.backends.base import BackendStoreError
from celery.backends.redis import RedisBackend as CeleryRedisBackend
from celery.backends.redis import SentinelBackend as CelerySentinelBackend
from kombu.utils.encoding import bytes_to_str

from ..cluster import replication
from ..cluster.connection import MasterConnection
from ..cluster.scripts import lua
from ..settings import SETTINGS

STORE = lua(__package__, "store_result")


class RedisBackend(CeleryRedisBackend):
    _script = None  # STORE, sent by its hash (EVALSHA) once the server has it

    def _store_result(self, task_id, result, state, traceback=None, request=None, **kwargs):
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)
        value = self.encode(meta)
        if isinstance(value, str) and len(value) > self._MAX_STR_VALUE_SIZE:
            raise BackendStoreError("value too large for Redis backend", state=state, task_id=task_id)
        expires = self.failure_expires if state == states.FAILURE else self.expires
        args = (self.get_key_for_task(task_id), value, int(expires or 0))
        if state in states.READY_STATES:
            replication.durable(self.client, lambda: self.ensure(self._store, args), f"request {task_id}'s {state}",
                                SETTINGS.durability)
        else:
            self.ensure(self._store, args)
        return result

    def _store(self, key, value, expires: int) -> None:
        if self._script is None:
            self._script = self.client.register_script(STORE)
        self._script(keys=[key], args=[value, expires, states.SUCCESS], client=self.client)


class SentinelBackend(RedisBackend, CelerySentinelBackend):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.connparams.setdefault("connection_class", MasterConnection)  # TLS (rediss) sets a class of its own

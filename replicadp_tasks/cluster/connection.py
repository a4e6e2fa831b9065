"""Redis clients for every part of replicadp, from the one Redis URL (settings.redis_url).

Two kinds of URL:

- `redis://`, `rediss://`, `unix://`: one server, or a managed endpoint (ElastiCache, Memorystore, Azure Cache)
  that fails over behind one name. Clients reconnect to it.
- Sentinel, in Celery's form with the master's name as a query parameter:
  `sentinel://:PASSWORD@host1:26379/0;sentinel://:PASSWORD@host2:26379/0?master_name=NAME`. PASSWORD is the
  master's (as in Celery); a Sentinel that asks for a password of its own gets `sentinel_password=...` in the
  query. Clients ask the Sentinels for the master at every new connection, and drop a connection to a server
  that is no longer the master (READONLY, NOREPLICAS), so a failover reads as a short outage.

Replication is asynchronous: a write the old master acknowledged can be missing on the new one; replication.py
makes the writes a guarantee rests on until replicas hold them.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis import asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from redis.asyncio import sentinel as async_sentinel
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelManagedConnection
from redis.utils import str_if_bytes

from ..contract.errors import RedisURLError
from ..contract.keys import REPLICATED_KEY

SENTINEL_SCHEME = "sentinel"
SENTINEL_PORT = 26379
# Our query parameters on a Sentinel URL; Celery is given the URL without them (celery_url).
MASTER_PARAM, SENTINEL_PASSWORD_PARAM = "master_name", "sentinel_password"
SENTINEL_TIMEOUT_S = 2.0  # a Sentinel that does not answer in this is skipped for the next one
# A server that has not answered a command in this long is taken for gone (a paused VM, a long fork, a partition:
# a stopped process whose connections stay open), and the connection is made again, through Sentinel to the master
# it names now. A live server answers in milliseconds, one stalled behind an fsync in well under a second.
REPLY_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
# An error from a server that is no longer the master (it refuses writes without its replicas): a stale
# connection across a failover, to drop like READONLY.
NOREPLICAS = "NOREPLICAS"


@dataclass(frozen=True)
class Target:
    """What a Redis URL names. `sentinels` is empty for a single server (`url` then is the URL as given)."""

    url: str
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str | None = None
    password: str | None = None
    username: str | None = None
    db: int = 0
    sentinel_password: str | None = None

    @property
    def is_sentinel(self) -> bool:
        return bool(self.sentinels)


def redacted(url: str) -> str:
    """A Redis URL without its passwords, for messages and logs (each part of a Sentinel URL, and its query)."""
    parts = []
    for chunk in url.split(";"):
        split = urlsplit(chunk)
        netloc, query = split.netloc, split.query
        userinfo, at, host = netloc.rpartition("@")
        if at and ":" in userinfo:  # by text: a URL with a bad port is shown too (in the error that names it)
            netloc = f"{userinfo.partition(':')[0]}:***@{host}"
        if SENTINEL_PASSWORD_PARAM in query:
            hidden = [(k, "***" if k == SENTINEL_PASSWORD_PARAM else v) for k, v in parse_qsl(query)]
            query = urlencode(hidden, safe="*")
        parts.append(urlunsplit(split._replace(netloc=netloc, query=query)))
    return ";".join(parts)


def parse(url: str) -> Target:
    """The Target of `url`; raises RedisURLError for a Sentinel URL that names no master or has a bad port."""
    chunks = [c for c in url.split(";") if c.strip()]
    if not chunks or urlsplit(chunks[0]).scheme != SENTINEL_SCHEME:
        return Target(url)
    sentinels, query = [], {}
    first = urlsplit(chunks[0])
    for chunk in chunks:
        split = urlsplit(chunk.strip())
        if split.scheme != SENTINEL_SCHEME:
            raise RedisURLError(f"REDIS_URL={redacted(url)!r}: every part of a Sentinel URL starts with "
                                f"sentinel://, not {chunk.split('://')[0]!r}://")
        try:
            sentinels.append((split.hostname or "127.0.0.1", split.port or SENTINEL_PORT))
        except ValueError as exc:
            raise RedisURLError(f"REDIS_URL={redacted(url)!r}: {exc}") from None
        query |= dict(parse_qsl(split.query))
    if not query.get(MASTER_PARAM):
        raise RedisURLError(f"REDIS_URL={redacted(url)!r}: a Sentinel URL names its master: add "
                            f"?{MASTER_PARAM}=NAME (the name in the Sentinels' `sentinel monitor NAME ...`)")
    unknown = set(query) - {MASTER_PARAM, SENTINEL_PASSWORD_PARAM}
    if unknown:
        raise RedisURLError(f"REDIS_URL={redacted(url)!r}: unknown query parameter(s) {sorted(unknown)}; a "
                            f"Sentinel URL takes {MASTER_PARAM} and {SENTINEL_PASSWORD_PARAM}")
    path = first.path.strip("/")
    if path and not path.isdigit():
        raise RedisURLError(f"REDIS_URL={redacted(url)!r}: the database is a number, not {path!r}")
    return Target(url, tuple(sentinels), query[MASTER_PARAM], first.password or None, first.username or None,
                  int(path or 0), query.get(SENTINEL_PASSWORD_PARAM) or None)


def celery_url(url: str) -> str:
    """The URL Celery and kombu are given: a Sentinel URL without our query parameters (they go in
    celery_options), any other as it is."""
    if not parse(url).is_sentinel:
        return url
    return ";".join(urlunsplit(urlsplit(c.strip())._replace(query="")) for c in url.split(";") if c.strip())


def celery_backend_url(url: str) -> str:
    """Celery's result_backend for `url`: backend.RedisBackend, or for Sentinel backend.SentinelBackend (Celery's
    `module:Class+url`)."""
    if parse(url).is_sentinel:
        return f"replicadp_tasks.broker.backend:SentinelBackend+{celery_url(url)}"
    if urlsplit(url).scheme in ("redis", "rediss"):
        return f"replicadp_tasks.broker.backend:RedisBackend+{url}"
    return url


CELERY_OPTIONS = ("master_name", "sentinel_kwargs")  # the transport options celery_options gives


def celery_options(url: str) -> dict:
    """Transport options for the broker and the result backend: for Sentinel, the master's name and the
    Sentinels' password and timeouts."""
    target = parse(url)
    if not target.is_sentinel:
        return {}
    return dict(zip(CELERY_OPTIONS, (target.master, _sentinel_kwargs(target))))


def _sentinel_kwargs(target: Target) -> dict:
    kwargs = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S}
    if target.sentinel_password:
        kwargs["password"] = target.sentinel_password
    return kwargs


# What makes a Sentinel's answer unusable: down, or it does not monitor a master of that name.
_NO_ANSWER = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError)


def newest_master(sentinels: list[redis.Redis], name: str) -> tuple[str, int] | None:
    """The address of master `name` in the newest configuration (the highest config epoch) among the
    `sentinels` that answer; None while one of them is promoting a replica it does not name yet, or when none
    answers. What every connection to the master asks (MasterConnection), and what a guaranteed write checks
    after its WAIT (replication.py).

    Not redis-py's discover_master, which takes the first Sentinel that calls the master up, and its
    SENTINEL MASTERS address: the Sentinel leading a failover takes the new epoch once the replica it promotes
    reports itself master and gives clients that replica's address from then on (GET-MASTER-ADDR-BY-NAME), but
    keeps the old master's address in SENTINEL MASTER(S) until every other replica follows the new one (up to
    the failover timeout). Before that epoch, from the start of the failover, no Sentinel names the replica yet,
    and a write the old master takes then (resumed early) and one of its replicas acknowledges is lost when that
    replica follows the new master."""
    answers = []
    for sentinel in sentinels:
        try:
            answers.append(_asking(sentinel, name).execute())
        except _NO_ANSWER:
            continue
    return _learnt(sentinels, name, _newest(answers))


async def async_newest_master(sentinels: list[aioredis.Redis], name: str) -> tuple[str, int] | None:
    """newest_master for redis.asyncio's Sentinels."""
    answers = []
    for sentinel in sentinels:
        try:
            answers.append(await _asking(sentinel, name).execute())
        except _NO_ANSWER:
            continue
    return _learnt(sentinels, name, _newest(answers))


# The master each Sentinel-monitored service was last found at by this process: when one connection finds a new
# master, every other connection to the old one is dropped before its next command (MasterConnection), instead of
# each waiting out REPLY_TIMEOUT_S on a master that stopped answering. The last answer, not the highest epoch: a
# deployment made again on the same Sentinel addresses starts its epochs anew, and a late, older answer costs a
# reconnect, which asks again.
_known: dict[tuple, tuple[str, int]] = {}


def _service(sentinels: list, name: str) -> tuple:
    return name, frozenset((s.connection_pool.connection_kwargs.get("host"),
                            s.connection_pool.connection_kwargs.get("port")) for s in sentinels)


def _learnt(sentinels: list, name: str, address: tuple[str, int] | None) -> tuple[str, int] | None:
    if address is not None:
        _known[_service(sentinels, name)] = address
    return address


def known_master(sentinels: list, name: str) -> tuple[str, int] | None:
    """The master this process last found for service `name` of `sentinels` (newest_master); None before any."""
    return _known.get(_service(sentinels, name))


def _asking(sentinel, name: str):
    """One round trip to a Sentinel (a pipeline, sync or async as `sentinel`): master `name`'s state, then the
    address it gives clients, at least as new as that state's epoch."""
    ask = sentinel.pipeline(transaction=False)
    ask.sentinel_master(name)
    ask.sentinel_get_master_addr_by_name(name)
    return ask


def _newest(answers: list[tuple[dict, tuple | None]]) -> tuple[str, int] | None:
    newest = None
    for state, address in answers:
        if address is None:
            continue
        address = (str_if_bytes(address[0]), int(address[1]))
        promoting = "failover_in_progress" in state["flags"].split(",")  # a str in RESP2, redis-py's default
        if promoting and address == (str(state["ip"]), int(state["port"])):
            return None
        if newest is None or state["config-epoch"] > newest[0]:
            newest = (state["config-epoch"], address)
    return newest and newest[1]


def _not_found(name: str, sentinels: list) -> MasterNotFoundError:
    return MasterNotFoundError(f"No master found for {name!r}: none of {len(sentinels)} Sentinel(s) names one "
                               "(unreachable, another master name, or a failover under way)")


class MasterConnection(SentinelManagedConnection):
    """A connection to the master Sentinel names that also drops itself on NOREPLICAS (a server cut off from
    its replicas, a stopped and resumed old master before Sentinel demotes it, refuses writes with it) and, before
    a command, when another connection of the process has found another master (known_master): a frozen master
    keeps its connections open and answers nothing, and each would wait REPLY_TIMEOUT_S to learn it alone. The
    next connection goes to the master Sentinel names now (a ConnectionError, which callers retry). A new
    connection writes once before it is used: to a server that refuses writes (not the master yet, or just
    promoted and not yet followed by a replica), it fails as connecting fails, and the caller's connect retries
    (kombu's publish policy, redis-py's backoff) wait for the master to take writes; a command failing on a
    connection that was made is retried once only by kombu."""

    def on_connect_check_health(self, *args, **kwargs):
        super().on_connect_check_health(*args, **kwargs)
        if self.connection_pool.is_master:
            self.send_command("INCR", REPLICATED_KEY)
            self.read_response()

    def _connect_retry(self):
        if self._sock or not self.connection_pool.is_master:
            return super()._connect_retry()
        self.connect_check_health(check_health=self.connection_pool.check_connection, retry_socket_connect=False)

    def connect_check_health(self, *args, **kwargs):
        # redis-py 8 reconnects a dropped connection here (send_packed_command), not through connect(), so a
        # retried command went back to the old master's address for as long as the retries lasted.
        if not self._sock and self.connection_pool.is_master:
            self.host, self.port = self._master_address()
        return super().connect_check_health(*args, **kwargs)

    def _master_address(self) -> tuple[str, int]:
        """newest_master, recorded in the pool as redis-py's get_master_address records its own: the pool keeps
        only connections to that address, and closes its idle ones when it changes."""
        proxy = self.connection_pool  # redis-py's SentinelConnectionPoolProxy
        address = newest_master(proxy.sentinel_manager.sentinels, proxy.service_name)
        if address is None:
            raise _not_found(proxy.service_name, proxy.sentinel_manager.sentinels)
        if proxy.master_address != address:
            proxy.master_address = address
            pool = proxy.connection_pool_ref()
            if pool is not None:
                pool.disconnect(inuse_connections=False)
        return address

    def send_packed_command(self, *args, **kwargs):
        if self._sock and self.connection_pool.is_master:
            known = known_master(self.connection_pool.sentinel_manager.sentinels, self.connection_pool.service_name)
            if known not in (None, (self.host, self.port)):
                self._drop(f"Sentinel names {known[0]}:{known[1]} the master now")
        return super().send_packed_command(*args, **kwargs)

    def read_response(self, *args, **kwargs):
        try:
            response = super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if self.connection_pool.is_master and _refused(exc):
                self._drop(_REFUSED.format(exc), exc)
            raise
        if self.connection_pool.is_master and isinstance(response, list):  # EXEC's replies come as values
            refused = next((r for r in response if _refused(r)), None)
            if refused is not None:
                self._drop(_REFUSED.format(refused), refused)
        return response

    def _drop(self, why: str, cause: Exception | None = None):
        self.disconnect()
        raise redis.ConnectionError(f"{self.host}:{self.port} left: {why}") from cause


# Why a server that refused a write with NOREPLICAS is left.
_REFUSED = "it refuses writes ({}): not the master any more, or without a replica"


def _refused(reply) -> bool:
    """Whether a reply is the refusal of a server without a replica (min-replicas-to-write)."""
    return isinstance(reply, redis.ResponseError) and str(reply).startswith(NOREPLICAS)


class AsyncMasterConnection(async_sentinel.SentinelManagedConnection):
    """MasterConnection for redis.asyncio (the gateway)."""

    async def on_connect_check_health(self, *args, **kwargs):
        await super().on_connect_check_health(*args, **kwargs)
        if self.connection_pool.is_master:
            await self.send_command("INCR", REPLICATED_KEY)
            await self.read_response()

    async def _connect_retry(self):
        if self._reader or not self.connection_pool.is_master:
            return await super()._connect_retry()
        await self.connect_check_health(check_health=self.connection_pool.check_connection,
                                        retry_socket_connect=False)

    async def connect_check_health(self, *args, **kwargs):
        if not self.is_connected and self.connection_pool.is_master:
            self.host, self.port = await self._master_address()
        return await super().connect_check_health(*args, **kwargs)

    async def _master_address(self) -> tuple[str, int]:
        pool = self.connection_pool
        address = await async_newest_master(pool.sentinel_manager.sentinels, pool.service_name)
        if address is None:
            raise _not_found(pool.service_name, pool.sentinel_manager.sentinels)
        if pool.master_address != address:
            pool.master_address = address
            await pool.disconnect(inuse_connections=False)
        return address

    async def send_packed_command(self, *args, **kwargs):
        if self.is_connected and self.connection_pool.is_master:
            known = known_master(self.connection_pool.sentinel_manager.sentinels, self.connection_pool.service_name)
            if known not in (None, (self.host, self.port)):
                await self._drop(f"Sentinel names {known[0]}:{known[1]} the master now")
        return await super().send_packed_command(*args, **kwargs)

    async def read_response(self, *args, **kwargs):
        try:
            response = await super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if self.connection_pool.is_master and _refused(exc):
                await self._drop(_REFUSED.format(exc), exc)
            raise
        if self.connection_pool.is_master and isinstance(response, list):
            refused = next((r for r in response if _refused(r)), None)
            if refused is not None:
                await self._drop(_REFUSED.format(refused), refused)
        return response

    async def _drop(self, why: str, cause: Exception | None = None):
        await self.disconnect()
        raise redis.ConnectionError(f"{self.host}:{self.port} left: {why}") from cause


def client(url: str, **kwargs) -> redis.Redis:
    """A redis-py client of the Redis `url` names; `kwargs` as for redis.Redis (retry, ...), the timeouts
    REPLY_TIMEOUT_S and CONNECT_TIMEOUT_S unless given."""
    kwargs = {"socket_timeout": REPLY_TIMEOUT_S, "socket_connect_timeout": CONNECT_TIMEOUT_S, **kwargs}
    target = parse(url)
    if not target.is_sentinel:
        return redis.Redis.from_url(url, **kwargs)
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target))
    return sentinel.master_for(target.master, password=target.password, username=target.username, db=target.db,
                               connection_class=MasterConnection, **kwargs)


def async_client(url: str, max_connections: int, **kwargs) -> aioredis.Redis:
    """A redis.asyncio client of `url` with at most `max_connections` connections; a single server's pool makes a
    caller wait for a free connection (`timeout` s), a Sentinel master's fails at once when all are busy. The
    timeouts REPLY_TIMEOUT_S and CONNECT_TIMEOUT_S unless given."""
    kwargs = {"socket_timeout": REPLY_TIMEOUT_S, "socket_connect_timeout": CONNECT_TIMEOUT_S, **kwargs}
    target = parse(url)
    if not target.is_sentinel:
        return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, **kwargs))
    kwargs.pop("timeout", None)
    sentinel = async_sentinel.Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target))
    return sentinel.master_for(target.master, password=target.password, username=target.username, db=target.db,
                               connection_class=AsyncMasterConnection, max_connections=max_connections, **kwargs)


def outage_tolerant(url: str, outage_s: int):
    """A Redis client that rides out a Redis outage of up to about `outage_s` seconds (a restart: ~6 s) by
    retrying, instead of failing the request it is serving."""
    # Retries 1 s apart once the backoff has grown (the first few are quicker); each on a new connection, which asks
    # Sentinel for the master: a frozen one is left REPLY_TIMEOUT_S after it stops answering.
    return client(url, retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), outage_s + 5),
                  retry_on_error=[redis.ConnectionError, redis.TimeoutError])

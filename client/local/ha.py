"""A Redis that fails over, on one host: a primary, two replicas and three Sentinels, all the embedded server's
own binary (Sentinel is a mode of it) on 127.0.0.1 with one generated password. `replicadp up --ha` runs it
detached, each process under a supervisor of its own (embedded.supervise); the tests and the chaos benchmark run
it attached and kill its processes by PID.

Why two replicas where Sentinel needs one: every server refuses writes while no replica follows it
(`min-replicas-to-write 1`), so a stopped primary that resumes after Sentinel promoted another cannot take writes
as a second primary. With one replica, losing the primary would leave the promoted one without a replica, and
every write refused until the old primary came back.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from replicadp_tasks.contract import keys

from .embedded import EmbeddedServer

MASTER_NAME = "replicadp"
REPLICAS, SENTINELS, QUORUM = 2, 3, 2
# Sentinel calls the primary down after this long without an answer: a few missed pings, well under the replicas'
# lease (REPLICADP_LEASE, 6 s), so a failover ends before leases would lapse. The primary is promoted-over within
# about 1-3 s more.
DOWN_AFTER_MS = 1500
FAILOVER_TIMEOUT_MS = 10_000  # how long one Sentinel's failover may take before another tries
# A primary whose replicas all lag more than this (or are gone) refuses writes: a resumed old primary.
MAX_LAG_S = 10


class HAStack:
    """The servers and Sentinels of one stack, in `data_dir` (a folder each)."""

    def __init__(self, data_dir: Path, password: str | None = None):
        self.data_dir = Path(data_dir).resolve()
        self.password = password or secrets.token_urlsafe(24)
        self.nodes = [EmbeddedServer(self.data_dir / f"node{i}", password=self.password)
                      for i in range(1 + REPLICAS)]
        primary = self.nodes[0].port
        replication = (f"masterauth {self.password}", "min-replicas-to-write 1", f"min-replicas-max-lag {MAX_LAG_S}",
                       "repl-diskless-sync-delay 0")
        for i, node in enumerate(self.nodes):
            node.extra = replication + ((f"replicaof 127.0.0.1 {primary}",) if i else ())
        watch = (f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary} {QUORUM}",
                 f"sentinel auth-pass {MASTER_NAME} {self.password}", f"sentinel sentinel-pass {self.password}",
                 f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}",
                 f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}")
        self.sentinels = [EmbeddedServer(self.data_dir / f"sentinel{i}", password=self.password, extra=watch,
                                         sentinel=True) for i in range(SENTINELS)]

    @property
    def url(self) -> str:
        """The Sentinel URL every client of the stack is given (connection.py)."""
        return ";".join(f"sentinel://:{self.password}@127.0.0.1:{s.port}/0" for s in self.sentinels) + \
            f"?master_name={MASTER_NAME}&sentinel_password={self.password}"

    def start(self, detach: bool = False, timeout: float = 30.0) -> str:
        """Start the servers, then the Sentinels, and wait until the primary takes writes and every Sentinel
        knows both replicas and the other Sentinels; returns the URL. `detach` as EmbeddedServer.start."""
        try:
            for server in self.nodes + self.sentinels:
                server.start(detach=detach, timeout=timeout)
            self.wait_settled(timeout)
        except BaseException:
            self.stop()
            raise
        return self.url

    def wait_settled(self, timeout: float) -> None:
        """Wait until the primary takes writes and every Sentinel sees its replicas and the other Sentinels."""
        import redis

        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._settled():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the HA stack did not settle in {timeout:g} s; see the valkey.log files in "
                                   f"{self.data_dir}")
            time.sleep(0.1)

    def _settled(self) -> bool:
        import redis

        host, port = self.master_address()
        master = redis.Redis(host=host, port=port, password=self.password, socket_timeout=2)
        if master.info("replication").get("connected_slaves", 0) < REPLICAS:
            return False
        master.incr(keys.REPLICATED_KEY)  # refused while min-replicas-to-write is not met
        for sentinel in self.sentinels:
            info = self._sentinel(sentinel).sentinel_master(MASTER_NAME)
            if info["num-slaves"] < REPLICAS or info["num-other-sentinels"] < SENTINELS - 1:
                return False
        return True

    def _sentinel(self, sentinel: EmbeddedServer):
        import redis

        return redis.Redis(port=sentinel.port, password=self.password, socket_timeout=2, socket_connect_timeout=2)

    def master_address(self) -> tuple[str, int]:
        """(host, port) of the primary, as the first Sentinel that answers names it."""
        import redis

        for sentinel in self.sentinels:
            try:
                host, port = self._sentinel(sentinel).sentinel_get_master_addr_by_name(MASTER_NAME)
                return host, int(port)
            except (redis.RedisError, TypeError):  # down, or (None) it does not know yet
                continue
        raise RuntimeError("no Sentinel of the HA stack names a primary")

    def primary(self) -> EmbeddedServer:
        """The server that is the primary now."""
        port = self.master_address()[1]
        return next(node for node in self.nodes if node.port == port)

    def server_pid(self, server: EmbeddedServer) -> int:
        """The PID of the server process (not its supervisor's), as the server reports it."""
        import redis

        client = redis.Redis(port=server.port, password=self.password, socket_timeout=2)
        return int(client.info("server")["process_id"])

    def stop(self) -> None:
        for server in self.sentinels + self.nodes:
            server.stop()

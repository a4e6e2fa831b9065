"""The Redis URL (connection.py): a Sentinel URL's parts, what Celery is given, clear errors that name REDIS_URL
and hide the passwords, and the WAIT that a guaranteed write makes, against a real HA stack (client/local/ha.py)."""

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from client.cli import Exit
from client.local.ha import MASTER_NAME, HAStack
from replicadp_tasks.cluster import connection, replication
from replicadp_tasks.contract import RedisURLError

SENTINELS = "sentinel://:m-secret@10.0.0.1:26379/2;sentinel://:m-secret@10.0.0.2/2"
URL = SENTINELS + "?master_name=cache&sentinel_password=s-secret"


def test_a_sentinel_url_names_its_sentinels_master_and_passwords():
    """Each `sentinel://` part is a Sentinel (26379 when no port is given); the master's name and the Sentinels'
    password come from the query, the master's password and database from the URL as in Celery."""
    target = connection.parse(URL)
    assert target.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379))
    assert (target.master, target.password, target.sentinel_password, target.db) == ("cache", "m-secret",
                                                                                       "s-secret", 2)
    assert not connection.parse("redis://:pw@127.0.0.1:6379/0").is_sentinel
    assert connection.celery_url(URL) == SENTINELS
    assert connection.celery_backend_url(URL) == "replicadp_tasks.broker.backend:SentinelBackend+" + SENTINELS
    assert connection.celery_options(URL)["master_name"] == "cache"
    assert connection.celery_options(URL)["sentinel_kwargs"]["password"] == "s-secret"
    assert connection.celery_options("redis://127.0.0.1:6379/0") == {}


@pytest.mark.parametrize("url, says", [
    (SENTINELS, "names its master: add ?master_name=NAME"),
    (SENTINELS + "?master_name=cache&sentinel_pasword=x", "unknown query parameter(s) ['sentinel_pasword']"),
    ("sentinel://:m-secret@h:26379/0;redis://:m-secret@h:6379/0?master_name=c", "starts with sentinel://"),
    ("sentinel://:m-secret@h:26379/zero?master_name=c", "the database is a number, not 'zero'"),
    ("sentinel://:m-secret@h:port/0?master_name=c", "Port could not be cast"),
])
def test_a_bad_sentinel_url_is_refused_naming_redis_url_without_passwords(url, says):
    with pytest.raises(RedisURLError) as refused:
        connection.parse(url)
    assert str(refused.value).startswith("REDIS_URL=") and says in str(refused.value)
    assert "m-secret" not in str(refused.value)


def test_redacted_hides_every_password_of_a_sentinel_url():
    shown = connection.redacted(URL)
    assert "secret" not in shown
    assert shown == ("sentinel://:***@10.0.0.1:26379/2;sentinel://:***@10.0.0.2/2"
                     "?master_name=cache&sentinel_password=***")


def test_a_process_with_a_bad_redis_url_exits_at_start_naming_it():
    """Settings are read once at start: a Sentinel URL without its master stops the process with the message,
    not a traceback from the first connection."""
    run = subprocess.run([sys.executable, "-c", "import replicadp_tasks"], capture_output=True, text=True,
                         env={**os.environ, "REDIS_URL": SENTINELS}, timeout=120)
    assert run.returncode == 1
    assert "replicadp: REDIS_URL=" in run.stderr and "master_name" in run.stderr and "Traceback" not in run.stderr
    assert "m-secret" not in run.stderr


@pytest.fixture(scope="module")
def ha(tmp_path_factory):
    stack = HAStack(tmp_path_factory.mktemp("ha"))
    stack.start()
    yield stack
    stack.stop()


def test_a_misnamed_master_is_a_clear_error(ha):
    """`replicadp status` on the stack's Sentinels with a master name they do not monitor: exit 3 (UNAVAILABLE)
    within seconds, naming the URL (passwords hidden), the missing master, and how to set the URL."""
    wrong = ha.url.replace("master_name=replicadp", "master_name=cache")
    run = subprocess.run([str(os.path.dirname(sys.executable)) + "/replicadp", "status"], capture_output=True,
                         text=True, env={**os.environ, "REDIS_URL": wrong}, timeout=60)
    assert run.returncode == Exit.UNAVAILABLE, run.stdout + run.stderr
    assert "cannot reach Redis at sentinel://:***@127.0.0.1:" in run.stderr
    assert "No master found for 'cache'" in run.stderr and "REDIS_URL" in run.stderr
    assert ha.password not in run.stdout + run.stderr


def test_a_guaranteed_write_waits_for_a_replica_and_says_when_none_has_it(ha, caplog):
    """replicated() returns once a replica holds the writes before it; with both replicas stopped it gives up
    after its timeout, logs that the write is on the master only, and returns False (the write stands)."""
    client = connection.client(ha.url, socket_timeout=5)
    client.set("before-the-wait", 1)
    assert replication.replicated(client, 1, 1000, "a test write")
    replicas = [ha.server_pid(n) for n in ha.nodes if n is not ha.primary()]
    for pid in replicas:
        os.kill(pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, logger="replicadp"):
            assert not replication.replicated(client, 1, 200, "a test write")
    finally:
        for pid in replicas:
            os.kill(pid, signal.SIGCONT)
    assert "a test write: 0 of 1 Redis replica(s) acknowledged it within 200 ms" in caplog.text
    assert replication.replicated(client, 0, 1000, "nothing to wait for")


def test_the_master_checked_after_a_write_is_never_the_old_one_during_a_failover(tmp_path):
    """The master every connection asks for and every guaranteed write checks after its WAIT
    (connection.newest_master) during a failover of a SIGSTOPped primary, sampled every few milliseconds: once
    any Sentinel holds the new configuration epoch it names the promoted replica or nothing (a promotion under
    way), never the old primary, and the new one when the failover has ended. (Had been: the Sentinel leading
    the failover reports the new epoch with the old master's address in SENTINEL MASTER for about 50 ms, and
    that confirmed writes to the resumed old primary; redis-py's discovery reads the same address, up to the end
    of the failover.)"""
    ha = HAStack(tmp_path / "ha")
    ha.start()
    try:
        old = ("127.0.0.1", ha.primary().port)
        pid = ha.server_pid(ha.primary())
        asked = connection.client(ha.url, socket_timeout=2).connection_pool.sentinel_manager.sentinels

        def reported():  # (the newest epoch, whether a failover is under way) as the Sentinels report it
            states = [ha._sentinel(s).sentinel_master(MASTER_NAME) for s in ha.sentinels]
            return max(s["config-epoch"] for s in states), any("failover_in_progress" in s["flags"] for s in states)

        first, _ = reported()
        samples = []  # (a newer epoch was reported before it, what newest_master named)
        os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                epoch, under_way = reported()
                samples.append((epoch > first, connection.newest_master(asked, MASTER_NAME)))
                if epoch > first:  # resumed as soon as a replica is promoted, as test_failover.py does
                    os.kill(pid, signal.SIGCONT)
                    if not under_way and samples[-1][1] not in (None, old):
                        break
                time.sleep(0.005)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert [master for newer, master in samples if newer and master == old] == []
        assert samples[-1][1] == ("127.0.0.1", ha.master_address()[1]) != old
    finally:
        ha.stop()


def test_the_ack_timeout_stays_below_the_reply_timeout(monkeypatch):
    """REPLICADP_REDIS_ACK_TIMEOUT_MS above 4500 (the reply timeout, 5 s, less half a second) stops start-up, naming
    the variable and the value: a WAIT that long would be taken for a frozen server and its connection dropped."""
    from replicadp_tasks.settings import Settings

    monkeypatch.setenv("REPLICADP_REDIS_ACK_TIMEOUT_MS", "4500")
    assert Settings.from_env().durability.ack_timeout_ms == 4500
    monkeypatch.setenv("REPLICADP_REDIS_ACK_TIMEOUT_MS", "5000")
    with pytest.raises(SystemExit, match="REPLICADP_REDIS_ACK_TIMEOUT_MS=5000 is not from 0 to 4500"):
        Settings.from_env()

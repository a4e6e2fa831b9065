"""The Celery app: `celery -A replicadp_tasks worker` finds it here."""

import time
from urllib.parse import parse_qs, urlsplit

from celery import Celery, signals

from .cluster.connection import redacted

app = Celery("replicadp")
app.config_from_object("celeryconfig")


def redis_address(url: str):
    """What names one Redis database in a URL, to compare two: scheme, host, port (default 6379), DB (default 0),
    user and password. Hosts are compared as written, never resolved: localhost and 127.0.0.1 differ. A URL that
    is not one redis:// or rediss:// server (Sentinel, a failover list, a socket) is compared as written, without
    the result backend's class (`module:Class+`)."""
    scheme, sep, rest = url.partition("://")
    url = scheme.split("+", 1)[-1] + sep + rest
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or ";" in url:
        return url
    try:
        port = parts.port or 6379
    except ValueError:  # not a number: Celery refuses it itself
        return url
    db = parts.path.strip("/") or parse_qs(parts.query).get("db", ["0"])[0]
    return (parts.scheme, (parts.hostname or "localhost").lower(), port, db, parts.username or None,
            parts.password or None)


def check_one_redis(conf) -> None:
    """Refuse (SystemExit, naming both URLs with their passwords hidden, and the fix) when Celery's broker or
    result backend, after `-b`, `--result-backend` and the variables Celery lets win over the configuration
    (CELERY_BROKER_URL, CELERY_BROKER_READ_URL / _WRITE_URL, CELERY_RESULT_BACKEND), is not the Redis that
    replicadp configured (REDIS_URL, or use_redis's URL), which the leases, fences, cancels and the output store
    use: requests would silently be sent to or taken from one server and everything else kept on another."""
    ours = conf.first("broker_url")  # as configured: the property reads CELERY_BROKER_URL first
    urls = {"broker": conf.broker_url, "result backend": conf.result_backend}
    for what, given in (("broker for reading", conf.broker_read_url), ("broker for writing", conf.broker_write_url)):
        if given != conf.broker_url:  # by default they are the broker's
            urls[what] = given
    wrong = [(what, given) for what, given in urls.items() if redis_address(given or "") != redis_address(ours)]
    if wrong:
        given = "; ".join(f"Celery's {what} is {redacted(u or '')!r}" for what, u in wrong)
        raise SystemExit(f"replicadp: {given}, but replicadp's Redis (REDIS_URL, else `replicadp up`'s server) is "
                         f"{redacted(ours)!r}. One Redis serves both: set REDIS_URL to it and drop `-b` / "
                         "`--result-backend` / CELERY_BROKER_URL / CELERY_RESULT_BACKEND.")


# SystemExit, not an exception: Celery's signal dispatch logs and swallows exceptions.
@app.on_after_configure.connect
def _one_redis(sender, source, **_):
    """Every process, producer or replica, as soon as its configuration is read, before it connects to anything."""
    check_one_redis(source)


@signals.before_task_publish.connect
def _stamp(sender=None, headers=None, body=None, **_):
    """Refuse to send a request to a split Redis (again: the configuration may have been read in another thread,
    whose SystemExit ended only that thread). Record when a request was sent, so that its result can report how
    long it queued, and its priority, tenant and user, for the transport to place it by (broker/placement.py). Leave its time
    limits to the replica: Celery would otherwise send the producer's own settings, which win over the worker's."""
    if sender == "replicadp.generate" and headers is not None:
        check_one_redis(app.conf)
        headers.setdefault("replicadp_sent_at", time.time())
        headers["timelimit"] = [None, None]
        kwargs = body[1] if isinstance(body, (list, tuple)) and len(body) == 3 and isinstance(body[1], dict) else {}
        for field in ("priority", "tenant", "user"):
            if kwargs.get(field) is not None:
                headers[f"replicadp_{field}"] = kwargs[field]

"""`replicadp flower`: Celery's Flower (`celery -A replicadp_tasks flower`) on 127.0.0.1 behind basic auth.

Flower shows the replicas and the requests from the task events, not the PROGRESS step (`replicadp status
--watch` does). The credentials reach Flower through its FLOWER_BASIC_AUTH variable, never the command line,
which every user of the host can read in `ps`. Flower runs through `main` below, which puts its /metrics behind
the same basic auth as its other pages.
"""

from __future__ import annotations

import os
import secrets
import sys

ENV = "FLOWER_BASIC_AUTH"  # user:password; Flower's own variable, so a compose .env sets it for both
GENERATED_USER = "admin"


class CredentialsError(ValueError):
    pass


def credentials(env: dict) -> tuple[str, bool]:
    """(user:password[,user:password...], generated): from FLOWER_BASIC_AUTH, else a generated password."""
    raw = env.get(ENV, "")
    if not raw:
        return f"{GENERATED_USER}:{secrets.token_urlsafe(18)}", True
    for n, pair in enumerate(raw.split(","), 1):  # Flower splits its multiple-valued options on commas
        user, _, password = pair.partition(":")
        if not user or not password:
            # The value is a secret: name the entry, not its text.
            raise CredentialsError(f"{ENV}: entry {n} is not user:password (entries are comma-separated, so a "
                                   "password cannot hold a comma)")
    return raw, False


def command(address: str, port: int) -> list[str]:
    """`celery -A replicadp_tasks flower` through `main` below, run by this interpreter, so that it imports the
    replicadp_tasks and celeryconfig installed beside it."""
    return [sys.executable, "-m", "client.ops.flower", "-A", "replicadp_tasks", "flower", f"--address={address}",
            f"--port={port}"]


def guard_metrics() -> None:
    """Put Flower's /metrics behind its authentication. Flower 2.2's Metrics handler, unlike every other page
    and API handler of it, lacks tornado's @authenticated, so it never asks for the credentials (its
    get_current_user checks basic auth) and answered anyone: the workers' names and hosts, task names and
    counts. Done on Flower's route table before its app is built; if that table no longer holds the handler,
    refuse to start rather than serve it open."""
    import tornado.web
    from flower import urls
    from flower.views.monitor import Metrics

    class AuthenticatedMetrics(Metrics):
        @tornado.web.authenticated
        async def get(self):
            await super().get()

    routes = [i for i, h in enumerate(urls.handlers) if isinstance(h, tuple) and h[1] is Metrics]
    if not routes:
        raise SystemExit("replicadp flower: Flower's /metrics handler is not where Flower 2.2 has it; not starting "
                         "Flower with /metrics open")
    for i in routes:
        urls.handlers[i] = (urls.handlers[i][0], AuthenticatedMetrics, *urls.handlers[i][2:])


def main() -> None:
    """`celery ARGS`, with Flower's /metrics guarded."""
    from celery.__main__ import main as celery

    guard_metrics()
    sys.argv[0] = "celery"
    celery()


def exec_flower(address: str, port: int, auth: str) -> None:
    """Replace this process with Flower: signals (Ctrl-C, docker stop) reach it directly."""
    sys.stdout.flush()
    os.execve(sys.executable, command(address, port), {**os.environ, ENV: auth})


if __name__ == "__main__":
    main()

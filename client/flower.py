"""`replicadp flower`: Celery's Flower (`celery -A replicadp_tasks flower`) on 127.0.0.1 behind basic auth.

Flower shows the replicas and the requests from the task events, not the PROGRESS step (`replicadp status
--watch` does). The credentials reach Flower through its FLOWER_BASIC_AUTH variable, never the command line,
which every user of the host can read in `ps`.
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
    """Flower run by this interpreter, so it imports the replicadp_tasks and celeryconfig installed beside it."""
    return [sys.executable, "-m", "celery", "-A", "replicadp_tasks", "flower", f"--address={address}",
            f"--port={port}"]


def exec_flower(address: str, port: int, auth: str) -> None:
    """Replace this process with Flower: signals (Ctrl-C, docker stop) reach it directly."""
    sys.stdout.flush()
    os.execve(sys.executable, command(address, port), {**os.environ, ENV: auth})

"""Where a request waits: its priority, tenant and user, as producers and replicas check them, and the queue's
lists (one per priority) they name. How a producer places a request among the waiting ones is
broker/placement.py's."""

from __future__ import annotations

import re
import unicodedata
from enum import StrEnum

from .errors import InvalidRequest

# kombu's Redis transport: a level's list is `<queue><SEP><level>` (level 0 is the queue itself), and BRPOP
# reads the levels in the order of its priority_steps, which celeryconfig sets to LEVELS, one per Priority
# (kombu.transport.redis.Channel's sep, priority_steps and _q_for_pri).
SEP = "\x06\x16"
LEVELS = [0, 3, 6]


class Priority(StrEnum):
    """What a request waits behind: every waiting request of a higher priority. Ordered highest first."""

    INTERACTIVE = "interactive"  # a person is waiting for it
    NORMAL = "normal"  # the default
    BATCH = "batch"  # bulk work that may wait for everything else

    @property
    def level(self) -> int:
        """kombu's priority number for it (on Redis, the lower the sooner)."""
        return LEVELS[list(Priority).index(self)]


class Scheduling(StrEnum):
    """REPLICADP_SCHEDULING, read by producers (where a message is placed decides the order)."""

    FAIR = "fair"  # priorities, then round robin across tenants, then across users within a tenant
    FIFO = "fifo"  # one list in arrival order, priority, tenant and user ignored: the benchmarks' baseline


MAX_USER_CHARS = 256
# Invisible or control characters would make two users look alike (a zero-width space, a bidi override, C1's NEL):
# controls (C0 and C1), format characters, line and paragraph separators, surrogates, unassigned code points.
REFUSED_CATEGORIES = {"Cc": "a control character", "Cf": "an invisible format character",
                      "Zl": "a line separator", "Zp": "a paragraph separator", "Cs": "a surrogate",
                      "Cn": "an unassigned code point"}
# An API key's owner id (client/http/auth.py's names): it names a fairness lane and a webhook secret.
TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_priority(value) -> Priority:
    """A request's `priority` (None: normal); else InvalidRequest naming the field."""
    if value is None:
        return Priority.NORMAL
    try:
        return Priority(value)
    except ValueError:
        raise InvalidRequest.of("priority", f"must be one of {', '.join(Priority)}", value=value) from None


def check_user(value) -> str | None:
    """A request's `user`, who it is for within its tenant (None: the unnamed user); else InvalidRequest naming
    the field and saying why."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest.of("user", f"must be a string, got {type(value).__name__}", value=value)
    if not value or len(value) > MAX_USER_CHARS:
        raise InvalidRequest.of("user", f"must be 1-{MAX_USER_CHARS} characters (leave it out for no user)",
                                value=value)
    for char in value:
        why = REFUSED_CATEGORIES.get(unicodedata.category(char))
        if why:
            raise InvalidRequest.of("user", f"holds U+{ord(char):04X}, {why}: invisible and control characters "
                                            "are refused", value=value)
    return value


def check_tenant(value) -> str | None:
    """A request's `tenant`, the owner id of the API key that sent it (the gateway sets it; None: the unnamed
    tenant); else InvalidRequest naming the field and the value."""
    if value is None:
        return None
    if not (isinstance(value, str) and TENANT_RE.fullmatch(value)):
        raise InvalidRequest.of("tenant", f"must match {TENANT_RE.pattern} (an API key's owner id)", value=value)
    return value


def level_list(queue: str, level: int) -> str:
    return f"{queue}{SEP}{level}" if level else queue


def queue_lists(queue: str) -> list[str]:
    """Every list of `queue`, one per Priority, in the order replicas take from them."""
    return [level_list(queue, level) for level in LEVELS]

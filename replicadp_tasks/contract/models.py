"""Which model a request runs on, and where it waits for it.

A deployment serves one or several models, each under a name (its spec as written: `tiny`, a folder, a hub id; or
an alias, REPLICADP_SERVED_MODEL_NAME). Each model has a queue of its own, `<prefix>.<name>` (the prefix is
REPLICADP_QUEUE), and a replica consumes only its model's: a request for one model never reaches another's
replica. A request names its model (`model`), or takes the deployment's default: the one model it serves, or the
one it names (REPLICADP_DEFAULT_MODEL) among several.
"""

from __future__ import annotations

import re
from typing import Iterable

from .errors import InvalidRequest

# A model's name is a Redis key's and a Celery queue's part, a Prometheus label and a form field: no spaces, no
# commas (REPLICADP_MODELS is a comma-separated list), no control characters; a hub id and a folder are names.
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9_./:@+=-]{1,200}")


def check_model_name(value, field: str = "model") -> str:
    """A model's name as a request or a setting gives it; InvalidRequest naming `field` otherwise."""
    if not isinstance(value, str) or not MODEL_NAME_RE.fullmatch(value):
        raise InvalidRequest.of(field, "is not a model's name (1-200 of letters, digits and _ . / : @ + = -)",
                                value=value)
    return value


def queue_for(prefix: str, model: str) -> str:
    """The queue of `model`'s requests: the one its replicas consume."""
    return f"{prefix}.{model}"


def served_list(known: Iterable[str]) -> str:
    names = sorted(known)
    return ", ".join(names) if names else "none yet (no replica has started, and REPLICADP_MODELS declares none)"


def choose_model(asked, known: Iterable[str], default: str | None) -> str:
    """The model a request runs on: `asked` if it names one the deployment serves (`known`), else `default` (None:
    the only model served). InvalidRequest naming `model` and the served ones otherwise."""
    known = set(known)
    if asked is not None:
        if check_model_name(asked) not in known:
            raise InvalidRequest.of("model", f"not served here; this deployment serves {served_list(known)}",
                                    value=asked)
        return asked
    if default is not None:
        if default not in known:
            raise InvalidRequest.of("model", f"none given, and the default REPLICADP_DEFAULT_MODEL={default!r} is not "
                                             f"served here; this deployment serves {served_list(known)}")
        return default
    if len(known) == 1:
        return next(iter(known))
    why = f"none given, and this deployment serves {served_list(known)}"
    raise InvalidRequest.of("model", f"{why}: name one (or set REPLICADP_DEFAULT_MODEL)" if known else why)


def check_served(asked, served: str) -> None:
    """In a replica: a request may name its model or none (it came through the model's queue). One naming
    another reached this queue by hand (a push, Celery's `queue` option): InvalidRequest naming `model`."""
    if asked is not None and asked != served:
        raise InvalidRequest.of("model", f"this replica serves {served!r}: the request was sent to that model's queue "
                                         "although it names another", value=asked)

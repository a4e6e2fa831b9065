"""The models a deployment serves, as every producer learns them: declared in Redis (keys.MODELS_KEY).

A model is declared by each of its replicas (at every heartbeat, so that a flushed or failed-over Redis learns it
again within a second), by `replicadp up` and `Replicas.start` before its replicas load, and by any process whose
REPLICADP_MODELS names it (a gateway at start, a replica), so that requests for a model whose replicas are all
down, or not started yet, wait in its queue (scale from zero) instead of being refused. A declaration stays until
`replicadp forget-model NAME` takes it back, or the replicas that `up` (`Replicas`) started and declared stop with
none of the model's left.
"""

from __future__ import annotations

import json
import time
from typing import Iterable, TypedDict

import redis

from ..contract.errors import InvalidRequest
from ..contract.keys import MODELS_KEY
from ..contract.models import choose_model, queue_for


RETRY_S = 0.5  # between a producer's reads of the models while Redis does not answer, or declares none


class Declared(TypedDict):
    """One model's declaration."""

    queue: str  # where its requests wait
    by: str  # who declared it first: a replica's name, `up`, a gateway
    declared_at: float


def declaration(model: str, prefix: str, by: str) -> str:
    return json.dumps(Declared(queue=queue_for(prefix, model), by=by, declared_at=time.time()))


def declare(client, models: Iterable[str], prefix: str, by: str) -> list[str]:
    """Declare `models` (each once: a declaration keeps its first author and time); those it declared (the others
    were declared already)."""
    models = list(models)
    pipe = client.pipeline(transaction=False)
    for model in models:
        pipe.hsetnx(MODELS_KEY, model, declaration(model, prefix, by))
    return [model for model, made in zip(models, pipe.execute()) if made]


def parse(raw: dict) -> dict[str, Declared]:
    """HGETALL's answer as model name -> Declared."""
    return {(k.decode() if isinstance(k, bytes) else k): json.loads(v) for k, v in raw.items()}


def declared(client) -> dict[str, Declared]:
    return parse(client.hgetall(MODELS_KEY))


def served(client, here: Iterable[str]) -> set[str]:
    """The models the deployment serves, as a process whose REPLICADP_MODELS is `here` knows them: those declared in
    Redis (a live replica has declared its own), and its own."""
    return set(declared(client)) | set(here)


def forget(client, model: str) -> bool:
    """Take `model`'s declaration back; whether there was one."""
    return bool(client.hdel(MODELS_KEY, model))


class Fleet:
    """A producer's view of the deployment's models: those declared in Redis and `here` (its REPLICADP_MODELS),
    read again once `max_age` seconds old, and at once for a name not known yet (a model declared a moment ago).
    A read that fails keeps what the last one said; the first one is tried for up to `patience_s` (a send rides
    out a Redis restart, celeryconfig's task_publish_retry_policy)."""

    def __init__(self, client, here: Iterable[str], default: str | None, max_age: float = 1.0,
                 patience_s: float = 30.0):
        self.client, self.here, self.default, self.max_age = client, tuple(here), default, max_age
        self.patience_s = patience_s
        self._known: set[str] | None = None
        self._read_at = float("-inf")

    def known(self, fresh: bool = False) -> set[str]:
        if fresh or time.monotonic() - self._read_at > self.max_age:
            deadline = time.monotonic() + (self.patience_s if self._known is None else 0)
            while True:
                try:
                    self._known = served(self.client, self.here)
                    break
                except (redis.ConnectionError, redis.TimeoutError):
                    if time.monotonic() >= deadline:
                        if self._known is None:
                            raise
                        break
                    time.sleep(RETRY_S)
            self._read_at = time.monotonic()
        return self._known

    def choose(self, asked) -> str:
        """The model a request runs on (contract/models.choose_model), read again before a refusal. While the
        deployment declares no model at all (its first replica is starting: it declares its model within a second
        of its start), for up to `patience_s`, as a send waits for Redis itself."""
        try:
            return choose_model(asked, self.known(), self.default)
        except InvalidRequest:
            deadline = time.monotonic() + self.patience_s
            while not self.known(fresh=True) and time.monotonic() < deadline:
                time.sleep(RETRY_S)
            return choose_model(asked, self._known, self.default)

"""The order in which replicas take requests: by priority, then round robin across users, FIFO within a user.

A request's `priority` picks one of kombu's priority lists of the queue (`video`, `video\\x06\\x163`, ...); a
replica's BRPOP names them in order, so it takes from the first one that is not empty, and a requeued request
goes back to the head of its own list (kombu's restore reads the level from the message). Within one list the
producer's transport (`place`) puts each message where start-time fair queuing says, one unit per request:

    tag = max(V, the user's previous tag + 1)

where V is the tag of the request at the head of the list (or, for an empty list, the highest tag given out).
Tags only grow within a user (FIFO), a user who arrives behind another's backlog starts at the head's tag
(so the two alternate), and ties keep their arrival order. With one user, or no user named, that is FIFO.
docs/scheduling.md says why online traffic is not reordered by cost, and what round robin costs a big batch.
"""

from __future__ import annotations

import hashlib
import re
from enum import StrEnum

from redis.exceptions import NoScriptError

from .errors import InvalidRequest
from .keys import FAIR_KEY

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

    FAIR = "fair"  # priorities, then round robin across users
    FIFO = "fifo"  # one list in arrival order, priority and user ignored: the baseline the benchmarks compare with


MAX_USER_CHARS = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_priority(value) -> Priority:
    """A request's `priority` (None: normal); else InvalidRequest naming the field."""
    if value is None:
        return Priority.NORMAL
    try:
        return Priority(value)
    except ValueError:
        raise InvalidRequest.of("priority", f"must be one of {', '.join(Priority)}", value=value) from None


def check_user(value) -> str | None:
    """A request's `user`, who it is for (None: the unnamed user); else InvalidRequest naming the field."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest.of("user", f"must be a string, got {type(value).__name__}", value=value)
    if not value or len(value) > MAX_USER_CHARS or _CONTROL.search(value):
        raise InvalidRequest.of("user", f"must be 1-{MAX_USER_CHARS} characters without control characters "
                                        "(leave it out for no user)", value=value)
    return value


def level_list(queue: str, level: int) -> str:
    return f"{queue}{SEP}{level}" if level else queue


def queue_lists(queue: str) -> list[str]:
    """Every list of `queue`, one per Priority, in the order replicas take from them."""
    return [level_list(queue, level) for level in LEVELS]


# The header `place` fills with the request's tag; the producer sends this text in its place.
ORDER_HEADER = "replicadp_order"
ORDER_PLACEHOLDER = "@@replicadp-order@@"
ORDER_SLOT = f'"{ORDER_PLACEHOLDER}"'  # as JSON
PRUNE_ABOVE = 1000  # users in one list's state: past this, those whose last tag is behind the head are dropped

# KEYS: the list, its state. ARGV: the user's field, the message before its order slot and after it, PRUNE_ABOVE.
# The list is ordered by tag from its right end (BRPOP's) to its left; a binary search over LINDEX finds the
# first request with a larger tag, and the new one goes just before it (LINSERT AFTER: to its right).
PLACE = """
local function tag_of(raw)
  local ok, m = pcall(cjson.decode, raw)
  if ok and type(m) == 'table' and type(m.headers) == 'table' then
    return tonumber(m.headers.replicadp_order) or -1
  end
  return -1
end
local n = redis.call('LLEN', KEYS[1])
local hwm = tonumber(redis.call('HGET', KEYS[2], '~hwm') or '0')
local v = hwm
if n > 0 then
  v = tag_of(redis.call('LINDEX', KEYS[1], -1))
end
local last = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '-1')
local tag = math.max(v, last + 1)
redis.call('HSET', KEYS[2], ARGV[1], tag)
if tag > hwm then
  redis.call('HSET', KEYS[2], '~hwm', tag)
end
if redis.call('HLEN', KEYS[2]) > tonumber(ARGV[4]) then
  local state = redis.call('HGETALL', KEYS[2])
  for i = 1, #state, 2 do
    if string.sub(state[i], 1, 1) ~= '~' and tonumber(state[i + 1]) < v then
      redis.call('HDEL', KEYS[2], state[i])
    end
  end
end
local msg = ARGV[2] .. string.format('%d', tag) .. ARGV[3]
if n == 0 or tag_of(redis.call('LINDEX', KEYS[1], 0)) <= tag then
  redis.call('LPUSH', KEYS[1], msg)
  return {tag, n}
end
local lo, hi = 0, n
while lo < hi do
  local mid = math.floor((lo + hi) / 2)
  if tag_of(redis.call('LINDEX', KEYS[1], -(mid + 1))) > tag then hi = mid else lo = mid + 1 end
end
redis.call('LINSERT', KEYS[1], 'AFTER', redis.call('LINDEX', KEYS[1], -(lo + 1)), msg)
return {tag, lo}
"""


PLACE_SHA = hashlib.sha1(PLACE.encode()).hexdigest()


def user_field(user: str | None) -> str:
    return "-" if user is None else "u:" + user


def place(client, list_key: str, raw: str, user: str | None) -> tuple[int, int]:
    """Put the message `raw` (whose order header holds ORDER_SLOT, as its last occurrence) into `list_key` by
    its user's fair tag. Returns (tag, how many requests of the list go before it)."""
    at = raw.rindex(ORDER_SLOT)
    args = (2, list_key, FAIR_KEY + list_key, user_field(user), raw[:at], raw[at + len(ORDER_SLOT):], PRUNE_ABOVE)
    try:
        tag, ahead = client.evalsha(PLACE_SHA, *args)
    except NoScriptError:  # the first time on this server (or after a SCRIPT FLUSH or a restart)
        tag, ahead = client.eval(PLACE, *args)
    return tag, ahead


def next_request(client, queue: str) -> tuple[dict[Priority, int], bytes | None]:
    """How many requests wait in `queue` at each priority, and the raw message a replica takes next."""
    pipe = client.pipeline()
    for key in queue_lists(queue):
        pipe.llen(key)
        pipe.lindex(key, -1)
    replies = pipe.execute()
    heads = [raw for raw in replies[1::2] if raw is not None]
    return dict(zip(Priority, replies[::2])), heads[0] if heads else None

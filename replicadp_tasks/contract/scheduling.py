"""The order in which replicas take requests: by priority, then round robin across tenants, then across users
within a tenant, FIFO within a user.

A request's `priority` picks one of kombu's priority lists of the queue (`video`, `video\\x06\\x163`, ...); a
replica's BRPOP names them in order, so it takes from the first one that is not empty, and a requeued request
goes back to the head of its own list (kombu's restore reads the level from the message). Within one list the
producer's transport (`place`) puts each message where two-level start-time fair queuing says, one unit per
request. A tenant (the API key's owner, `tenant`; requests without one are the unnamed tenant) gets a slot at

    tag = max(V, the tenant's previous tag + 1)

where V is the tag of the request at the head of the list (or, for an empty list, the highest tag given out);
the slots of one tenant then hold its requests in the order of their user tags, the same rule one level down
(V: the user tag of the tenant's first waiting request). So tenants alternate whatever number of users each
names, users alternate within a tenant, ties keep their arrival order, and without tenants it is round robin
across users as before. docs/scheduling.md says how the script keeps that order, what it costs, why online
traffic is not reordered by cost, and what round robin costs a big batch.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
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


# The headers `place` fills: the slot's tenant tag (which orders the list) and the request's user tag (which
# orders the tenant's requests among its slots). The producer sends these texts in their place.
ORDER_HEADER = "replicadp_order"
USER_ORDER_HEADER = "replicadp_user_order"
TENANT_HEADER = "replicadp_tenant"
ORDER_PLACEHOLDER = "@@replicadp-order@@"
USER_ORDER_PLACEHOLDER = "@@replicadp-user-order@@"
ORDER_SLOT = f'"{ORDER_PLACEHOLDER}"'  # as JSON
USER_ORDER_SLOT = f'"{USER_ORDER_PLACEHOLDER}"'
PRUNE_ABOVE = 1000  # fields in one list's state: past this, tenants and users that would gain nothing are dropped

# KEYS: the list, its state. ARGV: the tenant's key, the user's key, the message before its user-order slot,
# between it and its order slot, after that, PRUNE_ABOVE.
# The list is ordered by tenant tag from its right end (BRPOP's) to its left: a binary search over LINDEX finds
# the new slot, just before the first request with a larger tag. The tenant's waiting requests before that slot
# are ordered by user tag; those with a larger user tag than the new request's (found walking from the slot
# toward the head) each move one of the tenant's slots later, and the new request takes the freed slot: each
# slot keeps its tenant tag, rewritten in the raw message (never re-encoded: cjson would change its bytes).
# Messages are read with patterns, not decoded: only a header's own key has a quote right after its last letter
# (inside a JSON string every quote is escaped), and the scheduling headers are the headers' last (`place`).
# State fields: `t:<tenant>` its last tenant tag, `h:<tenant>` its highest user tag, `u:<tenant>/<user>` the
# user's last tag, `~hwm` the highest tenant tag.
PLACE = """
local function after(raw, key)  -- the position just after the last `"key":` in raw, or nil
  local at, found = 1, nil
  while true do
    local _, e = string.find(raw, key, at, true)
    if not e then return found end
    found, at = e + 1, e + 1
  end
end
local function number(raw, key)
  local at = after(raw, key)
  return tonumber(at and string.match(raw, '^%s*(%d+)', at) or '') or -1
end
local function tag_of(raw)
  return number(raw, '"replicadp_order":')
end
local function lane_of(raw)
  local at = after(raw, '"replicadp_tenant":')
  return at and string.match(raw, '^%s*"([^"\\\\]*)"', at) or '-', number(raw, '"replicadp_user_order":')
end
local function retag(raw, tag)
  local at = after(raw, '"replicadp_order":')
  local _, e, space = string.find(raw, '^(%s*)%d+', at)
  return string.sub(raw, 1, at - 1) .. space .. string.format('%d', tag) .. string.sub(raw, e + 1)
end
local list, state, tenant = KEYS[1], KEYS[2], ARGV[1]
local tfield, hfield, ufield = 't:' .. tenant, 'h:' .. tenant, 'u:' .. tenant .. '/' .. ARGV[2]
local n = redis.call('LLEN', list)
local hwm = tonumber(redis.call('HGET', state, '~hwm') or '0')
local v = hwm
if n > 0 then
  v = tag_of(redis.call('LINDEX', list, -1))
end
local tag = math.max(v, tonumber(redis.call('HGET', state, tfield) or '-1') + 1)
local lo = n
if n > 0 and tag_of(redis.call('LINDEX', list, 0)) > tag then
  local hi
  lo, hi = 0, n
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if tag_of(redis.call('LINDEX', list, -(mid + 1))) > tag then hi = mid else lo = mid + 1 end
  end
end
-- The tenant's requests before the slot, nearest first, that go after the new one.
local x = tonumber(redis.call('HGET', state, ufield) or '-1') + 1
local moved, found = {}, false
local i = lo - 1
while i >= 0 and not found do  -- read in chunks: one LRANGE walks the list once
  local chunk = redis.call('LRANGE', list, n - 1 - i, math.min(n - 1, n - 1 - i + 63))
  for _, raw in ipairs(chunk) do
    local t, u = lane_of(raw)
    if t == tenant then
      if u <= x then found = true break end
      moved[#moved + 1] = {i, raw, u}
    end
    i = i - 1
  end
end
local high = tonumber(redis.call('HGET', state, hfield) or '0')
local utag = math.max(high, x)
if found then
  utag = x
elseif #moved > 0 then
  utag = moved[#moved][3]  -- the tenant's first waiting request: V one level down
  while #moved > 0 and moved[#moved][3] <= utag do moved[#moved] = nil end
end
redis.call('HSET', state, tfield, tag, ufield, utag)
if tag > hwm then redis.call('HSET', state, '~hwm', tag) end
if utag > high then redis.call('HSET', state, hfield, utag) end
if redis.call('HLEN', state) > tonumber(ARGV[6]) then
  -- A tenant whose last tag is behind the head has nothing waiting: it would get the head's tag anyway, and
  -- its users behind its highest user tag would get that one.
  local fields = redis.call('HGETALL', state)
  local busy, highest = {}, {}
  for i = 1, #fields, 2 do
    local kind, rest, value = string.sub(fields[i], 1, 2), string.sub(fields[i], 3), tonumber(fields[i + 1])
    if kind == 't:' then
      if value < v then redis.call('HDEL', state, fields[i]) else busy[rest] = true end
    elseif kind == 'h:' then
      highest[rest] = value
    elseif kind ~= 'u:' and fields[i] ~= '~hwm' then  -- a user of the one-level scheme (before tenants)
      redis.call('HDEL', state, fields[i])
    end
  end
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 2) == 'u:' then
      local t = string.match(fields[i], '^u:([^/]*)/')
      if not t or (not busy[t] and tonumber(fields[i + 1]) < (highest[t] or 0)) then
        redis.call('HDEL', state, fields[i])
      end
    end
  end
end
local msg = ARGV[3] .. string.format('%d', utag) .. ARGV[4] .. string.format('%d', tag) .. ARGV[5]
local into, ahead = msg, lo
for k = 1, #moved do
  local i, raw = moved[k][1], moved[k][2]
  if k == 1 then into = retag(raw, tag) end
  redis.call('LSET', list, -(i + 1), retag(k < #moved and moved[k + 1][2] or msg, tag_of(raw)))
  ahead = i
end
if lo == n then
  redis.call('LPUSH', list, into)
else
  redis.call('LINSERT', list, 'AFTER', redis.call('LINDEX', list, -(lo + 1)), into)
end
return {tag, utag, ahead, #moved}
"""


PLACE_SHA = hashlib.sha1(PLACE.encode()).hexdigest()


def tenant_key(tenant: str | None) -> str:
    return "-" if tenant is None else tenant  # a tenant id starts with a letter or digit: never "-"


def user_field(user: str | None) -> str:
    return "-" if user is None else "u:" + user


def place(client, list_key: str, raw: str, tenant: str | None, user: str | None) -> tuple[int, int, int, int]:
    """Put the message `raw` (whose user-order and order headers hold USER_ORDER_SLOT and ORDER_SLOT, in that
    order, as their last occurrences) into `list_key` by its tenant's and user's fair tags. Returns (the tenant
    tag of its slot, its user tag, how many requests of the list go before it, how many of its tenant's requests
    it moved one slot later)."""
    order = raw.rindex(ORDER_SLOT)
    user_order = raw.rindex(USER_ORDER_SLOT, 0, order)
    args = (2, list_key, FAIR_KEY + list_key, tenant_key(tenant), user_field(user), raw[:user_order],
            raw[user_order + len(USER_ORDER_SLOT):order], raw[order + len(ORDER_SLOT):], PRUNE_ABOVE)
    try:
        placed = client.evalsha(PLACE_SHA, *args)
    except NoScriptError:  # the first time on this server (or after a SCRIPT FLUSH or a restart)
        placed = client.eval(PLACE, *args)
    return tuple(placed)


def next_request(client, queue: str) -> tuple[dict[Priority, int], bytes | None]:
    """How many requests wait in `queue` at each priority, and the raw message a replica takes next."""
    pipe = client.pipeline()
    for key in queue_lists(queue):
        pipe.llen(key)
        pipe.lindex(key, -1)
    replies = pipe.execute()
    heads = [raw for raw in replies[1::2] if raw is not None]
    return dict(zip(Priority, replies[::2])), heads[0] if heads else None

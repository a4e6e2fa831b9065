-- Put one request into its priority's list by its tenant's and user's fair tags (placement.place).
-- KEYS: the list, its state. ARGV: the tenant's key, the user's key, the message before its user-order slot,
-- between it and its order slot, after that, PRUNE_ABOVE.
-- The list is ordered by tenant tag from its right end (BRPOP's) to its left: a binary search over LINDEX finds
-- the new slot, just before the first request with a larger tag. The tenant's waiting requests before that slot
-- are ordered by user tag; those with a larger user tag than the new request's (found walking from the slot
-- toward the head) each move one of the tenant's slots later, and the new request takes the freed slot: each
-- slot keeps its tenant tag, rewritten in the raw message (never re-encoded: cjson would change its bytes).
-- Messages are read with patterns, not decoded: only a header's own key has a quote right after its last letter
-- (inside a JSON string every quote is escaped), and the scheduling headers are the headers' last (`place`).
-- State fields: `t:<tenant>` its last tenant tag, `h:<tenant>` its highest user tag, `u:<tenant>/<user>` the
-- user's last tag, `~hwm` the highest tenant tag.
-- Returns {the tenant tag of its slot, its user tag, how many requests go before it, how many it moved}.
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
  return at and string.match(raw, '^%s*"([^"\\]*)"', at) or '-', number(raw, '"replicadp_user_order":')
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

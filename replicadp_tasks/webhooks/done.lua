-- An attempt's end: its host's send slot freed; the host backs off (ARGV[5] '1': ARGV[8] s doubling per failure in
-- a row, up to ARGV[9]) or is clear again; then, unless a later claim took the event (its attempts moved past
-- ARGV[2]), the event is due again ARGV[6] s from now, or (ARGV[6] '') done, counted in ARGV[7] if not ''.
-- KEYS: the due events, the events, the attempts, the stats, the hosts' backoff, the hosts' failures in a row.
-- ARGV: the event id, its attempt, its host, the prefix of a host's sends in flight, '1' if the host failed, the
-- delay before it is due again, the counter to count it in, the host's first backoff and its longest (s).
local eid, dest = ARGV[1], ARGV[3]
redis.call('zrem', ARGV[4] .. dest, eid)
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
if ARGV[5] == '1' then
  local n = redis.call('hincrby', KEYS[6], dest, 1)
  redis.call('zadd', KEYS[5], now + math.min(tonumber(ARGV[9]), tonumber(ARGV[8]) * 2 ^ (n - 1)), dest)
else
  redis.call('hdel', KEYS[6], dest)
  redis.call('zrem', KEYS[5], dest)
end
if redis.call('hget', KEYS[3], eid) ~= ARGV[2] then return 0 end
if ARGV[6] ~= '' then
  redis.call('zadd', KEYS[1], now + tonumber(ARGV[6]), eid)
  return 1
end
redis.call('zrem', KEYS[1], eid)
redis.call('hdel', KEYS[2], eid)
redis.call('hdel', KEYS[3], eid)
if ARGV[7] ~= '' then redis.call('hincrby', KEYS[4], ARGV[7], 1) end
return 1

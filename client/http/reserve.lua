-- Admit one request against the gateways' limit (admission.Admission.reserve): the reservations not yet on the
-- queue, dropped once older than ARGV[3] s, plus the queue's lists, counted against the limit.
-- KEYS: the reservations, then the queue's lists; ARGV: the limit, the task id, ADMIT_STALE_S.
-- Returns {admitted, depth}.
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
local depth = redis.call('ZCARD', KEYS[1])
for i = 2, #KEYS do
  depth = depth + redis.call('LLEN', KEYS[i])
end
if depth >= tonumber(ARGV[1]) then
  return {0, depth}
end
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {1, depth}

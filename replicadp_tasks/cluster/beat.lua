-- One replica's heartbeat (heartbeat.Heartbeat.beat), on Redis's clock; drops from both sets (and the hash) who has
-- not beaten within the stale bound.
-- And declares the replica's model (fleet.py), unless it is declared: a flushed or failed-over Redis learns it again.
-- KEYS: the set to beat in, the other set, the running hash, the models hash. ARGV: name, the running request's
-- JSON ('' if none), the stale bound, the model's name, its declaration.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HSETNX', KEYS[4], ARGV[4], ARGV[5])
if ARGV[2] == '' then redis.call('HDEL', KEYS[3], ARGV[1]) else redis.call('HSET', KEYS[3], ARGV[1], ARGV[2]) end
for i = 1, 2 do
  local dead = redis.call('ZRANGEBYSCORE', KEYS[i], '-inf', now - tonumber(ARGV[3]))
  if #dead > 0 then
    redis.call('ZREM', KEYS[i], unpack(dead))
    redis.call('HDEL', KEYS[3], unpack(dead))
  end
end

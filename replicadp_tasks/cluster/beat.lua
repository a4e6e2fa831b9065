-- One replica's heartbeat (heartbeat.Heartbeat.beat), on Redis's clock; drops from both sets (and the hash) who has
-- not beaten within the stale bound.
-- And declares the replica's model and its REPLICADP_MODELS (fleet.py), each unless it is declared: a flushed or
-- failed-over Redis learns them again.
-- KEYS: the set to beat in, the other set, the running hash, the models hash. ARGV: name, the running request's
-- JSON ('' if none), the stale bound, then a model's name and its declaration for each model.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
for i = 4, #ARGV, 2 do redis.call('HSETNX', KEYS[4], ARGV[i], ARGV[i + 1]) end
if ARGV[2] == '' then redis.call('HDEL', KEYS[3], ARGV[1]) else redis.call('HSET', KEYS[3], ARGV[1], ARGV[2]) end
for i = 1, 2 do
  local dead = redis.call('ZRANGEBYSCORE', KEYS[i], '-inf', now - tonumber(ARGV[3]))
  if #dead > 0 then
    redis.call('ZREM', KEYS[i], unpack(dead))
    redis.call('HDEL', KEYS[3], unpack(dead))
  end
end

-- Queue one webhook event (events.emit) unless its id was queued for this task before (a redelivery), due now by
-- Redis's clock; a progress event only while the task has fewer than ARGV[5] events (else counted as dropped).
-- KEYS: the task's sent ids, the due events, the events, the stats.
-- ARGV: the event id, its Queued JSON, the sent ids' lifetime (s), '1' for a progress event, the cap.
if ARGV[4] == '1' and redis.call('hlen', KEYS[1]) >= tonumber(ARGV[5]) then
  redis.call('hincrby', KEYS[4], 'webhook_progress_dropped', 1)
  return 0
end
if redis.call('hsetnx', KEYS[1], ARGV[1], 1) == 0 then return 0 end
redis.call('expire', KEYS[1], ARGV[3])
local t = redis.call('time')
redis.call('hset', KEYS[3], ARGV[1], ARGV[2])
redis.call('zadd', KEYS[2], tonumber(t[1]) + tonumber(t[2]) / 1e6, ARGV[1])
return 1

-- A sender takes the first due event whose host is neither backing off (the event is due again when that ends) nor
-- at its cap of sends in flight (it waits ARGV[5] s; the next due event is looked at): it stays queued, due again
-- ARGV[1] s later (unless retried or done by then), and its attempt is counted now. An event whose attempts were
-- all taken (its last sender died, or lost Redis's reply) is given up instead of being sent again.
-- KEYS: the due events, the events, the attempts, the hosts' backoff, the stats.
-- ARGV: the claim (s), the sends a host may have in flight, how many due events to look through, the prefix of a
-- host's sends in flight, a busy host's wait (s), the attempts an event gets.
-- Returns {event id, its Queued JSON, its attempt}, or false when none is due.
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local due = redis.call('zrangebyscore', KEYS[1], '-inf', now, 'limit', 0, tonumber(ARGV[3]))
for _, eid in ipairs(due) do
  local queued = redis.call('hget', KEYS[2], eid)
  if not queued then
    redis.call('zrem', KEYS[1], eid)
    redis.call('hdel', KEYS[3], eid)
  else
    local record = cjson.decode(queued)
    local dest = record.dest or ''
    local most = tonumber(ARGV[6])
    if record.payload.event == 'progress' then most = 1 end
    local until_ = tonumber(redis.call('zscore', KEYS[4], dest) or 0)
    local sending = ARGV[4] .. dest
    redis.call('zremrangebyscore', sending, '-inf', now)
    if tonumber(redis.call('hget', KEYS[3], eid) or 0) >= most then
      redis.call('zrem', KEYS[1], eid)
      redis.call('hdel', KEYS[2], eid)
      redis.call('hdel', KEYS[3], eid)
      redis.call('hincrby', KEYS[5], most == 1 and 'webhook_progress_dropped' or 'webhook_give_ups', 1)
    elseif until_ > now then
      redis.call('zadd', KEYS[1], until_, eid)
    elseif redis.call('zcard', sending) >= tonumber(ARGV[2]) then
      redis.call('zadd', KEYS[1], now + tonumber(ARGV[5]), eid)
    else
      local claim = now + tonumber(ARGV[1])
      local attempt = redis.call('hincrby', KEYS[3], eid, 1)
      redis.call('zadd', sending, claim, eid)
      redis.call('expire', sending, math.ceil(tonumber(ARGV[1])) + 1)
      redis.call('zadd', KEYS[1], claim, eid)
      return {eid, queued, attempt}
    end
  end
end
return false

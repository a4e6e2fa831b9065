-- Where queued requests wait (placement.queue_order: the preemption policy, the gateway's queue positions and
-- its plan of each queue): per list of the queue, its length and the task ids of its first ARGV[1] messages from
-- the end replicas take from (BRPOP: the right). A message names its task id in its headers as `"id": "<uuid>"`,
-- the first `"id": ` of kombu's JSON (the body is base64, and text a request carries sits inside JSON strings, its
-- quotes escaped).
-- KEYS: the queue's lists, in the order replicas take from them; ARGV[1]: how many messages of each to read.
local out = {}
for _, key in ipairs(KEYS) do
  local items = redis.call('LRANGE', key, -tonumber(ARGV[1]), -1)
  local ids = {}
  for i = #items, 1, -1 do
    local at = string.find(items[i], '"id": "', 1, true)
    local stop = at and string.find(items[i], '"', at + 7, true)
    ids[#ids + 1] = stop and string.sub(items[i], at + 7, stop - 1) or ''
  end
  out[#out + 1] = redis.call('LLEN', key)
  out[#out + 1] = ids
end
return out

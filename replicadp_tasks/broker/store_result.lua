-- Write one state of a request's result (backend.RedisBackend._store_result) and publish it, unless the key holds a
-- result that succeeded (a lost duplicate must not overwrite a result): Celery's read, write and publish, at once.
-- KEYS[1]: the result key; ARGV: the encoded result, its lifetime in seconds (0: none), SUCCESS.
-- Returns 0 (and writes nothing) if the key holds a result that succeeded, else 1.
local current = redis.call('get', KEYS[1])
if current then
  local ok, meta = pcall(cjson.decode, current)
  if ok and type(meta) == 'table' and meta['status'] == ARGV[3] then return 0 end
end
if ARGV[2] ~= '0' then
  redis.call('set', KEYS[1], ARGV[1], 'EX', ARGV[2])
else
  redis.call('set', KEYS[1], ARGV[1])
end
redis.call('publish', KEYS[1], ARGV[1])
return 1

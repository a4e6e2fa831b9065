-- Release the fence KEYS[1] only if token ARGV[1] still holds it.
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0

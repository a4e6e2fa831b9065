-- Unless KEYS[2] (the request's cancel key) exists, release the fence KEYS[1] if token ARGV[1] still holds it:
-- 1 (not cancelled), else 0.
if redis.call('exists', KEYS[2]) == 1 then return 0 end
if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('del', KEYS[1]) end
return 1

-- Renew the fence KEYS[1] for ARGV[2] ms only while token ARGV[1] holds it.
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0

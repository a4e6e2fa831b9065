-- Take the fence KEYS[1] for token ARGV[1] for ARGV[2] ms if it is free, or renew it if the token holds it; else
-- answer who holds it. Atomic: it cannot expire in between.
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 'acquired' end
local owner = redis.call('get', KEYS[1])
if owner == ARGV[1] then redis.call('pexpire', KEYS[1], ARGV[2]) return 'held' end
return owner

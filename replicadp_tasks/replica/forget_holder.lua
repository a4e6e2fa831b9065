-- Forget the holder of delivery tag ARGV[1] in the holders hash KEYS[1] only if it is still ARGV[2], the one the
-- sweep saw: the message may already be held again elsewhere.
if redis.call('hget', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('hdel', KEYS[1], ARGV[1]) end
return 0

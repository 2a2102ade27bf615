-- KEYS[1] = replica hash; ARGV = field/value pairs. Writes only while the lease lives, so a late
-- write never leaves a hash without a TTL behind.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1

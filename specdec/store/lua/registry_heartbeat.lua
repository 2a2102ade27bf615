-- KEYS[1] = replica hash, KEYS[2] = its kind/pool index set; ARGV[1] = lease in ms,
-- ARGV[2] = replica id, ARGV[3 ..] = field/value pairs (load) to set with the renewal.
-- Renews only a live lease: a lapsed replica must register again (0), never reappear half-written.
if redis.call('PEXPIRE', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('SADD', KEYS[2], ARGV[2])  -- undoes a listing that pruned it in a race with register
if #ARGV > 2 then redis.call('HSET', KEYS[1], unpack(ARGV, 3)) end
return 1

-- The canary decider's lease. KEYS[1] = lease key; ARGV[1] = holder, ARGV[2] = lease in ms
-- (renew), or '0' (release). Renews or releases only a lease the holder still has: 1, else 0.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '0' then return redis.call('DEL', KEYS[1]) end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])

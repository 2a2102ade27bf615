-- ARGV[4] = expected list length, ARGV[5] = n_fields, ARGV[6] = n_counters, then n_fields
-- field/value items (HSET), n_counters field/increment items (HINCRBY), then the new token ids.
-- Only the new tokens travel and only RPUSH touches the list: O(block), whatever the session length.
local refused = guard(false)
if refused then return refused end
local length = redis.call('LLEN', KEYS[2])
if length ~= tonumber(ARGV[4]) then return {'position', length} end
local n_fields, n_counters = tonumber(ARGV[5]), tonumber(ARGV[6])
local counters = 7 + n_fields
length = push(counters + n_counters, length)
for i = counters, counters + n_counters - 1, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
set_fields(7, n_fields)
return {'ok', bump(), length}

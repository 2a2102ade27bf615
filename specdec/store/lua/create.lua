-- ARGV[4] = n, ARGV[5 .. 4 + n] = field/value pairs, then the prompt's token ids.
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists', 0} end
local n = tonumber(ARGV[4])
redis.call('DEL', KEYS[2])  -- a list whose hash vanished first is an orphan, not this session's
set_fields(5, n)
redis.call('HSET', KEYS[1], 'schema', ARGV[1], 'version', 0, 'created_at', now_ms())
local length = push(5 + n, 0)
return {'ok', bump(), length}

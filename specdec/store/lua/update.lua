-- ARGV[4] = '1' when an ended session may be written (only end() itself), ARGV[5] = n,
-- ARGV[6 .. 5 + n] = field/value pairs.
local refused = guard(ARGV[4] == '1')
if refused then return refused end
set_fields(6, tonumber(ARGV[5]))
return {'ok', bump(), redis.call('LLEN', KEYS[2])}

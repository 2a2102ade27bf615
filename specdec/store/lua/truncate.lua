-- ARGV[4] = the length to keep. Only shortens: a longer length is a position mismatch.
local refused = guard(false)
if refused then return refused end
local length = redis.call('LLEN', KEYS[2])
local keep = tonumber(ARGV[4])
if keep > length then return {'position', length} end
if keep == 0 then
  redis.call('DEL', KEYS[2])
elseif keep < length then
  redis.call('LTRIM', KEYS[2], 0, keep - 1)
end
return {'ok', bump(), keep}

-- A canary state change and its decision log entry, in one atomic step.
-- KEYS[1] = state hash, KEYS[2] = decision list, KEYS[3] = decider lease (all under one hash tag).
-- ARGV[1] = expected version ('absent': create only if there is no state yet),
-- ARGV[2] = lease holder that must still hold the lease ('' for an operator's action: no lease),
-- ARGV[3] = decision JSON ('' for none), ARGV[4] = decisions kept,
-- ARGV[5 ..] = field/value pairs.
-- Answers {'ok', new version} or {refusal, current version}: 'exists', 'version', 'not_leader'.
local version = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if ARGV[1] == 'absent' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists', version} end
elseif tonumber(ARGV[1]) ~= version then
  return {'version', version}
end
-- Fencing: a decider whose lease lapsed (a long pause, a partition) cannot write what it decided.
if ARGV[2] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[2] then return {'not_leader', version} end
if #ARGV > 4 then redis.call('HSET', KEYS[1], unpack(ARGV, 5)) end
version = redis.call('HINCRBY', KEYS[1], 'version', 1)
if ARGV[3] ~= '' then
  redis.call('LPUSH', KEYS[2], ARGV[3])
  redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[4]) - 1)
end
return {'ok', version}

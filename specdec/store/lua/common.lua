-- Prepended to every session script (schema 1).
-- KEYS[1] = session hash, KEYS[2] = committed token list (same hash tag, same cluster slot).
-- ARGV[1] = schema the caller speaks, ARGV[2] = sliding TTL in ms, ARGV[3] = expected version or ''.
-- Scripts answer {'ok', version, length} or {reason, detail}; the caller raises the matching error.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- nil when the write may go ahead, else the refusal to return.
local function guard(allow_ended)
  local state = redis.call('HMGET', KEYS[1], 'schema', 'version', 'status')
  if not state[1] then return {'missing', 0} end
  if state[1] ~= ARGV[1] then return {'schema', state[1]} end
  if state[3] == 'ended' and not allow_ended then return {'ended', 0} end
  if ARGV[3] ~= '' and state[2] ~= ARGV[3] then return {'version', tonumber(state[2])} end
  return nil
end

-- HSET the field/value pairs ARGV[first .. first + count - 1].
local function set_fields(first, count)
  if count > 0 then
    redis.call('HSET', KEYS[1], unpack(ARGV, first, first + count - 1))
  end
end

-- RPUSH ARGV[first ..] in chunks (unpack is bounded by the Lua stack) onto a list of `length`
-- items; returns the new length.
local function push(first, length)
  for i = first, #ARGV, 1000 do
    length = redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
  end
  return length
end

-- Every successful write: bump the version, stamp it, slide the TTL of both keys.
local function bump()
  local version = redis.call('HINCRBY', KEYS[1], 'version', 1)
  redis.call('HSET', KEYS[1], 'updated_at', now_ms())
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return version
end

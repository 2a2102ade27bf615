-- Prepended to every session script (schema 1).
-- KEYS[1] = session hash, KEYS[2] = committed token list (same hash tag, same cluster slot).
-- ARGV[1] = schema the caller speaks, ARGV[2] = sliding TTL in ms, ARGV[3] = expected version or ''
-- (any), optionally followed by '|' and a writer's name: the write then marks the record with
-- (writer, expected version), and a repeat of it that finds the version one higher under its own
-- mark was already applied (its reply was lost and the client sent it again): it is answered ok,
-- not refused, and writes nothing twice.
-- Scripts answer {'ok', version, length} or {reason, detail}; the caller raises the matching error.

local expected_version, writer = string.match(ARGV[3], '^([^|]*)|?(.*)$')
local write_mark = writer .. '@' .. expected_version

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
  if expected_version ~= '' and state[2] ~= expected_version then
    if writer ~= '' and tonumber(state[2]) == tonumber(expected_version) + 1
        and redis.call('HGET', KEYS[1], 'written_by') == write_mark then
      return {'ok', tonumber(state[2]), redis.call('LLEN', KEYS[2])}
    end
    return {'version', tonumber(state[2])}
  end
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
  if writer ~= '' then redis.call('HSET', KEYS[1], 'written_by', write_mark) end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return version
end

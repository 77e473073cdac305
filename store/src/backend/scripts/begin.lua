-- Lookup-or-lock in one step, so no request slips between "no record" and "lock taken".
-- KEYS[1] record, KEYS[2] lock, KEYS[3] waiter mark, KEYS[4] trace; ARGV[1] body hash (64 hex),
-- ARGV[2] token, ARGV[3] lock TTL ms, ARGV[4] hold ('1' or '0'), ARGV[5] the trace's retention
-- ms (with hold), ARGV[6] the token whose trace to supersede ('' for none; with hold).
-- The record value is the 64-byte body hash followed by the opaque record bytes; a record is
-- returned with its remaining lifetime (PTTL), so that no cache keeps it longer than Redis.
-- A caller that finds the lock held marks the key as waited on, in the same step, so that the
-- holder's commit or release (which publish a wake-up only for a marked key) cannot miss it.
-- The mark outlives the lock by a second: a waiter never sleeps past the lock's expiry.
-- With hold, the attempt leaves a trace, `<token> <started ms> <lock TTL ms> <body hash>`
-- (started: Redis's TIME, ms since the Unix epoch), living max(retention, lock TTL): a later
-- begin with hold that finds a trace and no lock answers {'in-doubt', token, started ms,
-- running ms} (running: what is left of the attempt's lock TTL, 0 once past), or 'mismatch'
-- for another body hash, and takes no lock. A trace not of that form (set by hand) is ignored
-- and overwritten. Without hold, traces are neither read nor written.
local record = redis.call('GET', KEYS[1])
if record then
  if string.sub(record, 1, 64) == ARGV[1] then
    return {'record', string.sub(record, 65), redis.call('PTTL', KEYS[1])}
  end
  return {'mismatch'}
end
local hold = ARGV[4] == '1'
local function trace()
  local value = redis.call('GET', KEYS[4])
  if not value then
    return nil
  end
  local token, started, ttl, hash = string.match(value, '^([%w_-]+) (%d+) (%d+) (%x+)$')
  if not token then
    return nil
  end
  return {token = token, started = started, ttl = ttl, hash = hash}
end
if hold and ARGV[6] ~= '' and redis.call('EXISTS', KEYS[2]) == 0 then
  local t = trace()
  if t and t.token == ARGV[6] then
    redis.call('DEL', KEYS[4])
  end
end
local pttl = redis.call('PTTL', KEYS[2])
if pttl == -2 then
  local now
  if hold then
    local time = redis.call('TIME')
    now = time[1] .. string.format('%03d', math.floor(tonumber(time[2]) / 1000))
    local t = trace()
    if t then
      if t.hash ~= ARGV[1] then
        return {'mismatch'}
      end
      local running = tonumber(t.started) + tonumber(t.ttl) - tonumber(now)
      if running < 0 then
        running = 0
      end
      return {'in-doubt', t.token, t.started, running}
    end
  end
  if redis.call('SET', KEYS[2], ARGV[2], 'NX', 'PX', ARGV[3]) then
    if hold then
      local life = math.max(tonumber(ARGV[5]), tonumber(ARGV[3]))
      local value = ARGV[2] .. ' ' .. now .. ' ' .. ARGV[3] .. ' ' .. ARGV[1]
      redis.call('SET', KEYS[4], value, 'PX', life)
    end
    return {'locked'}
  end
  pttl = redis.call('PTTL', KEYS[2])
end
local mark = tonumber(ARGV[3])
if pttl > 0 then
  mark = pttl
end
redis.call('SET', KEYS[3], '1', 'PX', mark + 1000)
return {'held', pttl}

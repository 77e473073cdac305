-- Lookup-or-lock in one step, so no request slips between "no record" and "lock taken".
-- KEYS[1] record, KEYS[2] lock, KEYS[3] waiter mark; ARGV[1] body hash (64 hex), ARGV[2] token,
-- ARGV[3] lock TTL ms.
-- The record value is the 64-byte body hash followed by the opaque record bytes; a record is
-- returned with its remaining lifetime (PTTL), so that no cache keeps it longer than Redis.
-- A caller that finds the lock held marks the key as waited on, in the same step, so that the
-- holder's commit or release (which publish a wake-up only for a marked key) cannot miss it.
-- The mark outlives the lock by a second: a waiter never sleeps past the lock's expiry.
local record = redis.call('GET', KEYS[1])
if record then
  if string.sub(record, 1, 64) == ARGV[1] then
    return {'record', string.sub(record, 65), redis.call('PTTL', KEYS[1])}
  end
  return {'mismatch'}
end
if redis.call('SET', KEYS[2], ARGV[2], 'NX', 'PX', ARGV[3]) then
  return {'locked'}
end
local pttl = redis.call('PTTL', KEYS[2])
local mark = tonumber(ARGV[3])
if pttl > 0 then
  mark = pttl
end
redis.call('SET', KEYS[3], '1', 'PX', mark + 1000)
return {'held', pttl}

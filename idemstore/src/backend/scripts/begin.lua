-- Lookup-or-lock in one step, so no request slips between "no record" and "lock taken".
-- KEYS[1] record, KEYS[2] lock; ARGV[1] body hash (64 hex), ARGV[2] token, ARGV[3] lock TTL ms.
-- The record value is the 64-byte body hash followed by the opaque record bytes.
local record = redis.call('GET', KEYS[1])
if record then
  if string.sub(record, 1, 64) == ARGV[1] then
    return {'record', string.sub(record, 65)}
  end
  return {'mismatch'}
end
if redis.call('SET', KEYS[2], ARGV[2], 'NX', 'PX', ARGV[3]) then
  return {'locked'}
end
return {'held', redis.call('PTTL', KEYS[2])}

-- Release-if-owner and store-unless-present in one step: the first stored record wins, and a
-- commit whose lock expired still stores when nobody else did.
-- KEYS[1] record, KEYS[2] lock; ARGV[1] token, ARGV[2] body hash (64 hex),
-- ARGV[3] retention ms, ARGV[4] record bytes.
local owned = redis.call('GET', KEYS[2]) == ARGV[1]
if owned then
  redis.call('DEL', KEYS[2])
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 'exists'
end
redis.call('SET', KEYS[1], ARGV[2] .. ARGV[4], 'PX', ARGV[3])
if owned then
  return 'stored'
end
return 'late'

-- Release-if-owner and store-unless-present in one step: the first stored record wins, and a
-- commit whose lock expired still stores when nobody else did.
-- KEYS[1] record, KEYS[2] lock, KEYS[3] waiter mark, KEYS[4] trace; ARGV[1] token, ARGV[2] body
-- hash (64 hex), ARGV[3] retention ms, ARGV[4] record bytes, ARGV[5] wake-up channel, ARGV[6]
-- store key.
-- Whenever the lock is dropped or a record stored while someone waits on the key (begin.lua
-- marks it), the store key is published on the wake-up channel, so waiters on every idemstore
-- instance try again at once; a key nobody waits on costs no message. pcall: a PUBLISH the
-- ACL forbids must not fail a commit that already happened (waiters then re-check).
-- The key's trace (begin.lua) is deleted whatever the outcome: a record, stored now or before,
-- supersedes it (a late commit by an in-doubt attempt's own token is how its doubt ends).
local function wake()
  if redis.call('DEL', KEYS[3]) == 1 then
    redis.pcall('PUBLISH', ARGV[5], ARGV[6])
  end
end
local owned = redis.call('GET', KEYS[2]) == ARGV[1]
if owned then
  redis.call('DEL', KEYS[2])
end
redis.call('DEL', KEYS[4])
if redis.call('EXISTS', KEYS[1]) == 1 then
  if owned then
    wake()
  end
  return 'exists'
end
redis.call('SET', KEYS[1], ARGV[2] .. ARGV[4], 'PX', ARGV[3])
wake()
if owned then
  return 'stored'
end
return 'late'

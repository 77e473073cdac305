-- Compare-and-delete: an expired lock taken over by another request is not ours to drop.
-- KEYS[1] lock, KEYS[2] waiter mark, KEYS[3] trace; ARGV[1] token, ARGV[2] wake-up channel,
-- ARGV[3] store key, ARGV[4] in doubt ('1' or '0').
-- A dropped lock is published like in commit.lua (only when someone waits on the key), so
-- waiters anywhere try again at once. Unless in doubt (the attempt was sent and no answer came
-- back: its trace stays, and the key is in doubt), the trace begin.lua left is deleted too
-- when it is this token's (`<token> <started ms> <lock TTL ms> <body hash>`).
-- Returns 1 if the lock or the trace was deleted, else 0.
local released = 0
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if redis.call('DEL', KEYS[2]) == 1 then
    redis.pcall('PUBLISH', ARGV[2], ARGV[3])
  end
  released = 1
end
if ARGV[4] ~= '1' then
  local trace = redis.call('GET', KEYS[3])
  if trace and string.sub(trace, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
    redis.call('DEL', KEYS[3])
    released = 1
  end
end
return released

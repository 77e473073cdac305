-- Compare-and-delete: an expired lock taken over by another request is not ours to drop.
-- KEYS[1] lock, KEYS[2] waiter mark; ARGV[1] token, ARGV[2] wake-up channel, ARGV[3] store key.
-- A dropped lock is published like in commit.lua (only when someone waits on the key), so
-- waiters anywhere try again at once.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if redis.call('DEL', KEYS[2]) == 1 then
    redis.pcall('PUBLISH', ARGV[2], ARGV[3])
  end
  return 1
end
return 0

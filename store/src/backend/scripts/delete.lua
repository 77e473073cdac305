-- An operator deletes a store key's record, lock and trace, whoever holds the lock, in one step.
-- KEYS[1] record, KEYS[2] lock, KEYS[3] waiter mark, KEYS[4] trace; ARGV[1] wake-up channel,
-- ARGV[2] store key.
-- Returns {record deleted (0/1), lock deleted (0/1), trace deleted (0/1)}. Like commit.lua and
-- release.lua, a key someone waits on is published on the wake-up channel, so waiters try again
-- at once (and one of them takes the lock).
local record = redis.call('DEL', KEYS[1])
local lock = redis.call('DEL', KEYS[2])
local trace = redis.call('DEL', KEYS[4])
if record + lock > 0 and redis.call('DEL', KEYS[3]) == 1 then
  redis.pcall('PUBLISH', ARGV[1], ARGV[2])
end
return {record, lock, trace}

-- Compare-and-delete: an expired lock taken over by another request is not ours to drop.
-- KEYS[1] lock; ARGV[1] token.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0

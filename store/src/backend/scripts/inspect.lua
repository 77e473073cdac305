-- What one store key holds, for an operator, in one step (the keys share a slot): the record's
-- length, its first bytes (the 64-hex body hash, then the head of the filter's record) and PTTL,
-- the lock's PTTL, and the trace (begin.lua: `<token> <started ms> <lock TTL ms> <body hash>`,
-- false when there is none) with its PTTL. Never the record's body.
-- KEYS[1] record, KEYS[2] lock, KEYS[3] trace; ARGV[1] the last byte offset of the head to
-- return.
-- PTTL is -2 for a key that does not exist, -1 for one without expiry.
return {
  redis.call('STRLEN', KEYS[1]),
  redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[1])),
  redis.call('PTTL', KEYS[1]),
  redis.call('PTTL', KEYS[2]),
  redis.call('GET', KEYS[3]),
  redis.call('PTTL', KEYS[3]),
}

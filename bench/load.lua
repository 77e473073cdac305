-- wrk script for bench/throughput.py: POSTs a fixed JSON body of a chosen size, with an
-- Idempotency-Key chosen by mode. Arguments (after `--`):
--
--   mode     none    no Idempotency-Key (pass-through)
--            unique  a new key per request: <seed>-<thread>-<counter>
--            replay  the same <nkeys> keys over and over: <seed>-<i>, i = counter % nkeys
--            burst   each key used <group> times in a row by one thread:
--                    <seed>-<thread>-<counter div group>; with `-t1 -c<group>` the <group>
--                    requests of one key leave on <group> connections at about the same time
--   size     body bytes (a JSON object padded to exactly that size)
--   seed     a string unique to this run, so keys never collide with an earlier run's
--   n        nkeys (replay) or group (burst); ignored otherwise
--
-- Prints one line `WRKJSON {...}` at the end with the counts and latency percentiles (µs).
-- Requests are pre-rendered strings: only the key changes, so wrk's own cost per request stays
-- small and is the same for the filtered and the no-filter Envoy.

local thread_ids = 0

function setup(thread)
  thread:set("tid", thread_ids)
  thread_ids = thread_ids + 1
end

local mode, seed, n, head, tail, fixed, keyed
local counter = 0

function init(args)
  mode = args[1] or "none"
  local size = tonumber(args[2] or "1024")
  seed = args[3] or tostring(os.time())
  n = tonumber(args[4] or "1")
  local body
  if size >= 10 then
    body = '{"pad":"' .. string.rep("x", size - 10) .. '"}'
  else
    body = "{}"
  end
  local host = wrk.headers["Host"] or (wrk.host .. ":" .. tostring(wrk.port))
  head = "POST " .. wrk.path .. " HTTP/1.1\r\n" ..
         "Host: " .. host .. "\r\n" ..
         "Content-Type: application/json\r\n" ..
         "Content-Length: " .. #body .. "\r\n"
  tail = "\r\n\r\n" .. body
  if mode == "none" then
    fixed = head .. "\r\n" .. body
  elseif mode == "replay" then
    keyed = {}
    for i = 0, n - 1 do
      keyed[i] = head .. "Idempotency-Key: " .. seed .. "-" .. i .. tail
    end
  end
end

function request()
  counter = counter + 1
  if mode == "none" then
    return fixed
  elseif mode == "replay" then
    return keyed[counter % n]
  elseif mode == "burst" then
    return head .. "Idempotency-Key: " .. seed .. "-" .. tid .. "-" .. math.floor((counter - 1) / n) .. tail
  else
    return head .. "Idempotency-Key: " .. seed .. "-" .. tid .. "-" .. counter .. tail
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests": %d, "duration_us": %d, "bytes": %d, "connect": %d, "read": %d, ' ..
    '"write": %d, "status": %d, "timeout": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, ' ..
    '"mean_us": %.1f, "max_us": %d}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.mean, latency.max))
end

'use strict';
// The peer of bench/throughput.py's upstream, with the idempotency layer a team would put in the
// app itself: Express 5 + express-idempotency + express-idempotency-redis-adapter.
//
//   PEER_MIDDLEWARE=1  the idempotency middleware in front of the handler, records in Redis
//                      (REDIS_URL, default redis://127.0.0.1:6379)
//   PEER_MIDDLEWARE=0  the same app without it
//
//   node app.js [PORT]          (or PORT=...; HOST defaults to 127.0.0.1)
//
// One Node process (no cluster): the counters below are per process.
//
// POST <any path>: reads and parses the whole JSON body (express.json, as the middleware needs
// the parsed body to compare intents), then answers 201 application/json
// {"id":"ord_<n>","status":"created","item":"book","qty":1}, n counting real executions (a replay
// carries the first answer's id). Executions are counted per Idempotency-Key:
//
//   GET /executions?key=K        {"key": K, "count": c}
//   GET /executions?prefix=P     {"prefix": P, "keys": ..., "executions": ..., "multi": keys
//                                 executed more than once, "max": ..., "sample": [[key, count]...]}
//   GET /executions              {"executions": n, "keys": distinct keys}
//   GET /healthz                 {"ok": true, "middleware": bool}

const express = require('express');
const { createClient } = require('@redis/client');
const idempotency = require('express-idempotency');
const RedisAdapter = require('express-idempotency-redis-adapter').default;

const port = Number(process.argv[2] || process.env.PORT || 3000);
const host = process.env.HOST || '127.0.0.1';
const useMiddleware = process.env.PEER_MIDDLEWARE === '1';
const redisUrl = process.env.REDIS_URL || 'redis://127.0.0.1:6379';

let counter = 0;
const executions = new Map();

const app = express();

app.get('/healthz', (req, res) => {
  res.json({ ok: true, middleware: useMiddleware });
});

app.get('/executions', (req, res) => {
  const { key, prefix } = req.query;
  if (typeof key === 'string') {
    res.json({ key, count: executions.get(key) || 0 });
    return;
  }
  if (typeof prefix === 'string') {
    let keys = 0;
    let total = 0;
    let multi = 0;
    let max = 0;
    const sample = [];
    for (const [k, c] of executions) {
      if (!k.startsWith(prefix)) continue;
      keys += 1;
      total += c;
      if (c > 1) {
        multi += 1;
        if (sample.length < 10) sample.push([k, c]);
      }
      if (c > max) max = c;
    }
    res.json({ prefix, keys, executions: total, multi, max, sample });
    return;
  }
  res.json({ executions: counter, keys: executions.size });
});

let service = null;
let redis = null;

app.use(express.json({ limit: '4mb' }));

if (useMiddleware) {
  redis = createClient({ url: redisUrl });
  redis.on('error', (err) => console.error(`redis: ${err.message}`));
  // As the adapter's README shows: app.use(idempotency.idempotency({ dataAdapter })).
  const adapter = new RedisAdapter({ connectionInstance: redis });
  app.use(idempotency.idempotency({ dataAdapter: adapter }));
  service = idempotency.getSharedIdempotencyService();
}

app.post('/{*path}', (req, res) => {
  // The middleware calls next() after sending a stored answer too: the handler must check.
  if (service && service.isHit(req)) return;
  counter += 1;
  const key = req.get('idempotency-key');
  if (key !== undefined) executions.set(key, (executions.get(key) || 0) + 1);
  res.status(201).json({ id: `ord_${String(counter).padStart(6, '0')}`, status: 'created', item: 'book', qty: 1 });
});

// The middleware reports "in progress" (409) and "misuse of the key" (417) by setting the status
// and calling next(err); a team's error handler answers them (JSON, no stack trace logged).
// eslint-disable-next-line no-unused-vars
app.use((err, req, res, next) => {
  if (res.headersSent) return;
  const own = err.status || err.statusCode;
  const status = own >= 400 ? own : res.statusCode >= 400 ? res.statusCode : 500;
  res.status(status).json({ error: err.message });
});

async function main() {
  if (redis) await redis.connect();
  const server = app.listen(port, host, () => {
    console.log(`peer app pid ${process.pid} on http://${host}:${server.address().port} ` +
      `middleware=${useMiddleware ? `express-idempotency, redis ${redisUrl}` : 'off'}`);
  });
  const stop = () => {
    server.close();
    server.closeAllConnections();
    Promise.resolve(redis && redis.isOpen ? redis.quit() : null)
      .catch(() => {})
      .finally(() => process.exit(0));
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});

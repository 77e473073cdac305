#!/usr/bin/env bash
# Starts the local stack in the foreground (what `make run` calls, from the repository root):
#   demo app          127.0.0.1:8081   (/orders, /payments, /webhooks, /search)
#   idemstore         127.0.0.1:8380   (in-memory, or Redis when REDIS_URL=redis://... is set)
#   redis-server      127.0.0.1:6379   only with REDIS=1: envoy/redis.conf (append-only file in
#                                      target/redis), and idemstore on it
#   Envoy             127.0.0.1:10000  (admin 127.0.0.1:9901), config envoy/envoy.yaml
# With NATIVE=1 (`make run NATIVE=1`): the native host instead (envoy/native.yaml, the module
# target/release/libidempotency_filter.so with the store in Envoy), on a local Redis
# (envoy/redis.conf, as REDIS=1), and no idemstore.
# Ctrl-C (or any of them exiting) stops all of them, by PID.
set -euo pipefail

ENVOY_BIN=${ENVOY_BIN:?set ENVOY_BIN (make run does)}
IDEMSTORE_BIN=${IDEMSTORE_BIN:-target/release/idemstore}
WASM=target/wasm32-wasip1/release/idempotency_filter.wasm
PYTHON=${PYTHON:-python3}
APP_PORT=8081
STORE_ADDR=127.0.0.1:8380

NATIVE=${NATIVE:-}
MODULE=target/release/libidempotency_filter.so
ENVOY_CONFIG=envoy/envoy.yaml
if [[ "$NATIVE" == 1 ]]; then
  ENVOY_CONFIG=envoy/native.yaml
  REDIS=1
  [[ -z "${REDIS_URL:-}" ]] || { echo "run: NATIVE=1 uses the Redis of envoy/native.yaml (127.0.0.1:6379); unset REDIS_URL" >&2; exit 1; }
  need=("$ENVOY_BIN" "$MODULE")
else
  need=("$ENVOY_BIN" "$IDEMSTORE_BIN" "$WASM")
fi
for f in "${need[@]}"; do
  [[ -e "$f" ]] || { echo "run: $f is missing (make build / make envoy)" >&2; exit 1; }
done

pids=()
stopping=0
stop_all() {
  ((stopping)) && return
  stopping=1
  echo
  echo "run: stopping (pids ${pids[*]:-none})"
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 50); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
trap 'stop_all' EXIT

wait_http() { # url what
  for _ in $(seq 100); do
    if "$PYTHON" - "$1" <<'PY' 2>/dev/null; then return 0; fi
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=0.5).read()
PY
    sleep 0.1
  done
  echo "run: $2 did not come up at $1" >&2
  return 1
}

# `cmd > >(sed ...) &` keeps $! the PID of cmd itself (a pipeline would give sed's).
"$PYTHON" -u demo/orders_app.py --port "$APP_PORT" > >(sed -u 's/^/[app] /') 2>&1 &
pids+=($!)

wait_redis() { # port
  for _ in $(seq 100); do
    if "$PYTHON" - "$1" <<'PY' 2>/dev/null; then return 0; fi
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=0.5) as s:
    s.sendall(b"PING\r\n")
    sys.exit(0 if s.recv(64).startswith(b"+PONG") else 1)
PY
    sleep 0.1
  done
  echo "run: redis-server did not come up on port $1" >&2
  return 1
}

if [[ "${REDIS:-}" == 1 && -z "${REDIS_URL:-}" ]]; then
  REDIS_SERVER=${REDIS_SERVER:-redis-server}
  command -v "$REDIS_SERVER" >/dev/null || { echo "run: REDIS=1 needs redis-server on the PATH" >&2; exit 1; }
  mkdir -p target/redis
  "$REDIS_SERVER" envoy/redis.conf --dir target/redis > >(sed -u 's/^/[redis] /') 2>&1 &
  pids+=($!)
  wait_redis 6379
  REDIS_URL=redis://127.0.0.1:6379
fi

store_args=(--listen "$STORE_ADDR")
if [[ "$NATIVE" == 1 ]]; then
  echo "run: the native host (envoy/native.yaml): the store runs in Envoy, on Redis at $REDIS_URL"
elif [[ -n "${REDIS_URL:-}" ]]; then
  store_args+=(--redis "$REDIS_URL")
  echo "run: idemstore on Redis at $REDIS_URL"
else
  echo "run: idemstore in memory (REDIS=1 starts a local Redis with envoy/redis.conf; REDIS_URL=redis://host:port uses yours)"
fi
if [[ "$NATIVE" != 1 ]]; then
  "$IDEMSTORE_BIN" "${store_args[@]}" > >(sed -u 's/^/[idemstore] /') 2>&1 &
  pids+=($!)
fi

wait_http "http://127.0.0.1:$APP_PORT/healthz" "orders app"
[[ "$NATIVE" == 1 ]] || wait_http "http://$STORE_ADDR/healthz" "idemstore"

ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$PWD/target/release" \
"$ENVOY_BIN" -c "$ENVOY_CONFIG" --disable-hot-restart --concurrency 2 -l "${ENVOY_LOG_LEVEL:-info}" \
  > >(sed -u 's/^/[envoy] /') 2>&1 &
pids+=($!)

wait_http "http://127.0.0.1:9901/ready" "envoy"
# Envoy is ready before its first health check of idemstore passes; until then store calls fail
# at once and guarded requests would run unguarded (counted on `degraded`).
for _ in $(seq 100); do
  [[ "$NATIVE" == 1 ]] && break
  if "$PYTHON" - <<'PY' 2>/dev/null; then break; fi
import sys, urllib.request
body = urllib.request.urlopen("http://127.0.0.1:9901/clusters", timeout=0.5).read().decode()
sys.exit(0 if "idemstore::127.0.0.1:8380::health_flags::healthy" in body else 1)
PY
  sleep 0.1
done
cat <<EOF

run: ready. Envoy on http://127.0.0.1:10000 (admin http://127.0.0.1:9901). Try:
  curl -si -X POST localhost:10000/orders -H 'Idempotency-Key: k1' -H 'content-type: application/json' -d '{"item":"book"}'
  (run it twice: the second answer is a replay, x-idempotent-replay: true)
  curl -si -X POST localhost:10000/payments -H 'content-type: application/json' -d '{"amount":10}'
  (the payments route's policy requires a key: 400, with a link to the published policy)
  curl -si -X POST localhost:10000/webhooks -H 'ce-specversion: 1.0' -H 'ce-id: evt-1' -H 'ce-source: /demo' -H 'ce-type: demo' -H 'content-type: application/json' -d '{}'
  (inbox mode: a redelivery of ce-id evt-1 is acknowledged without reaching the app)
  curl -s 'localhost:9901/stats?filter=wasmcustom'   (native host: filter=^idempotency\\.)
Ctrl-C stops everything.

EOF

# Any of them ending ends the stack.
set +e
wait -n "${pids[@]}"
rc=$?
echo "run: a process exited (status $rc)"
exit "$rc"

#!/usr/bin/env bash
# `make demo`: starts the local stack as `make run` does (demo/run.sh, its output in
# target/demo-stack.log), plays demo/story.py against it, stops the stack by PID, and exits
# with the story's status.
set -euo pipefail
PYTHON=${PYTHON:-python3}
log=target/demo-stack.log
mkdir -p target

for port in 10000 9901 8380 8081; do
  if "$PYTHON" -c "import socket,sys; socket.create_connection(('127.0.0.1', $port), timeout=0.3)" 2>/dev/null; then
    echo "demo: 127.0.0.1:$port is in use (is \`make run\` running?): stop it first" >&2
    exit 1
  fi
done

bash demo/run.sh >"$log" 2>&1 &
stack=$!
stop() {
  kill -TERM "$stack" 2>/dev/null || true
  wait "$stack" 2>/dev/null || true
}
trap stop EXIT

set +e
"$PYTHON" demo/story.py --wait 60
rc=$?
set -e
if [ "$rc" -ne 0 ]; then
  echo "demo: the stack's log (last 30 lines of $log):" >&2
  tail -n 30 "$log" >&2
fi
exit "$rc"

"""What bench/throughput.py and bench/peer/run.py share: the scenario shape, one wrk run of
bench/load.lua with its summary and CPU time, and the /proc clocks."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

LOAD_LUA = Path(__file__).resolve().parent / "load.lua"
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    path: str
    mode: str  # none | unique | replay | burst (bench/load.lua)
    size: int
    n: int = 1
    threads: int = 2
    conns: int = 16


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15; all threads)


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all but idle and iowait), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLK_TCK


def wrk_bin() -> str:
    path = os.environ.get("WRK") or shutil.which("wrk")
    if not path:
        raise SystemExit("wrk not found: `apt-get install wrk` (.ci/run installs it), or set WRK")
    return path


def run_wrk(url: str, sc: Scenario, duration: float, seed: str, log: Path) -> tuple[dict, float]:
    """wrk with bench/load.lua against `url` (its output appended to `log`): the run's figures
    from the `WRKJSON` summary it prints (the fields both scripts' `Run` share: rps, p50_ms,
    p90_ms, p99_ms, requests, errors, non2xx, seconds) and wrk's own CPU seconds."""
    argv = [wrk_bin(), "-t", str(sc.threads), "-c", str(sc.conns), "-d", f"{max(1, round(duration))}s", "--timeout",
            "10s", "--latency", "-s", str(LOAD_LUA), url, "--", sc.mode, str(sc.size), seed, str(sc.n)]
    with open(log, "ab") as out:
        out.write(("$ " + " ".join(argv) + "\n").encode())
        out.flush()
        start = out.tell()
        proc = subprocess.Popen(argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
        try:
            # Reaped here, not by subprocess, to get wrk's own CPU time (rusage).
            _, status, ru = os.wait4(proc.pid, 0)
        except BaseException:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
    with open(log, "rb") as f:
        f.seek(start)
        stdout = f.read()
    if proc.returncode != 0:
        raise SystemExit(f"wrk exited {proc.returncode}; see {log}")
    line = next((ln for ln in stdout.decode().splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise SystemExit(f"wrk printed no summary; see {log}")
    w = json.loads(line[len("WRKJSON "):])
    figures = {
        "rps": w["requests"] / (w["duration_us"] / 1e6),
        "p50_ms": w["p50_us"] / 1000, "p90_ms": w["p90_us"] / 1000, "p99_ms": w["p99_us"] / 1000,
        "requests": w["requests"],
        "errors": w["connect"] + w["read"] + w["write"] + w["timeout"],
        "non2xx": w["status"],
        "seconds": w["duration_us"] / 1e6,
    }
    return figures, ru.ru_utime + ru.ru_stime


def medians(runs: list) -> dict:
    """One target's rounds of a scenario: median throughput and latency, summed counts."""
    return {"rps": statistics.median(r.rps for r in runs), "p50": statistics.median(r.p50_ms for r in runs),
            "p99": statistics.median(r.p99_ms for r in runs), "requests": sum(r.requests for r in runs),
            "non2xx": sum(r.non2xx for r in runs), "errors": sum(r.errors for r in runs)}


def wait_still(read, timeout: float = 3.0) -> None:
    """Until `read()` gives the same value twice 50 ms apart (work that lands after the answers:
    commits, stored answers), or `timeout` s."""
    deadline = time.monotonic() + timeout
    last = read()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = read()
        if now == last:
            return
        last = now


class RedisCommands:
    """Redis's command counts (INFO stats and commandstats) less this reader's own INFO calls:
    what the stores sent between two reads, whichever host sent them (idemstore for the wasm
    filter, the module's threads for the native host). `read()` gives (commands, script calls):
    every command Redis ran, those the scripts ran included, and the EVALSHA / EVAL / FCALL
    calls among them (the store's round trips: each of its operations is one script)."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.addr = (host, port)
        self.own = 0

    def read(self) -> tuple[int, int]:
        with socket.create_connection(self.addr, timeout=5) as s:
            s.sendall(b"*3\r\n$4\r\nINFO\r\n$5\r\nstats\r\n$12\r\ncommandstats\r\n")
            buf = b""
            while b"\r\n" not in buf or len(buf) < buf.index(b"\r\n") + 2 + int(buf[1:buf.index(b"\r\n")]):
                chunk = s.recv(65536)
                if not chunk:
                    raise RuntimeError("Redis closed the connection during INFO")
                buf += chunk
        m = re.search(rb"^total_commands_processed:(\d+)", buf, re.M)
        if not m:
            raise RuntimeError("no total_commands_processed in Redis's INFO stats")
        scripts = sum(int(x) for x in re.findall(rb"^cmdstat_(?:evalsha|eval|fcall):calls=(\d+)", buf, re.M))
        # The count includes every earlier INFO of this reader (not this one: it is counted
        # once answered).
        own, self.own = self.own, self.own + 1
        return int(m.group(1)) - own, scripts

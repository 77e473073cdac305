"""What bench/throughput.py and bench/peer/run.py share: the scenario shape, one wrk run of
bench/load.lua with its summary and CPU time, and the /proc clocks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
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
    """wrk with bench/load.lua against `url` (its output appended to `log`): the `WRKJSON`
    summary it prints (counts, latency percentiles in µs) and wrk's own CPU seconds."""
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
    return json.loads(line[len("WRKJSON "):]), ru.ru_utime + ru.ru_stime

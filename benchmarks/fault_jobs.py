"""The fault benchmarks' jobs: a launcher started with its workers' output and pids watched,
the commands that start one, and the small statistics both benchmarks report.

``bench_faults.py`` (unison alone) and ``against_torchft.py`` (beside torchft) share these.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
WORKER = HERE / "fault_worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# ---- jobs and their processes ---------------------------------------------------------
def stat_fields(pid: int) -> list[str]:
    """Fields 3.. of /proc/PID/stat (state, ppid, ...); [] if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return []


class Job:
    """A launcher this benchmark started (``unison launch`` or torchrun); its output, timestamped,
    and its workers: the pids they wrote to OUT/pid-*, kept only while they are children of the
    launcher and run fault_worker.py (so a signal never reaches anything else)."""

    def __init__(self, cmd: list[str], out: Path, timeout: float) -> None:
        self.cmd, self.out, self.timeout = cmd, out, timeout
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
        self.lines: list[tuple[float, str]] = []
        self.timed_out = self.ended_on_false = False
        self.rescued: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def workers(self) -> dict[int, str]:
        """Live workers of this job: pid -> the tag it wrote (its worker id, or e<restart>)."""
        found = {}
        for path in self.out.glob("pid-*"):
            pid = int(path.name.split("-")[1])
            fields = stat_fields(pid)
            if not fields or fields[0] == "Z" or int(fields[1]) != self.proc.pid:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if str(WORKER).encode() not in f.read():
                        continue
                found[pid] = path.read_text()
            except OSError:
                continue
        return found

    def false_failures(self) -> list[dict]:
        """The failures no fault explains that the workers noted (fault_worker.FalseFailureWatch)."""
        notes = []
        for path in sorted(self.out.glob("false-*.json")):
            try:
                notes.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                pass
        return notes

    def wait(self, on_false: str = "note") -> Optional[int]:
        """The launcher's exit code; None if the job was ended by force (past its time limit, or
        on a false failure with ``on_false="end"``). ``on_false="rescue"``: SIGKILL a worker
        stuck after a false failure (it would wait a minute for a membership, holding everyone up),
        so the job goes on as after a kill."""
        handled: set[float] = set()
        while self.proc.poll() is None:
            if time.time() > self.started + self.timeout:
                self.timed_out = True
                self.end()
                return None
            for note in self.false_failures():
                if note["time"] in handled:
                    continue
                handled.add(note["time"])
                if on_false == "end":
                    self.ended_on_false = True
                    self.end()
                    return None
                if on_false == "rescue" and note["pid"] in self.workers():
                    os.kill(note["pid"], signal.SIGKILL)
                    self.rescued.append(note)
            time.sleep(0.1)
        self._reader.join(5)
        self.save()
        return self.proc.returncode

    def save(self) -> None:
        """The launcher's output, timestamped, to OUT/launcher.log."""
        (self.out / "launcher.log").write_text("".join(f"{t:.3f} {line}\n" for t, line in self.lines))

    def end(self) -> None:
        """SIGKILL the launcher and then its workers (found before the launcher goes)."""
        if self.proc.poll() is None:
            pids = list(self.workers())
            self.proc.kill()
            self.proc.wait()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._reader.join(5)
        self.save()

    def tail(self, n: int = 15) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def ft_command(nproc: int, out: Path, *worker_args: Any, respawn: bool = False, preload: str = "") -> list[str]:
    cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--nproc", str(nproc)]
    cmd += ["--respawn"] if respawn else []
    cmd += ["--preload", preload] if preload else []
    return cmd + [str(WORKER), *worker_args[:1], "--out", str(out), *map(str, worker_args[1:])]


def torchrun_command(nproc: int, out: Path, *worker_args: Any, max_restarts: int = 0) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["--max-restarts", str(max_restarts), "--monitor-interval", "0.1"]
    return cmd + [str(WORKER), *worker_args[:1], "--out", str(out), *map(str, worker_args[1:])]


def fresh(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True)
    return path


def steps_of(path: Path) -> list[tuple[float, int, int]]:
    """A worker's step log: (time, committed step, world size) per line."""
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            rows.append((float(parts[0]), int(parts[1]), int(parts[2])))
    return rows


def load_json(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.exists() else None


def median_step(rows: list[tuple[float, int, int]], first: int, last: int) -> float:
    """The median time between consecutive committed steps numbered first..last."""
    times = {s: t for t, s, _ in rows}
    gaps = [times[s] - times[s - 1] for s in range(first + 1, last + 1) if s in times and s - 1 in times]
    return statistics.median(gaps) if gaps else float("nan")


def p95(values: list[float]) -> float:
    """The 95th percentile, linear between order statistics (numpy's default)."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = 0.95 * (len(v) - 1)
    lo = math.floor(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def med(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")

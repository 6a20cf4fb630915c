"""benchmarks/bench_faults.py end to end on tiny settings (real kills, a heal, the overhead
rounds, a short chaos run beside torchrun) and the JSON it writes. Two runs of about 30 s."""

import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_faults.py"


def bench(tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "faults.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), *args, "--json", str(out)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["command"] == "python benchmarks/bench_faults.py " + " ".join([*args, "--json", str(out)])
    assert report["torch"] and report["date"] and report["table"]
    assert report["false_failures"]["committed_steps"] > 0
    return report, done.stdout


def test_kill_heal_and_overhead(tmp_path):
    report, printed = bench(
        tmp_path,
        *("--only", "kill,heal,overhead", "--repeats", "1", "--at", "20"),
        *("--heal-mb", "1", "--chain-after", "10", "--preload", "torch,torch._dynamo,unison"),
        *("--overhead-rounds", "3", "--rounds-per-job", "3", "--overhead-algorithms", "allreduce"),
        *("--overhead-jobs", "0", "--window", "8", "--warmup", "4"),
    )
    kill = report["kill"]
    assert kill["valid"] == 1, kill["repeats"]
    assert 0 < kill["repeats"][-1]["raw_s"] < 10
    heal = report["heal"]["sizes"]["1"]
    assert len(heal["repeats"]) >= 1 and 0 < heal["heal_median_s"] < 10, heal
    assert 0 < heal["process_start_median_s"] < 10
    assert heal["process_start_median_s"] < heal["started_to_first_step_median_s"] < 10  # forked: no imports
    assert heal["imports_median_s"] < 1.0, heal  # torch was imported by the template
    within = report["overhead"]["within_one_job"]
    assert within["rounds_valid"] == 3, within
    assert 0 < within["algorithms"]["allreduce"]["ft_vs_plain"] < 10
    assert "kill latency" in printed and "heal 1 MB" in printed and "overhead allreduce" in printed
    assert "launcher's start to its first step" in printed


def test_goodput_beside_torchrun(tmp_path):
    report, printed = bench(
        tmp_path,
        *("--only", "goodput", "--goodput-rounds", "1"),
        *("--clean-seconds", "1", "--chaos-seconds", "4"),  # one kill, 3.7 s in (--seed 0)
    )
    for kind in ("ft", "elastic"):
        assert report["goodput"][kind]["valid"] == 1, report["goodput"]["rounds"]
        assert math.isfinite(report["goodput"][kind]["goodput_median"])
        assert len(report["goodput"]["rounds"][0][kind]["kills"]) == 1
    assert "goodput ft" in printed and "goodput torchrun" in printed

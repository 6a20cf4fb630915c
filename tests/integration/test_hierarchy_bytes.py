"""benchmarks/hierarchy_bytes.py: each contender's bytes on a node's link against its flat twin's
and against the optimum of its scheme (a bench JSON made up here, with known figures)."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hierarchy_bytes.py"
PARAMS = 1000  # no PowerSGD row here: the workload's model is not built
S = 4 * PARAMS


def contender(spec: str, link: float) -> dict:
    return {"spec": spec, "kind": "unison", "status": "ok", "params": PARAMS, "steps": 40, "link_bytes_per_step": link}


def run(tmp_path, nodes: int, procs: int, results: list) -> dict:
    src, out = tmp_path / "bench.json", tmp_path / "bytes.json"
    doc = {"workload": {"name": "digits"}, "world": {"nodes": nodes, "procs_per_node": procs}, "contenders": results}
    src.write_text(json.dumps(doc))
    done = subprocess.run([sys.executable, str(SCRIPT), str(src), "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return {row["spec"]: row for row in json.loads(out.read_text())["rows"]}


def test_each_hierarchical_row_against_its_flat_twin_and_its_optimum(tmp_path):
    rows = run(
        tmp_path,
        2,
        2,
        [
            contender("allreduce", 1.5 * S),  # 2(N-1)/N S, N = 4
            contender("allreduce:hierarchical=true", 1.05 * S),  # 2(M-1)/M S = S, and 5% of headers
            contender("fp16:hierarchical=true", 0.5 * S),  # no flat twin in this run
            contender("local_sgd:hierarchical=true", S / 16),
            contender("async:hierarchical=true", 123.0),  # per round: no optimum per step
            contender("allreduce:bucket_cap_mb=1", 2 * S),  # another option: not a twin, not a row
        ],
    )
    assert set(rows) == {"allreduce", "allreduce:hierarchical=true", "fp16:hierarchical=true",
                         "local_sgd:hierarchical=true", "async:hierarchical=true"}  # fmt: skip
    hier = rows["allreduce:hierarchical=true"]
    assert abs(hier["vs_flat"] - 0.7) < 1e-9 and abs(hier["optimum"] - S) < 1e-9
    assert abs(hier["vs_optimum"] - 1.05) < 1e-9
    assert rows["fp16:hierarchical=true"]["vs_flat"] is None
    assert abs(rows["fp16:hierarchical=true"]["vs_optimum"] - 1.0) < 1e-9
    assert abs(rows["local_sgd:hierarchical=true"]["vs_optimum"] - 1.0) < 1e-9
    assert rows["async:hierarchical=true"]["optimum"] is None
    assert rows["allreduce"]["optimum"] is None  # flat with 2 processes per node: not two levels


def test_flat_with_one_process_per_node_is_the_optimum(tmp_path):
    """At P = 1 a flat algorithm is its two-level scheme: its row gets the optimum too."""
    rows = run(tmp_path, 2, 1, [contender("bf16", S / 2), contender("low_precision_decentralized", 70.0)])
    assert abs(rows["bf16"]["vs_optimum"] - 1.0) < 1e-9
    codes = PARAMS + 8 * 1  # one 8-bit code per value, a float32 min and scale per chunk of 1024
    assert abs(rows["low_precision_decentralized"]["optimum"] - codes / 16) < 1e-9

"""diloco with a delay on the GPU against the CPU, merge by merge (run on a GPU machine):
``PYTHONPATH=. python tests/scripts/cuda_diloco_merges.py``.

Two gloo ranks share the GPU and train test_cuda's MLP with ``diloco:period=2,fragments=1``
(a delay of 1) on CUDA, then on the CPU; at each merge it prints the sums of the averaged
pseudo-gradient, the weights at launch, the weights before the merge, the global weights and
the weights after. The two devices agree to float rounding at every merge (issue 27's GPU check).
"""

import sys

sys.path[:0] = ["tests", "tests/integration"]
import launch  # noqa: E402
import torch  # noqa: E402
from test_cuda import train  # noqa: E402

import unison.algorithms.averaging.diloco as dm  # noqa: E402

LOG: list = []


def s(ts):
    return round(sum(float(t.detach().double().sum().cpu()) for t in ts), 6)


def probe():
    torch.cuda.set_device(0)
    real = dm.DiLoCo.merge

    def merge(self, replica, state, fragment, result, extra):
        params, _ = self._tensors(state, fragment)
        row = {"avg": s(result), "at_launch": s(extra or []), "before": s(params)}
        snap_before = s([state.snapshot[i] for i in state.fragments[fragment]])
        real(self, replica, state, fragment, result, extra)
        row.update(snap=snap_before, after=s(params))
        LOG.append(row)

    dm.DiLoCo.merge = merge
    out = {}
    for device in ("cuda", "cpu"):
        LOG.clear()
        r = train("diloco:period=2,fragments=1", device)
        out[device] = {"merges": list(LOG), "losses": [round(x, 6) for x in r["losses"]]}
    return out


if __name__ == "__main__":
    results = launch.run(probe, 2, timeout=150)
    r = results[0]
    print("losses cuda", r["cuda"]["losses"])
    print("losses cpu ", r["cpu"]["losses"])
    for a, b in zip(r["cuda"]["merges"], r["cpu"]["merges"]):
        print("cuda", a)
        print("cpu ", b)

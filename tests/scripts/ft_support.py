"""Every algorithm spec through a fault-tolerant construction and a fault-tolerant ``switch_to``,
under ``unison launch --fault-tolerant`` (tests/integration/test_support.py): each worker writes
OUT/<pid>.json, {spec: [built's answer, switched's answer]}, an answer None or [type, message].

    python -m unison launch --fault-tolerant --nproc 2 tests/scripts/ft_support.py --out DIR SPEC...
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial

import torch
from torch import nn

import unison


def answer(attempt) -> object:
    try:
        attempt()
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("specs", nargs="+")
    args = p.parse_args()
    unison.init()
    torch.manual_seed(0)

    def built(spec: str) -> None:
        net = nn.Linear(4, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        unison.DataParallel(net, optimizer=opt, algorithm=spec, fault_tolerant=True).close()

    def switched(spec: str) -> None:
        net = nn.Linear(4, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        model = unison.DataParallel(net, optimizer=opt, algorithm="allreduce", fault_tolerant=True)
        try:
            model.switch_to(spec)
        finally:
            model.close()

    found = {spec: [answer(partial(built, spec)), answer(partial(switched, spec))] for spec in args.specs}
    with open(os.path.join(args.out, f"{os.getpid()}.json"), "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    main()

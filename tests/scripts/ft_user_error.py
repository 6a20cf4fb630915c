"""A fault-tolerant job whose script has a bug at step 3: its comm hook raises an error whose
message mentions gloo and a timeout (worker 0 a ValueError, the others a RuntimeError).

Run under `unison launch --fault-tolerant`. The error is the user's: every worker must raise it
at once, never regroup and try the step again (telling failures apart by message text did).
"""

import argparse

import torch
from torch import nn

import unison


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    unison.init()
    torch.manual_seed(0)
    net = nn.Linear(8, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = unison.DataParallel(net, optimizer=opt, fault_tolerant=True)
    me = model.ft.worker_id

    def hook(state, bucket):
        if model.ft.step == 3:
            if me == 0:
                raise ValueError("gloo: the operation timed out (a user's own error)")
            raise RuntimeError("gloo: Connection closed, timed out (a user's own error)")
        tensor = bucket.buffer().div_(model.ft.world_size)
        work = torch.distributed.all_reduce(tensor, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    model.register_comm_hook(None, hook)
    while model.ft.step < args.steps:
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()


if __name__ == "__main__":
    main()

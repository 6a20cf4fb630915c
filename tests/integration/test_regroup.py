"""Building the job's group again after a failed build (fault tolerance's regroup)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from launch import run

from unison.fault.member import build_world


def _build_after_a_failed_build():
    rank = dist.get_rank()
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.destroy_process_group()  # as a regroup abandons the old membership's group
    if rank == 0:  # a build whose other member never comes (it died before the rendezvous)
        try:
            build_world(dist.PrefixStore("regroup/1/", client), 0, 2, datetime.timedelta(seconds=1))
        except RuntimeError:
            pass
        else:
            raise AssertionError("a build without its second member succeeded")
    # The next membership: rank 0 after its failed build, rank 1 as fresh as a joiner.
    build_world(dist.PrefixStore("regroup/2/", client), rank, 2, datetime.timedelta(seconds=15))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_a_member_whose_group_build_failed_builds_the_next_one_with_a_fresh_joiner():
    """A failed build had counted one more group in torch's naming: the member then looked for
    the next rendezvous under another name than the joiner's, and every build failed for good
    (the chaos runs hung, regrouping the same members every 10 s)."""
    assert run(_build_after_a_failed_build, world=2, timeout=60) == [3.0, 3.0]

"""A fault-tolerant job whose every step is checkable: the exactly-once ledger.

Run under `unison launch --fault-tolerant`. At step s every rank's gradient is
the one-hot vector e_s and SGD has lr 1, so after T steps the weights are
exactly -1 in each of the first T places if every step was applied once (a
doubled step shows -2, a lost one 0). Faults are injected by the victim itself:
`--kill ID@STEP[:after]` SIGKILLs worker ID at that step (before its reduction,
or after its optimizer step), `--stop ID@STEP` SIGSTOPs it, `--busy ID@STEP:SECONDS` keeps it
computing that long with no turn for its other threads (its heartbeat's included: a process starved
of CPU, or in one long call that holds the GIL; OUT/busy-<pid> is [start, end]), `--leave ID@STEP`
leaves gracefully after that step. Each worker writes OUT/<id>.json (with its node and its
topology's local rank, local world size and node index at the end).

For runs driven from outside (tests/integration/test_fault_chaos.py): every worker writes
OUT/pid-<pid> (its worker id) before it joins, OUT/joined-<pid> (the membership it was admitted
to, as JSON) once it is a member and before its heal, and OUT/ready-<pid> once healed.
`--pad-mb N` adds a frozen parameter of N MiB (no gradient, no reduction: it only makes the heal
payload big; its checksum is in the result); `--origin` adds a frozen parameter holding the
membership epoch that created the model (1; a joiner's own is its admission epoch until healed),
so a job that silently started over from a joiner's fresh state shows; `--hurry-file PATH` drops
the sleep once PATH exists (steps stay fixed, so every member stops at the same committed step).
`--ramp` scales step s's gradient by (steps - s): every value differs, so a top-k picks without ties.
`--switch-to NAME@STEP` switches the algorithm before that step. `--group world` passes the job's
group as process_group (`first-two`: a group of ranks 0 and 1).
`--hold-heal ID@PATH` makes worker ID, healed, stop as it is about to ask for the second piece of
its heal until PATH exists (a minute at most; once it exists, no heal stops), and write
OUT/held-<pid> (its sources' worker ids and the heal's number of pieces) as it stops: a test acts
while the sources still hold pieces to send, whatever the machine's load.
`--kill-building ID` SIGKILLs worker ID inside its first `DataParallel(...)`, as the gradient
engine starts building its groups, once every member has begun building its wrapper: the others
are then inside that group's rendezvous, whatever the machine's load.
`--kill-node-groups ID` SIGKILLs worker ID inside `unison.init()`, as it starts building its node
groups (nodes of several processes): the others are then inside those groups' rendezvous.
`--algorithm no_recovery` is allreduce declaring no Recovery (refused under fault tolerance).
`--matrices N` adds two trainable N x N matrices, each in a bucket of its own, whose gradient at step
s is worker i's (i+1)^2 times a fixed random matrix of s (full rank: powersgd keeps a residual); their
values are in the result's "mats". `--kill ID@STEP:mid` SIGKILLs worker ID inside step STEP's gradient
round, right after its first powersgd bucket with a matrix is reduced (on the comm thread): the others
have that bucket's round done and the next one broken.
`--kill ID@STEP:between` SIGKILLs worker ID in step STEP, as its model-averaging round is about to
launch, once every process of the other local ranks has completed its own round of that step (each
writes OUT/round-<local rank>-<pid> as its wait returns, before the round is applied): a node's
rounds then end one way on one local rank and the other way on the other, with no timing to hope for.
`--shard` shards the ledger with FSDP2 over the node's processes (`unison.node_mesh()`): each
process trains its half of the weights, and its replicas are the same local rank on the other nodes.
The weights are read after `model.flush()` (nonblocking applies the last step at the next forward).
`--hurry-after-heal` drops the sleep on a joiner, and on the others once they have been in a heal
(sent or received) after a regroup: a slow pace until a replacement has healed in, whatever its
start takes, then the rest at full speed.
`--save PATH` has every process call `unison.save(PATH, model, opt, step=...)` after its last step
(`--save-at STEP`: after that step too; `--kill ID@STEP:save` SIGKILLs worker ID inside that save,
as DCP starts writing: the others are then inside DCP's collectives)
(the result's "momentum" and "snapshot": its local shards of SGD's momentum and diloco's global
weights then); with `--reload`, every process then zeroes all three and `unison.load`s them back
(the result's "reloaded").
"""

import argparse
import json
import os
import pathlib
import signal
import sys
import time
from typing import Callable

import torch
from torch import nn

import unison
import unison.optim
from unison.algorithms.gradient.allreduce import AllReduce
from unison.engine import comm
from unison.fault import member
from unison.runtime import ending
from unison.runtime import launch as launch_module
from unison.sharded import local  # a tensor's values on this process: its local shard if FSDP2 sharded it

PAD_MOD = 9973


class Ledger(nn.Module):
    def __init__(self, n: int, pad_mb: float = 0.0, joiner: bool = False, origin: int = 0, matrices: int = 0) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))
        self.mats = nn.ParameterList(
            [nn.Parameter(torch.zeros(matrices, matrices)) for _ in range(2 if matrices else 0)]
        )
        if origin:
            self.origin = nn.Parameter(torch.tensor([float(origin)]), requires_grad=False)
        if pad_mb:
            # The job's pad is not zeros, and a joiner's own is -1 until its heal carries the values in.
            pad = torch.arange(int(pad_mb * 2**18), dtype=torch.float32).remainder_(PAD_MOD)
            self.pad = nn.Parameter(pad.fill_(-1.0) if joiner else pad, requires_grad=False)

    def forward(self, x: torch.Tensor, *rs: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum() + sum((mat * r).sum() for mat, r in zip(self.mats, rs))


@unison.algorithms.register
class NoRecovery(AllReduce):
    """allreduce declaring no Recovery: what fault tolerance refuses."""

    name = "no_recovery"
    recovery = None


def kill_mid() -> Callable[[], None]:
    """Patch powersgd so that, once armed (the returned function), this worker SIGKILLs itself
    right after its next bucket reduction that compresses a matrix (a pause first: what it sent
    reaches the others)."""
    from unison.algorithms.gradient.powersgd import PowerSGD

    reduce, armed = PowerSGD._compressed_reduce, []

    def reduce_then_die(self, state, bucket, plan, *rest):
        reduce(self, state, bucket, plan, *rest)
        if armed and plan.compressed:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)

    PowerSGD._compressed_reduce = reduce_then_die
    return lambda: armed.append(True)


def kill_between(args, step: int, now: list[int], victim: bool) -> None:
    """Patch the streamed algorithms' rounds for ``--kill ID@STEP:between`` (``now[0]``: the step
    the loop is in): every process marks its round of ``step`` completed as its wait returns; the
    ``victim`` SIGKILLs itself as its own is about to launch, once every process of the other local
    ranks has marked theirs (a minute at most)."""
    from unison.algorithms.streaming import Streams

    topo = unison.topology()
    others = topo.num_nodes * (topo.local_world_size - 1)
    advance, land = Streams.advance, Streams._land

    def advance_or_die(self, local_step):
        if victim and now[0] == step and self.stagger.launching(local_step):
            deadline = time.time() + 60
            mine = f"round-{topo.local_rank}-"
            while time.time() < deadline:
                marks = [n for n in os.listdir(args.out) if n.startswith("round-") and not n.startswith(mine)]
                if len(marks) >= others:
                    break
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        advance(self, local_step)

    def land_and_mark(self, f):
        pending = self.inflight[f][1]
        wait = pending.wait

        def wait_and_mark():
            result = wait()
            if now[0] == step:
                mark(args, f"round-{topo.local_rank}", str(step))
            return result

        pending.wait = wait_and_mark
        return land(self, f)

    Streams.advance, Streams._land = advance_or_die, land_and_mark


def at(text):
    if text is None:
        return None
    who, _, rest = text.partition("@")
    step, _, when = rest.partition(":")
    return int(who), int(step), when or "before"


def main() -> None:
    # The ledger's processes are the tests' own, run some 150 times a suite: their end skips the
    # interpreter's last cycle collections (about 1 s of CPU each). The ordinary end of a script is
    # tested by test_exit, test_launcher, test_examples and benchmarks/stress_exit.py.
    ending.quick_exit()
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--algorithm", default="allreduce")
    p.add_argument("--sleep", type=float, default=0.02)
    p.add_argument("--kill", action="append", default=[])
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--busy", action="append", default=[])
    p.add_argument("--leave", default=None)
    p.add_argument("--square", action="store_true", help="worker i's gradient is (i+1)^2 e_s (who contributes shows)")
    p.add_argument(
        "--ramp", action="store_true", help="step s's gradient is scaled by steps - s (distinct, largest first)"
    )
    p.add_argument("--average-at-end", action="store_true", help="model.average() before writing the weights")
    p.add_argument("--pad-mb", type=float, default=0.0, help="a frozen parameter of this many MiB (a big heal)")
    p.add_argument("--origin", action="store_true", help="a frozen parameter: the epoch that created the state")
    p.add_argument("--hurry-file", default=None, help="once this file exists, steps no longer sleep")
    p.add_argument("--hurry-after-heal", action="store_true", help="no more sleep once a replacement healed in")
    p.add_argument("--save", default=None, help="unison.save(SAVE, model, opt) after the last step")
    p.add_argument("--save-at", type=int, default=None, help="with --save: after this step too")
    p.add_argument("--reload", action="store_true", help="after --save: zero, then unison.load it back")
    p.add_argument("--switch-to", default=None, help="NAME@STEP: model.switch_to(NAME) before step STEP")
    p.add_argument("--group", choices=["world", "first-two"], default=None, help="pass this process_group")
    p.add_argument("--hold-heal", default=None, help="ID@PATH: worker ID's heal stops after a piece until PATH exists")
    p.add_argument("--kill-building", type=int, default=None, help="this worker dies building its groups")
    p.add_argument("--kill-node-groups", type=int, default=None, help="this worker dies building its node groups")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD's momentum (its buffers heal too; no ledger)")
    p.add_argument("--shard", action="store_true", help="FSDP2 over the node's processes (unison.node_mesh())")
    p.add_argument("--matrices", type=int, default=0, help="two N x N matrices, a bucket each (see above)")
    args = p.parse_args()
    try:
        run(args)
    except unison.RankFailure as exc:
        with open(os.path.join(args.out, f"failed-{os.getpid()}.json"), "w") as f:
            json.dump({"time": time.time(), "message": str(exc)}, f)
        raise


def mark(args, name: str, text: str) -> None:
    """Write OUT/<name>-<pid> whole (a reader never sees it half written)."""
    path, hidden = (os.path.join(args.out, f"{dot}{name}-{os.getpid()}") for dot in ("", "."))
    with open(hidden, "w") as f:
        f.write(text)
    os.replace(hidden, path)


def hold_heal(args, path: str) -> None:
    """As this worker's heal is about to ask for its second piece (the first asked for, the rest
    not), write OUT/held-<pid> (the worker ids of the heal's sources, its number of pieces) and wait
    until ``path`` exists (a minute at most): its sources are left with pieces they cannot send."""
    receive, post = comm._receive_pieces, comm._p2p

    def held(tensors, sources, group, wire):
        posted = [0]

        def post_or_hold(send, *a, **k):
            if not send:
                posted[0] += 1
                if posted[0] == 2 and not os.path.exists(path):
                    members = member.active().members
                    ids = [members[comm.src_rank(group, r)] for r in sources]
                    pieces = len(comm._pieces([t.numel() for t in tensors], comm.STAGING_BYTES))
                    mark(args, "held", json.dumps({"sources": ids, "pieces": pieces}))
                    deadline = time.time() + 60
                    while not os.path.exists(path) and time.time() < deadline:
                        time.sleep(0.01)
            return post(send, *a, **k)

        comm._p2p = post_or_hold
        try:
            return receive(tensors, sources, group, wire)
        finally:
            comm._p2p = post

    comm._receive_pieces = held


def busy(args, seconds: float) -> None:
    """Compute for ``seconds`` without letting this process's other threads run (``--busy``): the
    GIL's switch interval raised past it, the heartbeat thread waits for the GIL all that time."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 60)
    started = time.time()
    try:
        while time.time() - started < seconds:
            pass
    finally:
        sys.setswitchinterval(interval)
    mark(args, "busy", json.dumps([started, time.time()]))


def healed_in(model, joiner: bool) -> bool:
    """``--hurry-after-heal``: whether this process is past the heal of a replacement (a joiner is):
    a heal after a regroup (the one every member receives as the job starts comes before any)."""
    regrouped = False
    for event in model.ft.events:
        regrouped = regrouped or event.kind == "regroup"
        if regrouped and event.kind in ("heal_send", "heal_recv"):
            return True
    return joiner


def kill_in_save() -> None:
    """SIGKILL this worker as ``unison.save`` calls torch.distributed.checkpoint's save."""
    import torch.distributed.checkpoint as dcp

    dcp.save = die


def save_and_reload(args, model, net, opt) -> dict:
    """``--save``: every process saves the model (its shards, momentum, algorithm state); with
    ``--reload``, zeroes its weights, momentum and diloco's global weights and loads them back."""

    def momentum():
        return local(opt.state[net.w]["momentum_buffer"]).tolist() if opt.state.get(net.w) else None

    def snapshot():  # diloco's global weights (of this process's shard)
        return [t.tolist() for t in getattr(model.algorithm_state, "snapshot", [])]

    out = {"momentum": momentum(), "snapshot": snapshot(), "replica": model.rank}
    unison.save(args.save, model, opt, step=model.ft.step, extra={"members": model.ft.members})
    if args.reload:
        with torch.no_grad():
            local(net.w).zero_()
            if opt.state.get(net.w):
                local(opt.state[net.w]["momentum_buffer"]).zero_()
            for t in getattr(model.algorithm_state, "snapshot", []):
                t.zero_()
        wiped = [net.w.full_tensor().detach().tolist(), momentum(), snapshot()]
        state = unison.load(args.save, model, opt)
        full = net.w.full_tensor().detach().tolist()
        out["reloaded"] = {"w": full, "momentum": momentum(), "snapshot": snapshot(), "state": state, "wiped": wiped}
    return out


def die(*args, **kwargs) -> None:
    """SIGKILL this worker (put in place of what it must die inside)."""
    os.kill(os.getpid(), signal.SIGKILL)


def kill_building(args) -> None:
    """SIGKILL this worker when the gradient engine asks for its first group, once every member has
    begun building its wrapper (each writes OUT/wrapping-<pid> first): the others are then inside
    DataParallel(...), where fault tolerance sees the failure, not still inside unison.init()."""

    def die_once_every_member_builds(*_args, **_kwargs) -> None:
        deadline = time.time() + 60
        members = len(member.active().members)
        while len(list(pathlib.Path(args.out).glob("wrapping-*"))) < members and time.time() < deadline:
            time.sleep(0.02)
        die()

    comm.private_group = die_once_every_member_builds


def kill_node_groups() -> None:
    """SIGKILL this worker when init() starts building its node groups."""
    launch_module._subgroups = die


def run(args) -> None:
    mark(args, "pid", os.environ.get("UNISON_FT_ID", "?"))
    if args.hold_heal and os.environ.get("UNISON_FT_ID") == args.hold_heal.partition("@")[0]:
        hold_heal(args, args.hold_heal.partition("@")[2])
    if args.kill_building is not None and os.environ.get("UNISON_FT_ID") == str(args.kill_building):
        kill_building(args)
    if args.kill_node_groups is not None and os.environ.get("UNISON_FT_ID") == str(args.kill_node_groups):
        kill_node_groups()
    unison.init()
    m = member.active()
    joined = {"id": m.id, "node": m.node, "epoch": m.epoch, "members": m.members, "time": time.time()}
    mark(args, "joined", json.dumps(joined))
    torch.manual_seed(0)
    net = Ledger(
        args.steps, args.pad_mb, joiner=m.epoch > 1, origin=m.epoch if args.origin else 0, matrices=args.matrices
    )
    if args.shard:
        from torch.distributed.fsdp import fully_shard

        fully_shard(net, mesh=unison.node_mesh())
    if args.algorithm.startswith("qadam"):
        opt = unison.optim.QAdamOptimizer(net.parameters(), lr=0.1, warmup_steps=5)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=1.0, momentum=args.momentum)
    group = None
    if args.group == "world":
        group = torch.distributed.group.WORLD
    elif args.group == "first-two":
        group = torch.distributed.new_group([0, 1])
    cap = {"bucket_cap_mb": args.matrices**2 * 4 / 2**20} if args.matrices else {}  # a matrix per bucket
    mark(args, "wrapping", str(m.id))
    model = unison.DataParallel(
        net, optimizer=opt, algorithm=args.algorithm, fault_tolerant=True, process_group=group, **cap
    )
    mark(args, "ready", str(model.ft.step))
    me = model.ft.worker_id
    kills = [at(k) for k in args.kill]
    arm = kill_mid() if any(who == me and when == "mid" for who, _, when in kills) else None
    now = [model.ft.step]  # the step the loop is in, for --kill ID@STEP:between
    for who, step, when in kills:
        if when == "between":
            kill_between(args, step, now, victim=who == me)
        if when == "save" and who == me:
            kill_in_save()
    stops = [at(k) for k in args.stop]
    spells = [at(k) for k in args.busy]
    leave = at(args.leave)
    first_step = model.ft.step
    healed = local(net.w).tolist()
    while model.ft.step < args.steps:
        s = now[0] = model.ft.step
        for who, step, when in kills:
            if who == me and step == s and when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
        for who, step, _ in stops:
            if who == me and step == s:
                with open(os.path.join(args.out, "stopped"), "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
        for who, step, seconds in spells:
            if who == me and step == s:
                busy(args, float(seconds))
        if args.switch_to and int(args.switch_to.rpartition("@")[2]) == s:
            model.switch_to(args.switch_to.rpartition("@")[0])
        hurried = args.hurry_after_heal and healed_in(model, joiner=joined["epoch"] > 1)
        if not hurried and (args.hurry_file is None or not os.path.exists(args.hurry_file)):
            time.sleep(args.sleep)
        opt.zero_grad()
        x = torch.zeros(args.steps)
        x[s] = float((me + 1) ** 2) if args.square else 1.0
        if args.ramp:
            x[s] *= args.steps - s
        rs = [
            torch.randn(mat.shape, generator=torch.Generator().manual_seed(1000 * s + k))
            for k, mat in enumerate(net.mats)
        ]
        loss = model(x, *[r * float((me + 1) ** 2) for r in rs])
        if arm is not None and any(who == me and step == s and when == "mid" for who, step, when in kills):
            arm()
        loss.backward()
        opt.step()
        for who, step, when in kills:
            if who == me and step == s and when == "after":
                os.kill(os.getpid(), signal.SIGKILL)
        if args.save and args.save_at == s:
            unison.save(args.save, model, opt, step=model.ft.step)
        if leave is not None and leave[0] == me and leave[1] == s:
            model.ft.leave()
            break
    if args.average_at_end:
        model.average()
    model.flush()  # a step recorded and not yet applied (nonblocking) goes into the weights
    saved = save_and_reload(args, model, net, opt) if args.save else {}
    result = {
        **saved,
        "id": me,
        "w": (net.w.full_tensor() if args.shard else net.w).detach().tolist(),
        "shard": local(net.w).tolist(),
        "mats": [v for mat in net.mats for v in mat.detach().reshape(-1).tolist()],
        "step": model.ft.step,
        "first_step": first_step,
        "healed": healed,
        "pad": float(net.pad.double().sum()) if args.pad_mb else None,
        "origin": int(net.origin.item()) if args.origin else None,
        "admitted": m.epoch,
        "world": model.ft.world_size,
        "members": model.ft.members,
        "node": m.node,
        "topology": [unison.topology().local_rank, unison.topology().local_world_size, unison.topology().node],
        "events": [[e.time, e.kind, e.detail] for e in model.ft.events],
    }
    with open(os.path.join(args.out, f"{me}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

"""The "decentralized" and "low_precision_decentralized" algorithms on 2, 3 and 4 real gloo ranks.

Most checks use an idle round: every rank sets its weights to its own values,
then calls ``optimizer.step()`` with no gradients, so the weights change only
by the algorithm's mixing round, which is then compared with the same mixing
computed by hand from every rank's pre-round weights.
"""

import copy

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP, BNNet, batch, image_batch
from scenarios import spread_across_ranks

import unison
from unison.algorithms.averaging.decentralized import ring_neighbours, round_robin_partner


class TwoDtypes(torch.nn.Module):
    """Parameters of two dtypes: two flat buffers travel between each pair of ranks."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)
        self.extra = torch.nn.Parameter(torch.randn(300, dtype=torch.float64))

    def forward(self, x):
        return self.lin(x) + self.extra.sum().float() * 0


def make(algorithm, net=None, momentum=0.0, **options):
    """An MLP (or ``net``) wrapped with ``algorithm``, and its SGD optimizer."""
    torch.manual_seed(0)
    net = net or MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=momentum)
    options.setdefault("communication_interval", 1)  # these tests look at single rounds
    if (
        algorithm == "decentralized"
    ):  # ... of the classic, blocking schedule (tests/test_streaming.py: the streamed one)
        options.setdefault("fragments", 1)
        options.setdefault("delay", 0)
    model = unison.DataParallel(net, optimizer=opt, algorithm=unison.algorithms.create(algorithm, **options))
    return net, opt, model


def weights(net):
    """All parameters, flat, in float64 (exact for float32 and float64 ones)."""
    return torch.cat([p.detach().double().reshape(-1) for p in net.parameters()])


def unflat(net, flat):
    """``flat`` (as ``weights`` gives) cut back into per-parameter tensors."""
    out, offset = [], 0
    for p in net.parameters():
        out.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return out


def gather(t):
    """Every rank's ``t``, indexed by rank."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def perturb(net, seed):
    """Give this rank its own weights (different on every rank and for every seed)."""
    g = torch.Generator().manual_seed(100 * seed + dist.get_rank())
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g))


def idle_round(net, opt, seed):
    """Perturb, then run one round with no gradient; returns every rank's pre-round weights."""
    perturb(net, seed)
    before = gather(weights(net))
    opt.zero_grad(set_to_none=True)
    opt.step()
    return before


def train(model, opt, steps, start=0):
    rank = dist.get_rank()
    for s in range(start, start + steps):
        x, y = batch(s, rank)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def ring_average(before, rank):
    """(x_{i-1} + x_i + x_{i+1}) / 3, each distinct member of the neighbourhood once."""
    members = [rank] + ring_neighbours(rank, len(before))
    return sum(before[r] for r in members) / len(members)


def lowprec_copies(model):
    """This rank's public copy and replicas (by neighbour rank), flat in parameter order."""
    state = model.algorithm_state.state_dict()
    names = [n for n, _ in model.module.named_parameters()]

    def flat(d):
        return torch.cat([d[n].reshape(-1) for n in names])

    return {"public": flat(state["public"]), "replicas": {peer: flat(r) for peer, r in state["replicas"].items()}}


def distance_to_neighbours(before, rank):
    """|x_i - mean of its ring neighbours| for this rank."""
    nb = ring_neighbours(rank, len(before))
    return (before[rank] - sum(before[r] for r in nb) / len(nb)).norm().item()


# ---- decentralized ------------------------------------------------------------


def all_peers():
    """ "all": an idle round is the plain average; training keeps replicas identical."""
    rank = dist.get_rank()
    net, opt, model = make("decentralized", peer_selection="all")
    before = idle_round(net, opt, 1)
    out = {
        "vs_mean": (weights(net) - sum(before) / len(before)).abs().max().item(),
        "spread_idle": spread_across_ranks(net),
    }
    spreads = []
    for s in range(3):
        train(model, opt, 1, start=s)
        spreads.append(spread_across_ranks(net))
    out["spreads_training"] = spreads
    out["bytes"] = model.algorithm_state.bytes_sent
    out["rank"] = rank
    return out


def shift_one_rounds():
    """Three "shift_one" rounds: each rank's partner, found from the weights, and the exactness of the average."""
    rank = dist.get_rank()
    net, opt, model = make("decentralized", peer_selection="shift_one")
    partners, exact = [], []
    for rnd in range(3):
        before = idle_round(net, opt, rnd + 1)
        after = weights(net)
        mine = before[rank].float()
        matches = [
            j for j in range(len(before)) if j != rank and torch.equal(after.float(), (mine + before[j].float()) / 2)
        ]
        partners.append(matches)
        exact.append(len(matches) == 1)
    bytes_per_round = model.algorithm_state.bytes_sent / 3
    numel = weights(net).numel()
    state = model.state_dict()["_unison_algorithm"]["state"]
    return {
        "partners": partners,
        "exact": exact,
        "bytes_per_round": bytes_per_round,
        "numel": numel,
        "steps": state["steps"],
    }


def momenta_spread(opt):
    """Largest difference of a momentum buffer between ranks."""
    momenta = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for g in opt.param_groups for p in g["params"]])
    both = gather(momenta)
    return max((m - momenta).abs().max().item() for m in both)


def ring_round():
    """An idle "ring" round, then training with momentum and a final average (optimizer states included)."""
    rank = dist.get_rank()
    net, opt, model = make("decentralized", peer_selection="ring", momentum=0.9)
    before = idle_round(net, opt, 1)
    gap = (weights(net) - ring_average(before, rank)).abs().max().item()
    bytes_sent = model.algorithm_state.bytes_sent
    train(model, opt, 3)
    out = {"gap": gap, "bytes": bytes_sent, "numel": weights(net).numel(), "momenta_spread": momenta_spread(opt)}
    model.average()
    out["spread_after_average"] = spread_across_ranks(net)
    out["momenta_spread_after_average"] = momenta_spread(opt)
    return out


# ---- low_precision_decentralized ----------------------------------------------


def lowprec_rounds():
    """An idle round, some training, a final average; the replicas stay bit-identical throughout."""
    rank = dist.get_rank()
    net, opt, model = make("low_precision_decentralized")
    before = idle_round(net, opt, 1)
    after = weights(net)
    copies = lowprec_copies(model)
    nb = ring_neighbours(rank, len(before))
    # The mixing, by hand from the post-round copies, in the algorithm's order.
    by_hand = copies["public"].clone()
    for peer in nb:
        by_hand.add_(copies["replicas"][peer])
    by_hand.div_(len(nb) + 1)
    out = {
        "formula_gap": (after - by_hand).abs().max().item(),
        "spread_idle": spread_across_ranks(net),
        "ring_gap": (after - ring_average(before, rank)).abs().max().item(),
        "distance_before": distance_to_neighbours(before, rank),
        "distance_after": distance_to_neighbours(gather(after), rank),
        "copies_idle": copies,
        "bytes_idle": model.algorithm_state.bytes_sent,
        "numel": after.numel(),
    }
    train(model, opt, 4)
    out["copies_trained"] = lowprec_copies(model)
    out["spread_before_average"] = spread_across_ranks(net)
    model.average()
    out["spread_after_average"] = spread_across_ranks(net)
    return out


def lowprec_checkpoint():
    """Own checkpoints restore the trajectory exactly; rank 0's loaded everywhere leaves consistent replicas."""
    net, opt, model = make("low_precision_decentralized")
    train(model, opt, 3)
    saved = copy.deepcopy(model.state_dict())  # the module's entries alias the live weights
    algo_saved = saved["_unison_algorithm"]["state"]
    train(model, opt, 2, start=3)
    first = weights(net)
    model.load_state_dict(saved)
    round_trip = model.algorithm_state.state_dict()
    same_state = (
        round_trip["steps"] == algo_saved["steps"]
        and all(torch.equal(round_trip["public"][n], t) for n, t in algo_saved["public"].items())
        and all(
            torch.equal(round_trip["replicas"][p][n], t)
            for p, r in algo_saved["replicas"].items()
            for n, t in r.items()
        )
    )
    train(model, opt, 2, start=3)
    second = weights(net)
    # Rank 0's checkpoint loaded on every rank.
    box = [saved if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    model.load_state_dict(box[0])
    train(model, opt, 2, start=5)
    return {
        "same_state": same_state,
        "resumed_gap": (first - second).abs().max().item(),
        "copies_from_rank0": lowprec_copies(model),
    }


def replicas_consistent(results, key):
    """Each rank's replica of a neighbour equals that neighbour's public copy, bit for bit."""
    bad = []
    for r, res in enumerate(results):
        for peer, replica in res[key]["replicas"].items():
            if not torch.equal(replica, results[peer][key]["public"]):
                bad.append((r, peer))
    return bad


# ---- the launched groups -------------------------------------------------------


def four_ranks():
    results = {}
    checks = {
        "all": all_peers,
        "shift_one": shift_one_rounds,
        "ring": ring_round,
        "lowprec": lowprec_rounds,
        "checkpoint": lowprec_checkpoint,
    }
    for name, fn in checks.items():
        results[name] = fn()
        dist.barrier()
    return results


def two_ranks():
    rank = dist.get_rank()
    out = {"all": all_peers(), "ring": ring_round(), "lowprec": lowprec_rounds()}
    # Two dtypes: each keeps its own flat buffer and message.
    for algo in ("decentralized", "low_precision_decentralized"):
        options = {"peer_selection": "ring"} if algo == "decentralized" else {}
        net, opt, model = make(algo, net=TwoDtypes(), **options)
        before = idle_round(net, opt, 3)
        expected = unflat(net, ring_average(before, rank))
        out[f"two_dtypes_{algo}"] = {
            "gap": max((p.detach().double() - e).abs().max().item() for p, e in zip(net.parameters(), expected)),
            "spread": spread_across_ranks(net),
        }
    # communication_interval: replicas drift for two steps and meet at the third.
    net, opt, model = make("decentralized", communication_interval=3)
    spreads = []
    for s in range(6):
        train(model, opt, 1, start=s)
        spreads.append(spread_across_ranks(net))
    out["interval_spreads"] = spreads
    # With every-step averaging of all, plain SGD follows gradient averaging.
    torch.manual_seed(0)
    base = MLP()
    nets = [MLP(), MLP()]
    models, opts = [], []
    every_step = unison.algorithms.create("decentralized", communication_interval=1)
    for n, algo in zip(nets, ("allreduce", every_step)):
        n.load_state_dict(base.state_dict())
        o = torch.optim.SGD(n.parameters(), lr=0.05)
        models.append(unison.DataParallel(n, optimizer=o, algorithm=algo))
        opts.append(o)
    for m, o in zip(models, opts):
        train(m, o, 4)
    out["vs_allreduce"] = (weights(nets[0]) - weights(nets[1])).abs().max().item()
    # BatchNorm statistics stay local until model.average().
    bn, opt, model = make("decentralized", net=BNNet())
    for s in range(3):
        x, y = image_batch(s, rank)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    buffers = torch.cat([b.float().reshape(-1) for b in bn.buffers()])
    both = gather(buffers)
    out["bn_buffer_spread"] = (both[0] - both[1]).abs().max().item()
    out["bn_param_spread"] = spread_across_ranks(torch.nn.ParameterList(bn.parameters()))
    model.average()
    out["bn_spread_after_average"] = spread_across_ranks(bn)
    # No optimizer: refused on every rank.
    try:
        unison.DataParallel(MLP(), algorithm="low_precision_decentralized")
        out["no_optimizer"] = None
    except ValueError as e:
        out["no_optimizer"] = str(e)
    return out


def three_ranks():
    rank = dist.get_rank()
    out = {}
    try:
        make("decentralized", peer_selection="shift_one")
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    net, opt, model = make("decentralized", peer_selection="ring")
    before = idle_round(net, opt, 1)
    out["ring_vs_mean"] = (weights(net) - sum(before) / 3).abs().max().item()
    out["lowprec"] = lowprec_rounds()
    out["rank"] = rank
    return out


@pytest.fixture(scope="module")
def four():
    return launch.run(four_ranks, 4, timeout=120)


@pytest.fixture(scope="module")
def two():
    return launch.run(two_ranks, 2, timeout=120)


# ---- the pairing, in-process ----------------------------------------------------


@pytest.mark.parametrize("world", [2, 4, 6, 8])
def test_round_robin_meets_everyone_once_per_cycle(world):
    seen = set()
    for rnd in range(world - 1):
        partners = [round_robin_partner(r, world, rnd) for r in range(world)]
        assert all(partners[p] == r and p != r for r, p in enumerate(partners))
        seen |= {frozenset((r, p)) for r, p in enumerate(partners)}
    assert len(seen) == world * (world - 1) // 2
    assert [round_robin_partner(r, world, world - 1) for r in range(world)] == [
        round_robin_partner(r, world, 0) for r in range(world)
    ]


def test_bad_options_are_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match="peer_selection must be one of 'all', 'shift_one', 'ring'"):
        unison.algorithms.create("decentralized", peer_selection="random")
    for bad in (0, -2, 1.5, True, "3"):
        with pytest.raises(ValueError, match="communication_interval must be a positive integer"):
            unison.algorithms.create("decentralized", communication_interval=bad)
        with pytest.raises(ValueError, match="communication_interval must be a positive integer"):
            unison.algorithms.create("low_precision_decentralized", communication_interval=bad)
    with pytest.raises(
        ValueError,
        match=r"allowed options: period \(alias communication_interval\), offload, fragments, delay, hierarchical$",
    ):
        unison.algorithms.create("low_precision_decentralized", peer_selection="ring")


# ---- decentralized ----------------------------------------------------------------


def test_all_is_the_plain_average_and_keeps_replicas_identical(four, two):
    for r in [res["all"] for res in four] + [res["all"] for res in two]:
        assert r["vs_mean"] < 1e-6
        assert r["spread_idle"] == 0.0
        assert r["spreads_training"] == [0.0, 0.0, 0.0]
        assert r["bytes"] > 0


def test_shift_one_averages_with_one_partner_who_changes_every_round(four):
    rounds = [[res["shift_one"]["partners"][k] for res in four] for k in range(3)]
    for res in four:
        assert res["shift_one"]["exact"] == [True, True, True], res["shift_one"]["partners"]
    pairs = []
    for partners in rounds:
        partners = [p[0] for p in partners]
        assert all(partners[p] == r for r, p in enumerate(partners))  # symmetric pairs
        pairs.append({frozenset((r, p)) for r, p in enumerate(partners)})
    assert pairs[0] != pairs[1] and pairs[1] != pairs[2] and pairs[0] != pairs[2]
    assert len(set().union(*pairs)) == 6  # every pair of 4 ranks met once
    for res in four:
        s = res["shift_one"]
        assert s["bytes_per_round"] == 4 * s["numel"]  # one fp32 copy to one peer
        assert s["steps"] == 3


def test_ring_is_the_three_way_average_of_neighbours(four):
    for res in four:
        r = res["ring"]
        assert r["gap"] < 1e-6
        assert r["bytes"] == 2 * 4 * r["numel"]  # to the left and to the right
        assert r["spread_after_average"] == 0.0
        assert r["momenta_spread"] > 0 and r["momenta_spread_after_average"] == 0.0


def test_ring_on_two_ranks_is_the_average_of_the_two(two):
    for res in two:
        r = res["ring"]
        assert r["gap"] < 1e-6
        assert r["bytes"] == 4 * r["numel"]  # the one neighbour gets one copy
        assert r["spread_after_average"] == 0.0


def test_ring_on_three_ranks_averages_everyone_and_shift_one_is_refused():
    results = launch.run(three_ranks, 3, timeout=90)
    for res in results:
        assert res["refused"] is not None and "even world size" in res["refused"] and "got 3" in res["refused"]
        assert res["ring_vs_mean"] < 1e-6
    assert replicas_consistent([res["lowprec"] for res in results], "copies_idle") == []
    assert replicas_consistent([res["lowprec"] for res in results], "copies_trained") == []
    for res in results:
        assert res["lowprec"]["spread_after_average"] == 0.0


def test_communication_interval_and_allreduce_equivalence_and_local_buffers(two):
    for res in two:
        spreads = res["interval_spreads"]
        assert all(s > 0 for s in spreads[0:2] + spreads[3:5]), spreads
        assert spreads[2] == 0.0 and spreads[5] == 0.0, spreads
        assert res["vs_allreduce"] < 1e-5
        assert res["bn_param_spread"] == 0.0 and res["bn_buffer_spread"] > 0
        assert res["bn_spread_after_average"] == 0.0
        assert "optimizer" in res["no_optimizer"]
        assert res["two_dtypes_decentralized"]["gap"] < 1e-6
        assert res["two_dtypes_low_precision_decentralized"]["gap"] < 0.05
        for algo in ("decentralized", "low_precision_decentralized"):
            assert res[f"two_dtypes_{algo}"]["spread"] == 0.0


# ---- low_precision_decentralized ------------------------------------------------


@pytest.mark.parametrize("world", ["two", "four"])
def test_lowprec_replicas_are_bit_identical_to_the_senders_public_copy(world, request):
    results = [res["lowprec"] for res in request.getfixturevalue(world)]
    assert replicas_consistent(results, "copies_idle") == []
    assert replicas_consistent(results, "copies_trained") == []
    n = len(results)
    for r, res in enumerate(results):
        assert sorted(res["copies_idle"]["replicas"]) == sorted(ring_neighbours(r, n))


@pytest.mark.parametrize("world", ["two", "four"])
def test_lowprec_round_mixes_toward_the_neighbours(world, request):
    for res in [res["lowprec"] for res in request.getfixturevalue(world)]:
        assert res["formula_gap"] == 0.0
        # Close to the exact neighbourhood average: only 8-bit rounding of
        # unit-scale differences apart (a wrong mixing weight is off by ~0.3).
        assert res["ring_gap"] < 0.05
        assert res["distance_after"] < 0.5 * res["distance_before"]
        assert res["spread_after_average"] == 0.0
        if world == "two":  # both set their weights to the same two public copies' average
            assert res["spread_idle"] == 0.0 and res["spread_before_average"] == 0.0
        else:
            assert res["spread_before_average"] > 0


def test_lowprec_sends_about_a_quarter_of_fp32(four, two):
    for res, neighbours in [(r["lowprec"], 2) for r in four] + [(r["lowprec"], 1) for r in two]:
        assert neighbours * res["numel"] < res["bytes_idle"] < neighbours * res["numel"] * 1.05


def test_lowprec_state_round_trip_and_resume(four):
    for res in four:
        c = res["checkpoint"]
        assert c["same_state"]
        assert c["resumed_gap"] == 0.0
    assert replicas_consistent([res["checkpoint"] for res in four], "copies_from_rank0") == []

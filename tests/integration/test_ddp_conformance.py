"""unison.DataParallel against torch DDP (issue 28): the same program under
``torch.nn.parallel.DistributedDataParallel`` and under ``unison.DataParallel`` on 2 gloo
ranks, in the same run, gives the same results or the same error type.

One group runs every check (``conformance``); each check returns what the tests compare:
comm hooks, pickling, the constructor's checks and arguments, the public methods. Two
neighbours run the rest of the issue's conformance the same way, each in its own group:
test_sparse_and_higher_order.py (sparse gradients, ``create_graph``, ``static_graph``,
``gradient_as_bucket_view``, against torch DDP) and test_compile.py (``torch.compile``
against eager training and torch DDP).
"""

import copy
import inspect
import io
import warnings
from typing import Any, Callable

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP, BNNet, Branchy, batch, image_batch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, powerSGD_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import unison

WRAPPERS: dict[str, Callable[..., nn.Module]] = {"torch": DDP, "unison": unison.DataParallel}


def outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    """``("ok", "")`` or the error's type name and message."""
    try:
        fn()
        return "ok", ""
    except Exception as exc:
        return type(exc).__name__, str(exc)


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def buffers(model: nn.Module) -> torch.Tensor:
    return torch.cat([b.detach().float().reshape(-1) for b in model.buffers()])


def spread(t: torch.Tensor) -> float:
    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return (hi - lo).abs().max().item()


def train(model: nn.Module, steps: int = 3, data=batch, start: int = 0, **forward: Any) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(start, start + steps):
        x, y = data(s, dist.get_rank())
        opt.zero_grad()
        F.mse_loss(model(x, **forward), y).backward()
        opt.step()
    return model


def both(make: Callable[[], nn.Module], setup=None, steps: int = 3, data=batch, **kwargs: Any) -> dict[str, Any]:
    """Train the same model under each wrapper; return each wrapper's final weights."""
    out = {}
    for name, wrap in WRAPPERS.items():
        torch.manual_seed(0)
        model = wrap(make(), **kwargs)
        if setup is not None:
            setup(model)
        out[name] = weights(train(model, steps, data))
    return out


# ---- 1. torch's comm-hook contract --------------------------------------------------------
def powersgd_state() -> powerSGD_hook.PowerSGDState:
    return powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)


HOOKS: dict[str, Callable[[], tuple[Any, Callable]]] = {
    "allreduce": lambda: (None, default_hooks.allreduce_hook),
    "fp16": lambda: (None, default_hooks.fp16_compress_hook),
    "noop": lambda: (None, debugging_hooks.noop_hook),
    "powersgd": lambda: (powersgd_state(), powerSGD_hook.powerSGD_hook),
    "fp16_wrapped_powersgd": lambda: (
        powersgd_state(),
        default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook),
    ),
}


def check_torch_hooks() -> dict[str, float]:
    """Each of torch's own hooks, registered by keyword, trains the same weights under both."""
    gaps = {}
    for name, make in HOOKS.items():

        def register(model: nn.Module, make=make) -> None:
            state, hook = make()
            model.register_comm_hook(state=state, hook=hook)

        result = both(MLP, setup=register, steps=4)
        gaps[name] = (result["torch"] - result["unison"]).abs().max().item()
    return gaps


def future_of(bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def bucket_int(state: object, bucket: int) -> torch.futures.Future[torch.Tensor]:
    return future_of(bucket)  # type: ignore[arg-type]


def returns_int(state: object, bucket: dist.GradBucket) -> int:
    return 3


def returns_unannotated_int(state, bucket):
    return 3


def string_annotated(state, bucket):
    return future_of(bucket)


string_annotated.__annotations__ = {"bucket": "dist.GradBucket", "return": "torch.futures.Future[torch.Tensor]"}


def check_hook_contract() -> dict[str, dict[str, tuple[str, str]]]:
    """torch's checks at registration and at backward: the same error types under both."""

    def register(hook: Any, twice: bool = False) -> Callable[[nn.Module], None]:
        def fn(model: nn.Module) -> None:
            model.register_comm_hook(None, hook)
            if twice:
                model.register_comm_hook(None, hook)

        return fn

    def backward_of(model: nn.Module) -> None:
        model.register_comm_hook(state=None, hook=returns_unannotated_int)
        x, y = batch(0, dist.get_rank())
        F.mse_loss(model(x), y).backward()

    cases: dict[str, Callable[[nn.Module], None]] = {
        "not callable": register(3),
        "bucket annotation": register(bucket_int),
        "return annotation": register(returns_int),
        "twice": register(default_hooks.allreduce_hook, twice=True),
        "bf16 without NCCL": register(default_hooks.bf16_compress_hook),
        "keyword form": lambda m: m.register_comm_hook(state=None, hook=default_hooks.allreduce_hook),
        "returns no Future": backward_of,
        "annotations as strings": register(string_annotated),  # torch refuses correct ones; unison reads them
    }
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for case, fn in cases.items():
        out[case] = {}
        for name, wrap in WRAPPERS.items():
            model = wrap(MLP())
            out[case][name] = outcome(lambda fn=fn, model=model: fn(model))
    return out


def check_pfn_beside_torch_hook() -> dict[str, Any]:
    """pytorch-pfn-extras' hook(model) and torch's hook(state, bucket) on one model."""
    calls = []

    def setup(model: nn.Module) -> None:
        if isinstance(model, unison.DataParallel):
            model.register_comm_hook(lambda m: calls.append(type(m).__name__))
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)

    result = both(MLP, setup=setup, steps=3)
    return {"gap": (result["torch"] - result["unison"]).abs().max().item(), "calls": calls}


# ---- 2. pickling -------------------------------------------------------------------------
def saved_and_loaded(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def check_pickling() -> dict[str, Any]:
    """torch.save(model) and copy.deepcopy(model) of a trained wrapper: a module for inference,
    or to wrap again; the restored unison wrapper synchronizes nothing and says so."""
    rank = dist.get_rank()
    x, y = batch(9, rank)
    out: dict[str, Any] = {}
    for name, wrap in WRAPPERS.items():
        torch.manual_seed(0)
        model = train(wrap(BNNet()), data=image_batch)
        with torch.no_grad():
            expected = copy.deepcopy(model.module).eval()(image_batch(9, rank)[0])
        for how, restore in (("save", saved_and_loaded), ("deepcopy", copy.deepcopy)):
            restored = restore(model)
            restored.eval()
            with torch.no_grad():
                out[f"{name} {how} output"] = (restored(image_batch(9, rank)[0]) - expected).abs().max().item()
            out[f"{name} {how} keys"] = sorted(k.removeprefix("module.") for k in restored.state_dict())
        # wrapped again: trains on as the original would
        again = wrap(saved_and_loaded(model).module)
        out[f"{name} wrapped again"] = weights(train(again, start=3, data=image_batch))
        out[f"{name} original"] = weights(train(model, start=3, data=image_batch))

    restored = saved_and_loaded(unison.DataParallel(MLP()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.mse_loss(restored(x), y).backward()  # this rank's gradients only: nothing to wait for
    local = copy.deepcopy(restored.module)
    local.zero_grad()
    F.mse_loss(local(x), y).backward()
    out["restored grads are local"] = (
        (
            torch.cat([p.grad.reshape(-1) for p in restored.module.parameters()])
            - torch.cat([p.grad.reshape(-1) for p in local.parameters()])
        )
        .abs()
        .max()
        .item()
    )
    out["restored warns"] = [str(w.message) for w in caught]
    out["restored join"] = outcome(restored.join)
    out["restored hook"] = outcome(lambda: restored.register_comm_hook(None, default_hooks.allreduce_hook))
    out["restored rewrapped"] = type(unison.DataParallel(restored).module).__name__
    # An algorithm whose forward hooks live on the module (nonblocking) pickles too.
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    nonblocking = unison.DataParallel(net, optimizer=opt, algorithm="nonblocking")
    train_step = batch(0, rank)
    F.mse_loss(nonblocking(train_step[0]), train_step[1]).backward()
    opt.step()
    out["nonblocking saved"] = outcome(lambda: saved_and_loaded(nonblocking))
    out["nonblocking copy hooks"] = sum(len(m._forward_pre_hooks) for m in copy.deepcopy(nonblocking).modules())
    nonblocking.close()
    return out


# ---- 3. construction checks --------------------------------------------------------------
class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4).requires_grad_(False)


class TwoDeviceTypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cpu = nn.Linear(4, 4)
        self.meta = nn.Linear(4, 4, device="meta")


def check_construction(mesh_1d: Any, mesh_2d: Any) -> dict[str, dict[str, tuple[str, str]]]:
    """torch's constructor checks: the same error type under both (every check is local)."""
    cases: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
        "no parameter": (nn.ReLU, {}),
        "no trainable parameter": (Frozen, {}),
        "device_ids on CPU": (MLP, {"device_ids": [0]}),
        "output_device on CPU": (MLP, {"output_device": 1}),
        "two device_ids": (MLP, {"device_ids": [0, 1]}),
        "two device types": (TwoDeviceTypes, {}),
        "uninitialized parameter": (lambda: nn.LazyLinear(4), {}),
        "SyncBatchNorm on CPU": (lambda: nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4)), {}),
        "delayed allreduce half given": (MLP, {"delay_all_reduce_named_params": []}),
        "process_group and device_mesh": (MLP, {"process_group": dist.group.WORLD, "device_mesh": mesh_1d}),
        "2-D device_mesh": (MLP, {"device_mesh": mesh_2d}),
        "same model": (MLP, {}),
    }
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for case, (make, kwargs) in cases.items():
        out[case] = {
            name: outcome(lambda wrap=wrap, make=make, kwargs=kwargs: wrap(make(), **kwargs))
            for name, wrap in WRAPPERS.items()
        }
    return out


def check_one_rank_fails() -> dict[str, tuple[str, str]]:
    """A check that fails on one rank only raises on every rank (torch's would hang the others
    in its first collective, so only unison runs it)."""
    rank = dist.get_rank()
    return {
        "frozen on rank 1": outcome(lambda: unison.DataParallel(Frozen() if rank == 1 else MLP())),
        "bad bucket size on rank 0": outcome(lambda: unison.DataParallel(MLP(), bucket_cap_mb=-1 if rank == 0 else 25)),
        "then a good one": outcome(lambda: unison.DataParallel(MLP())),
    }


# ---- 4. the constructor's arguments --------------------------------------------------------
def start_apart(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """A model whose weights and buffers differ by rank before wrapping."""

    def made() -> nn.Module:
        torch.manual_seed(dist.get_rank())
        model = make()
        with torch.no_grad():
            for b in model.buffers():
                if b.is_floating_point():
                    b.fill_(float(dist.get_rank()))
        return model

    return made


def check_arguments(mesh_1d: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    settings: dict[str, dict[str, Any]] = {
        "init_sync=False": {"init_sync": False},
        "broadcast_buffers=False": {"broadcast_buffers": False},
        "forward_sync_buffers=False": {"forward_sync_buffers": False},
        "defaults": {},
    }
    for case, kwargs in settings.items():
        for name, wrap in WRAPPERS.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 deprecates broadcast_buffers
                model = wrap(start_apart(BNNet)(), **kwargs)
            at_start = (spread(weights(model)), spread(buffers(model)))
            train(model, data=image_batch)
            out[f"{case} {name}"] = {"at start": at_start, "weights": weights(model), "buffers": buffers(model)}
    for case, kwargs in {
        "device_mesh": {"device_mesh": mesh_1d},
        "bucket_cap_mb=None": {"bucket_cap_mb": None},
        "dim=1": {"dim": 1},
        "batched_grad_copy": {"batched_grad_copy": True},
        "check_reduction": {"check_reduction": True},
    }.items():
        result = both(MLP, **kwargs)
        out[case] = {"gap": (result["torch"] - result["unison"]).abs().max().item()}
    for name, wrap in WRAPPERS.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrap(MLP(), check_reduction=True)
        out[f"check_reduction warned {name}"] = [
            w.category.__name__ for w in caught if "check_reduction" in str(w.message)
        ]
    for case, kwargs in {
        "find_unused_parameters": {"find_unused_parameters": True},
        "skip_all_reduce_unused_params": {"find_unused_parameters": True, "skip_all_reduce_unused_params": True},
    }.items():
        result, grads = {}, {}
        for name, wrap in WRAPPERS.items():
            torch.manual_seed(0)
            model = train(wrap(Branchy(), **kwargs), branch="a")  # `b` and `never` unused everywhere
            result[name] = weights(model)
            grads[name] = [p.grad is None for p in model.parameters()]
        out[case] = {"gap": (result["torch"] - result["unison"]).abs().max().item(), "none": grads}
    out["attributes"] = {
        name: (m.device_ids, m.output_device, m.dim, m.find_unused_parameters, m.broadcast_buffers, m.device)
        for name, m in ((n, wrap(MLP(), dim=1)) for n, wrap in WRAPPERS.items())
    }
    out["mixed_precision"] = outcome(lambda: unison.DataParallel(MLP(), mixed_precision=object()))
    return out


# ---- 5. the public methods -----------------------------------------------------------------
def no_sync_train(model: nn.Module) -> torch.Tensor:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rank = dist.get_rank()
    for s in range(3):
        opt.zero_grad()
        with model.no_sync():
            x, y = batch(10 + s, rank)
            F.mse_loss(model(x), y).backward()
        x, y = batch(s, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return weights(model)


def join_train(model: nn.Module) -> torch.Tensor:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rank = dist.get_rank()
    with model.join():
        for s in range(3 + rank):  # rank 1 has one more batch
            x, y = batch(s, rank)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    return weights(model)


def check_methods() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, wrap in WRAPPERS.items():
        torch.manual_seed(0)
        net = MLP()
        model = wrap(net)
        out[f"module {name}"] = model.module is net
        out[f"require_backward_grad_sync {name}"] = model.require_backward_grad_sync
        out[f"no_sync {name}"] = no_sync_train(model)
        torch.manual_seed(0)
        out[f"join {name}"] = join_train(wrap(MLP()))
        out[f"join_hook {name}"] = callable(model.join_hook) and model.join_hook() is not None
        out[f"state_dict {name}"] = model.state_dict()
        out[f"prefixed {name}"] = list(model.state_dict(prefix="p."))
    # unison loads torch DDP's module.-prefixed dicts, and its own.
    torch.manual_seed(1)
    ours = unison.DataParallel(MLP())
    ours.load_state_dict(out["state_dict torch"])
    out["loaded from torch"] = all(
        torch.equal(v, out["state_dict torch"][f"module.{k}"]) for k, v in ours.state_dict().items()
    )
    return out


def conformance() -> dict[str, Any]:
    mesh_1d = init_device_mesh("cpu", (2,))
    mesh_2d = init_device_mesh("cpu", (1, 2))
    return {
        "torch hooks": check_torch_hooks(),
        "hook contract": check_hook_contract(),
        "pfn beside torch": check_pfn_beside_torch_hook(),
        "pickling": check_pickling(),
        "construction": check_construction(mesh_1d, mesh_2d),
        "one rank fails": check_one_rank_fails(),
        "arguments": check_arguments(mesh_1d),
        "methods": check_methods(),
    }


@pytest.fixture(scope="module")
def results():
    return launch.run(conformance, 2, timeout=240)


# ---- the tests -----------------------------------------------------------------------------
def test_torch_hooks_registered_by_keyword_train_the_same_weights(results):
    for r in results:
        for hook, gap in r["torch hooks"].items():
            assert gap < 1e-6, hook  # fp16-wrapped PowerSGD works in fp16, as torch


def test_hook_checks_raise_torch_error_types(results):
    for r in results:
        contract = r["hook contract"]
        for case, got in contract.items():
            if case != "annotations as strings":
                assert got["unison"][0] == got["torch"][0], (case, got)
        assert contract["annotations as strings"] == {
            "torch": ("ValueError", "Communication hook: bucket annotation should be dist.GradBucket."),
            "unison": ("ok", ""),
        }
        assert "return annotation" in contract["return annotation"]["unison"][1]
        assert (
            contract["twice"]["unison"][1]
            == "register_comm_hook or register_builtin_comm_hook can only be called once."
        )
        assert "must return a torch.futures.Future" in contract["returns no Future"]["unison"][1]
        assert "'int' object has no attribute" not in contract["returns no Future"]["unison"][1]
        for case in ("not callable", "bucket annotation", "return annotation", "bf16 without NCCL"):
            assert contract[case]["unison"] == contract[case]["torch"], case


def test_pfn_hook_runs_beside_a_torch_hook(results):
    for r in results:
        assert r["pfn beside torch"]["gap"] < 1e-5
        assert r["pfn beside torch"]["calls"] == ["DataParallel"] * 3


def test_pickled_wrapper_serves_inference_and_wraps_again(results):
    for rank, r in enumerate(results):
        p = r["pickling"]
        for how in ("save", "deepcopy"):
            assert p[f"unison {how} output"] == 0.0
            # torch's restored DDP broadcasts rank 0's buffers in forward; rank 1 held its own
            assert rank == 1 or p[f"torch {how} output"] == 0.0
        for name in WRAPPERS:
            assert torch.equal(p[f"{name} wrapped again"], p[f"{name} original"])
        assert p["unison save keys"] == p["torch save keys"] == p["unison deepcopy keys"]
        assert torch.allclose(p["unison wrapped again"], p["torch wrapped again"], atol=1e-5)


def test_restored_wrapper_synchronizes_nothing_and_says_so(results):
    for r in results:
        p = r["pickling"]
        assert p["restored grads are local"] == 0.0
        assert len(p["restored warns"]) == 1 and "synchronizes nothing" in p["restored warns"][0]
        assert p["restored join"][0] == "RuntimeError" and "restored from a pickle" in p["restored join"][1]
        assert p["restored hook"][0] == "RuntimeError"
        assert p["restored rewrapped"] == "MLP"
        assert p["nonblocking saved"] == ("ok", "")
        assert p["nonblocking copy hooks"] == 0


def test_construction_refuses_what_torch_refuses(results):
    for r in results:
        for case, got in r["construction"].items():
            assert got["unison"][0] == got["torch"][0], (case, got)
            if got["torch"][0] != "ok" and case != "two device types":
                assert got["unison"][1] == got["torch"][1], case
        assert r["construction"]["same model"]["unison"] == ("ok", "")


def test_a_check_failing_on_one_rank_raises_on_every_rank(results):
    for rank, r in enumerate(results):
        frozen = r["one rank fails"]["frozen on rank 1"]
        assert frozen[0] == "RuntimeError" and "doesn't have any parameter that requires a gradient" in frozen[1]
        assert (rank == 1) or frozen[1].startswith("on rank 1: ")
        bucket = r["one rank fails"]["bad bucket size on rank 0"]
        assert bucket[0] == "ValueError" and "bucket_cap_mb" in bucket[1]
        assert r["one rank fails"]["then a good one"] == ("ok", "")


def test_init_sync_and_buffer_arguments_mean_what_torch_means(results):
    for rank, r in enumerate(results):
        a = r["arguments"]
        for case in ("init_sync=False", "broadcast_buffers=False", "forward_sync_buffers=False", "defaults"):
            theirs, ours = a[f"{case} torch"], a[f"{case} unison"]
            assert ours["at start"] == theirs["at start"], case
            assert torch.allclose(ours["weights"], theirs["weights"], atol=1e-5), case
            # Synchronized buffers: torch broadcasts rank 0's at the start of each forward, unison
            # after each backward; every forward sees rank 0's under both, but between steps the
            # other ranks hold rank 0's under unison and their own last update under torch.
            if rank == 0 or case in ("broadcast_buffers=False", "forward_sync_buffers=False"):
                assert torch.allclose(ours["buffers"], theirs["buffers"], atol=1e-5), case
        assert a["init_sync=False torch"]["at start"][0] > 0  # the replicas were left apart
        assert a["broadcast_buffers=False torch"]["at start"] == (0.0, 1.0)
        assert a["forward_sync_buffers=False torch"]["at start"] == (0.0, 0.0)


def test_other_arguments_train_as_torch_does(results):
    for r in results:
        a = r["arguments"]
        for case in ("device_mesh", "bucket_cap_mb=None", "dim=1", "batched_grad_copy", "check_reduction"):
            assert a[case]["gap"] < 1e-5, case
        assert a["check_reduction warned unison"] == a["check_reduction warned torch"] == ["FutureWarning"]
        for case in ("find_unused_parameters", "skip_all_reduce_unused_params"):
            assert a[case]["gap"] < 1e-5, case
            assert a[case]["none"]["unison"] == a[case]["none"]["torch"], case
        assert a["attributes"]["unison"] == a["attributes"]["torch"]
        assert a["mixed_precision"][0] == "NotImplementedError"


def test_public_methods_behave_as_torch_ddp(results):
    for r in results:
        m = r["methods"]
        assert m["module torch"] and m["module unison"]
        assert m["require_backward_grad_sync torch"] and m["require_backward_grad_sync unison"]
        assert torch.allclose(m["no_sync unison"], m["no_sync torch"], atol=1e-5)
        assert torch.allclose(m["join unison"], m["join torch"], atol=1e-5)
        assert m["join_hook torch"] and m["join_hook unison"]
        theirs, ours = m["state_dict torch"], m["state_dict unison"]
        assert list(theirs) == [f"module.{k}" for k in ours]  # unison's keys are the module's (documented)
        assert all(torch.equal(theirs[f"module.{k}"], v) for k, v in ours.items())
        assert m["prefixed torch"] == [f"p.module.{k}" for k in ours] and m["prefixed unison"] == [
            f"p.{k}" for k in ours
        ]
        assert m["loaded from torch"]


def test_register_comm_hook_signature_names_torch_parameters():
    params = inspect.signature(unison.DataParallel.register_comm_hook).parameters
    assert list(params)[1:] == list(inspect.signature(DDP.register_comm_hook).parameters)[1:] == ["state", "hook"]

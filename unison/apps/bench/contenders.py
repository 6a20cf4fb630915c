"""The contenders of ``unison bench``: unison's algorithms and the peers a user would pick instead.

A contender is named by a spec: a unison algorithm with its defaults
(``"fp16"``) or chosen options (``"powersgd:rank=2"``, ``"allreduce:autotune=true"``),
or one of the peers:

| spec                 | what runs                                                                  |
| -------------------- | -------------------------------------------------------------------------- |
| `ddp`                | torch `DistributedDataParallel`                                            |
| `ddp_fp16`           | torch DDP with `default_hooks.fp16_compress_hook`                          |
| `ddp_powersgd`       | torch DDP with the PowerSGD hook (`rank=4`, `start_iter=10`, like unison's) |
| `ddp_post_local_sgd` | torch DDP with `post_localSGD_hook` and a `PeriodicModelAverager` (`period=16`, `warmup_steps=10`) |
| `ppe_ddp`            | pytorch-pfn-extras `DistributedDataParallel` (when installed)             |

``prepare(spec, workload, lr)`` runs inside a rank: it wraps the workload's
model and returns a ``Prepared`` with the training callable, the optimizer and
the events the training loop calls. Bytes are what this rank sends per step:
unison's own count (``comm_stats``) for its algorithms; for the peers, the
ring-allreduce volume of what they reduce, counted step by step.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

PEERS = {
    "ddp": "torch DDP",
    "ddp_fp16": "torch DDP + fp16 hook",
    "ddp_powersgd": "torch DDP + PowerSGD hook",
    "ddp_post_local_sgd": "torch DDP + post-local SGD",
    "ppe_ddp": "pytorch-pfn-extras DDP",
}
PEER_DEFAULTS: dict[str, dict[str, Any]] = {
    "ddp": {},
    "ddp_fp16": {},
    "ddp_powersgd": {"rank": 4, "start_iter": 10},
    "ddp_post_local_sgd": {"period": 16, "warmup_steps": 10},
    "ppe_ddp": {},
}
#: The quick set: the baseline, unison's default, one compressor, one low-rank, one model-averaging.
QUICK = ["ddp", "allreduce", "fp16", "powersgd", "local_sgd"]


@dataclass(frozen=True)
class Spec:
    """A parsed contender spec."""

    text: str
    name: str
    options: dict = field(default_factory=dict, hash=False)

    @property
    def kind(self) -> str:
        return "ppe" if self.name == "ppe_ddp" else "torch" if self.name in PEERS else "unison"

    @property
    def label(self) -> str:
        return (
            self.text
            if self.kind == "unison"
            else (PEERS[self.name] + (f" ({self.text.partition(':')[2]})" if self.options else ""))
        )


def parse(text: str) -> Spec:
    """``"powersgd:rank=4,start_iter=2"`` -> Spec("powersgd", {"rank": 4, "start_iter": 2}), validated."""
    from ... import algorithms

    text = text.strip()
    name, options = algorithms.parse(text)
    spec = Spec(text, name, options)
    check(spec)
    return spec


def check(spec: Spec) -> None:
    """Refuse an unknown contender or option early (ValueError saying what is allowed)."""
    if spec.name in PEERS:
        unknown = sorted(set(spec.options) - set(PEER_DEFAULTS[spec.name]))
        if unknown:
            allowed = ", ".join(PEER_DEFAULTS[spec.name]) or "none"
            raise ValueError(f"contender {spec.name!r} has no option {', '.join(unknown)}; allowed: {allowed}")
        for key, value in spec.options.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"contender {spec.name!r}: {key} must be a positive integer, got {value!r}")
        return
    from ... import algorithms

    if spec.name not in algorithms.names():
        raise ValueError(
            f"unknown contender {spec.name!r}; choose from {', '.join(all_specs())} (unison algorithms take options, e.g. powersgd:rank=2)"
        )
    algorithms.create(spec.name, **spec.options)


def parse_list(text: Optional[str], quick: bool = False, nodes: int = 1, procs_per_node: int = 1) -> list[Spec]:
    """A comma list of specs, where a comma inside one spec's options is told apart by the ``=`` after it;
    None or "all" gives every contender (``QUICK`` with ``quick``), each followed by its hierarchical
    twin when there are several nodes of several processes. A list given is kept as it is."""
    if text is None or text.strip() in ("", "all"):
        specs = [parse(s) for s in (QUICK if quick else all_specs())]
        if nodes > 1 and procs_per_node > 1:
            specs = [t for s in specs for t in (s, hierarchical_twin(s)) if t is not None]
        return specs
    items: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if items and "=" in piece and ":" not in piece and ":" in items[-1]:
            items[-1] += "," + piece  # an option of the previous spec ("powersgd:rank=2,start_iter=5")
        else:
            items.append(piece)
    specs = [parse(s) for s in items]
    seen = set()
    for s in specs:
        if s.text in seen:
            raise ValueError(f"contender {s.text!r} is listed twice")
        seen.add(s.text)
    return specs


def all_specs() -> list[str]:
    """Every peer, then every unison algorithm with its defaults, then allreduce with autotuning."""
    from ... import algorithms

    return list(PEERS) + algorithms.names() + ["allreduce:autotune=true"]


def hierarchical_twin(spec: Spec) -> Optional[Spec]:
    """``spec`` with ``hierarchical=true`` when its algorithm has that option and ``spec`` does not set it, else None."""
    from ... import algorithms

    if spec.kind != "unison" or "hierarchical" in spec.options:
        return None
    if "hierarchical" not in algorithms.get(spec.name).options_declared:
        return None
    return parse(spec.text + ("," if spec.options else ":") + "hierarchical=true")


def flat_form(text: str) -> Optional[tuple[str, bool]]:
    """(the contender ``text`` with every option but ``hierarchical``, as one canonical text; whether it is
    hierarchical), or None when it has no such option (a peer, daso): twins share the first."""
    from ... import algorithms

    try:
        algorithm = algorithms.create(text)
    except (ValueError, TypeError):
        return None
    values = dict(algorithm.option_values)
    if "hierarchical" not in values:
        return None
    hierarchical = bool(values.pop("hierarchical"))
    return f"{algorithm.name}({', '.join(f'{k}={v!r}' for k, v in sorted(values.items()))})", hierarchical


def unavailable(spec: Spec) -> Optional[str]:
    """Why the contender cannot run here ("not installed"), or None."""
    if spec.kind == "ppe" and importlib.util.find_spec("pytorch_pfn_extras") is None:
        return "not installed (pip install pytorch-pfn-extras)"
    return None


# ---- inside a rank ---------------------------------------------------------------
@dataclass
class Prepared:
    """A wrapped model ready to train, with the events the training loop fires."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    after_step: Callable[[], None] = lambda: None
    end_epoch: Callable[[float], None] = lambda loss: None
    flush: Callable[[], None] = lambda: None  # before rank 0 evaluates its module (local)
    finish: Callable[[], None] = lambda: None  # collective: replicas identical, background work stopped
    bytes_total: Callable[[], float] = lambda: 0.0
    info: Callable[[], dict] = dict


def _ring(nbytes: float, world: int) -> float:
    return 2 * (world - 1) * nbytes / world if world > 1 else 0.0


def prepare(spec: Spec, workload, lr: Optional[float], topo) -> Prepared:
    """Wrap ``workload.model`` as ``spec`` says, on the running process group."""
    from . import workloads

    module = workload.model
    optimizer = workloads.make_optimizer(
        workload, module.parameters(), lr, algorithm=spec.name if spec.kind == "unison" else None
    )
    if spec.kind == "unison":
        return _unison(spec, module, optimizer)
    if spec.kind == "ppe":
        return _ppe(module, optimizer)
    return _torch(spec, module, optimizer, topo)


def _unison(spec: Spec, module, optimizer) -> Prepared:
    import unison

    model = unison.DataParallel(
        module, optimizer=optimizer, algorithm=unison.algorithms.create(spec.name, **spec.options)
    )

    def finish():
        model.average()
        if model.algorithm.name != "allreduce":
            model.switch_to("allreduce")  # stops background threads (async) before shutdown

    def info():
        tuning = getattr(model.algorithm_state, "tuning", None)
        return {"autotune": tuning} if tuning else {}

    return Prepared(
        model,
        optimizer,
        end_epoch=model.end_epoch,
        flush=model.flush,
        finish=finish,
        bytes_total=lambda: float(model.comm_stats["bytes_total"]),
        info=info,
    )


def _grad_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def _torch(spec: Spec, module, optimizer, topo) -> Prepared:
    from torch.nn.parallel import DistributedDataParallel as DDP

    opts = {**PEER_DEFAULTS[spec.name], **spec.options}
    world = dist.get_world_size()
    grads = _grad_bytes(module)
    model = DDP(module)
    sent = [0.0]
    steps = [0]

    def per_step(step: int) -> float:
        return _ring(grads, world)

    def after() -> None:
        return None

    if spec.name == "ddp_fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)

        def per_step(step: int) -> float:
            return _ring(grads / 2, world)

    elif spec.name == "ddp_powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        hook_state = powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=opts["rank"], start_powerSGD_iter=opts["start_iter"]
        )
        model.register_comm_hook(hook_state, powerSGD_hook.powerSGD_hook)
        compressed = _powersgd_bytes(module, opts["rank"])

        def per_step(step: int) -> float:
            return _ring(grads if step < opts["start_iter"] else compressed, world)

    elif spec.name == "ddp_post_local_sgd":
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        subgroup = topo.intra_node_group
        local = dist.get_world_size(subgroup) if subgroup is not None else 1
        local_state = post_localSGD_hook.PostLocalSGDState(None, subgroup, start_localSGD_iter=opts["warmup_steps"])
        model.register_comm_hook(local_state, post_localSGD_hook.post_localSGD_hook)
        averager = PeriodicModelAverager(period=opts["period"], warmup_steps=opts["warmup_steps"])
        params = list(module.parameters())

        def per_step(step: int) -> float:
            if step < opts["warmup_steps"]:
                return _ring(grads, world)
            extra = _ring(grads, world) if (step + 1) % opts["period"] == 0 else 0.0  # the averager's step
            return _ring(grads, local) + extra

        def after() -> None:
            averager.average_parameters(params)

    def after_step():
        after()
        sent[0] += per_step(steps[0])
        steps[0] += 1

    def finish():
        with torch.no_grad():
            for p in module.parameters():  # replicas identical (post-local SGD drifts between averages)
                dist.all_reduce(p.data)
                p.data /= world

    return Prepared(model, optimizer, after_step=after_step, finish=finish, bytes_total=lambda: sent[0])


def _powersgd_bytes(module, rank: int, min_compression_rate: float = 2) -> float:
    """Bytes of one PowerSGD step: rank-r factors of the matrices worth compressing, the rest as they are."""
    total = 0
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if p.dim() > 1:
            rows, cols = p.shape[0], p.numel() // p.shape[0]
            if (rows + cols) * rank * min_compression_rate < rows * cols:
                total += (rows + cols) * rank * p.element_size()
                continue
        total += p.numel() * p.element_size()
    return float(total)


def _ppe(module, optimizer) -> Prepared:
    from pytorch_pfn_extras.nn.parallel import DistributedDataParallel as PPEDDP

    world = dist.get_world_size()
    grads = _grad_bytes(module)
    flags = sum(1 for p in module.parameters() if p.requires_grad)
    model = PPEDDP(module)
    sent = [0.0]

    def after_step():
        sent[0] += _ring(grads, world) + _ring(flags, world)

    return Prepared(model, optimizer, after_step=after_step, bytes_total=lambda: sent[0])

"""Step time of every algorithm on one GPU against local training and torch DDP: a world of one over NCCL.

A GPT-2-small-sized decoder (12 layers, d 768, vocab 50257, 124M parameters; plain torch),
bf16 autocast, fused AdamW, batch 8 x 512 tokens: the setting of REFERENCE.md's GPU figures.
A world of one sends nothing over a network, so what this measures is what each algorithm
costs the GPU beside the training itself: its codec, its copies, its host syncs.

How it measures (the house's rules for a step-time benchmark):

* every contender runs in a process of its own, built afresh, one after another;
* ``local`` (the model alone, no wrapper, no communication) and ``ddp`` (torch's
  DistributedDataParallel) run beside the algorithms in every round;
* each contender takes untimed warm-up steps past its own warm-up and a whole number of
  its sync periods; the timed window is a whole number of sync periods (at least two) and
  holds everything the algorithm does in those steps, the device drained at both ends;
* rounds (at least 3) alternate the contenders' order; a contender's figure is the median
  over rounds of its time divided by ``local``'s and by ``ddp``'s in the same round;
* at a world of one nothing goes over a network (``comm_stats`` counts no bytes); the
  algorithms whose code skips its codec there too are named in the last column (``SKIPS``).

One command, on a machine with a GPU::

    python benchmarks/bench_gpu_step.py --json benchmarks/results/gpu_step.json

``--smoke`` runs a tiny model on the CPU over gloo (to check the script, not to measure).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = (
    "local,ddp,allreduce,fp16,bf16,bytegrad,powersgd,qadam,demo,local_sgd,diloco,sparseloco,"
    "decentralized,low_precision_decentralized,async,daso:warmup_epochs=0,nonblocking"
)
GPT2 = {"vocab": 50257, "d_model": 768, "layers": 12, "heads": 12, "context": 512, "batch": 8}
#: Algorithms that skip their codec at a world of one, and where (what they cost there is not their codec's).
SKIPS = {
    "bytegrad": "skips its codec at a world of one (bytegrad.reduce_bucket)",
    "qadam": "skips its codec at a world of one (bytegrad's exchange)",
    "decentralized": "no neighbours at a world of one (decentralized.ring_neighbours)",
    "low_precision_decentralized": "no neighbours at a world of one (decentralized.ring_neighbours)",
}
SMOKE = {"vocab": 256, "d_model": 32, "layers": 2, "heads": 2, "context": 16, "batch": 2}


def one(spec: str, size: dict, device: str, window: int, warmup: int) -> dict:
    """Run one contender in this process; returns its ms per step and bytes per step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import unison

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://", rank=0, world_size=1)
    unison.init()
    V, D, T, B = size["vocab"], size["d_model"], size["context"], size["batch"]

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
            layer = nn.TransformerEncoderLayer(
                D, size["heads"], 4 * D, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, size["layers"], enable_nested_tensor=False)
            self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.tok(x) + self.pos.weight[: x.shape[1]]
            return self.head(self.norm(self.blocks(h, mask=self.mask, is_causal=True)))

    torch.manual_seed(0)
    net = GPT().to(device)
    name = spec.partition(":")[0]
    if name == "qadam":
        opt: torch.optim.Optimizer = unison.QAdamOptimizer(net.parameters(), lr=1e-4, warmup_steps=5)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=cuda)
    period, own_warmup = 1, 0
    if name == "local":
        model: nn.Module = net
    elif name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net, device_ids=[torch.device(device).index or 0] if cuda else None, gradient_as_bucket_view=True)
    else:
        algorithm = unison.algorithms.create(unison.algorithms.parse(spec)[0], **unison.algorithms.parse(spec)[1])
        period = int(getattr(algorithm, "period", 1) or 1)
        if name == "daso":
            period = algorithm.max_global_skips
        own_warmup = max(
            5 if name == "qadam" else 0,
            getattr(algorithm, "warmup_steps", 0) or 0,
            getattr(algorithm, "start_iter", 0) or 0,
        )
        model = unison.DataParallel(net, optimizer=opt, algorithm=algorithm)
    steps = period * math.ceil(window / period)
    steps = max(steps, 2 * period)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, V, (B, T), device=device, generator=g)
    y = torch.randint(0, V, (B, T), device=device, generator=g)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).view(-1, V).float(), y.view(-1))
        loss.backward()
        opt.step()

    for _ in range(period * math.ceil(max(warmup, own_warmup + 1) / period)):
        step()
    sync()
    before = model.comm_stats["bytes_total"] if hasattr(model, "comm_stats") else 0
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if hasattr(model, "flush"):
        model.flush()
    sync()
    elapsed = time.perf_counter() - start
    sent = (model.comm_stats["bytes_total"] if hasattr(model, "comm_stats") else 0) - before
    if hasattr(model, "close"):
        model.close()
    dist.destroy_process_group()
    return {"spec": spec, "ms": 1e3 * elapsed / steps, "steps": steps, "period": period, "bytes_per_step": sent / steps}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(spec: str, args: argparse.Namespace) -> dict:
    """``spec`` in a fresh process; its result."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    command = [sys.executable, os.path.abspath(__file__), "--one", spec, "--device", args.device]
    command += ["--window", str(args.window), "--warmup", str(args.warmup)] + (["--smoke"] if args.smoke else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        return {"spec": spec, "error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", default=DEFAULT, help="comma list (default: %(default)s)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=3, help="at least 3")
    parser.add_argument("--window", type=int, default=32, help="least timed steps (rounded up to whole periods)")
    parser.add_argument("--warmup", type=int, default=12, help="least untimed steps before the window")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a contender's process may take")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU over gloo: checks the script")
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.device = "cpu"
    size = SMOKE if args.smoke else GPT2
    if args.one is not None:
        print(json.dumps(one(args.one, size, args.device, args.window, args.warmup)))
        return 0
    if args.rounds < 3:
        parser.error("--rounds must be at least 3: the figure is a median of paired ratios")
    from common import split_contenders

    contenders = split_contenders(args.contenders)
    for base in ("local", "ddp"):
        if base not in contenders:
            contenders.insert(0, base)
    rounds = []
    for r in range(args.rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        rounds.append({spec: run_one(spec, args) for spec in order})
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    summary = {}
    for spec in contenders:
        ok = [r for r in rounds if "ms" in r[spec] and "ms" in r["local"] and "ms" in r["ddp"]]
        if not ok:
            summary[spec] = {"error": rounds[-1][spec].get("error")}
            continue
        summary[spec] = {
            "ms": statistics.median(r[spec]["ms"] for r in ok),
            "vs_local": statistics.median(r[spec]["ms"] / r["local"]["ms"] for r in ok),
            "vs_ddp": statistics.median(r[spec]["ms"] / r["ddp"]["ms"] for r in ok),
            "bytes_per_step": statistics.median(r[spec]["bytes_per_step"] for r in ok),
            "period": ok[0][spec]["period"],
        }
    print(f"{args.device}, world of one, {size}, medians of {args.rounds} rounds")
    print(f"{'contender':34} {'ms/step':>8} {'/ local':>8} {'/ DDP':>6} {'B/step':>12}  note")
    for spec, e in summary.items():
        if "error" in e:
            print(f"{spec:34} failed: {e['error']}")
            continue
        note = SKIPS.get(spec.partition(":")[0], "")
        print(f"{spec:34} {e['ms']:8.2f} {e['vs_local']:8.3f} {e['vs_ddp']:6.3f} {e['bytes_per_step']:12.0f}  {note}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"size": size, "device": args.device, "summary": summary, "rounds": rounds}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

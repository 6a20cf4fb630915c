"""unison: data-parallel training of one PyTorch model on many processes,
with a choice of how the replicas agree.

>>> import unison
>>> topo = unison.init()                      # torchrun, mpirun, srun or alone
>>> model = unison.DataParallel(net)          # drop-in for torch DDP
"""

from . import algorithms
from .algorithms.gradient.qadam_optimizer import QAdamOptimizer
from .checkpoint import load, save
from .data import ShardSampler, sharded_loader
from .optim import DistributedOptimizer
from .parallel import DataParallel
from .runtime import RankFailure, Topology, detect_launch, init, node_mesh, shutdown, topology

__version__ = "0.1.0"

__all__ = [
    "DataParallel",
    "DistributedOptimizer",
    "QAdamOptimizer",
    "RankFailure",
    "ShardSampler",
    "Topology",
    "algorithms",
    "detect_launch",
    "init",
    "load",
    "node_mesh",
    "save",
    "sharded_loader",
    "shutdown",
    "topology",
]

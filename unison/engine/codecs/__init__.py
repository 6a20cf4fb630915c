"""The wire codecs: flat tensors turned into fewer bytes and back, with no communication.

One module a codec, each with its two schedules (``schedule``: the blocked loop
of the CPU, whole buffers elsewhere), its tests in ``tests/unit/codecs/``:

- ``minmax8``: 8-bit min-max chunks (bytegrad, qadam, low_precision_decentralized).
- ``halfcast``: fp16/bf16 casts in a buffer's own bytes (fp16, bf16, DiLoCo's and DASO's wire dtype).
- ``topk``: chunk-wise top-k with 2/4/8-bit values (SparseLoCo's flat form, DeMo's codes).
- ``tiles``, ``tiled_topk``: SparseLoCo's per-tensor tiles, their top-k and the mean over senders.
- ``dct``: DeMo's DCT (1-D chunks and 2-D tiles) and its float32 top-k.
- ``lowrank``: PowerSGD's factors, one step of power iteration.

Algorithms reach the codecs through this package (``from ...engine.codecs import MinMax8``).
"""

from .dct import FullTopK, dct_matrix
from .halfcast import WIRE_DTYPES, from_wire, to_wire, wire_dtype
from .lowrank import LowRank, orthogonalize
from .minmax8 import SIDE_BYTES, MinMax8, decode_, encode_, work_numel
from .schedule import BLOCKED, ENV, WHOLE, Schedule, schedule_for
from .tiled_topk import TiledTopK
from .tiles import TiledBuffer, Tiles
from .topk import TopK

__all__ = [
    "BLOCKED",
    "ENV",
    "SIDE_BYTES",
    "WHOLE",
    "WIRE_DTYPES",
    "FullTopK",
    "LowRank",
    "MinMax8",
    "Schedule",
    "TiledBuffer",
    "TiledTopK",
    "Tiles",
    "TopK",
    "dct_matrix",
    "decode_",
    "encode_",
    "from_wire",
    "orthogonalize",
    "schedule_for",
    "to_wire",
    "wire_dtype",
    "work_numel",
]

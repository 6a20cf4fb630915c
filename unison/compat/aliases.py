"""The other names the seeds give unison's options, so scripts keep their words:
``create("local_sgd", communication_interval=4)`` is ``create("local_sgd", period=4)``.

Data only, importing nothing: ``unison.algorithms.create`` reads this table
from below the compat layer (tests/integration/test_architecture.py allows this
one import upwards).
"""

#: algorithm name -> option -> the other names it takes (Bagua's, HeAT's, DiLoCo's).
ALIASES: dict[str, dict[str, tuple[str, ...]]] = {
    "local_sgd": {"period": ("communication_interval",)},  # Bagua's
    "decentralized": {"period": ("communication_interval",)},  # Bagua's
    "low_precision_decentralized": {"period": ("communication_interval",)},  # Bagua's
    "diloco": {"period": ("inner_steps",)},  # the DiLoCo paper's
    "daso": {"wire_dtype": ("downcast_type",)},  # HeAT's
}

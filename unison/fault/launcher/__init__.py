"""The processes that run a fault-tolerant job (``unison launch --fault-tolerant``, ``unison
coordinator``, ``unison agent``): the coordinator, which decides every membership; a node's
agent, which starts and restarts that node's workers; the template, which imports torch and
unison once and forks each worker from there; the status page.
"""

from .agent import Agent
from .coordinator import STALE_S, Coordinator, Settings
from .template import TemplateError

__all__ = ["STALE_S", "Agent", "Coordinator", "Settings", "TemplateError"]

"""Where the ``unison`` command sends the library's log records.

The library only names its loggers, all under ``unison`` (``unison.launch``
for the fault-tolerant coordinator, ``unison.bench``, ``unison.daso``, ...)
and installs no handler: a program that imports unison decides what to show,
the usual way (``logging.basicConfig``, or ``logging.getLogger("unison")``).
The command line is such a program: ``install`` gives the ``unison`` logger one
handler, rich's on a terminal when rich is installed, a plain one otherwise.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional, TextIO

#: One line per record, for pipes, files and the core install (no rich).
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def install(level: int = logging.INFO, stream: Optional[TextIO] = None) -> logging.Handler:
    """Show unison's records of ``level`` and above on ``stream`` (default: stderr); once per process.

    rich's handler when rich is importable and ``stream`` is a terminal;
    otherwise a ``logging.StreamHandler`` writing ``PLAIN_FORMAT`` (rich's
    handler wraps a long record over several lines at 80 columns when its
    output is not a terminal, which a reader of a log file or a pipe cannot
    grep). A level already set on the ``unison`` logger is kept.
    """
    logger = logging.getLogger("unison")
    for handler in logger.handlers:
        if getattr(handler, "unison_cli", False):
            return handler
    stream = sys.stderr if stream is None else stream
    rich = _rich_handler(stream) if _is_terminal(stream) else None
    handler = rich if rich is not None else _plain_handler(stream)
    handler.unison_cli = True  # type: ignore[attr-defined]  # found again by the next install
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(level)
    return handler


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _plain_handler(stream: TextIO) -> logging.Handler:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(PLAIN_FORMAT))
    return handler


def _rich_handler(stream: TextIO) -> Optional[logging.Handler]:
    """rich's handler on ``stream``, or None when rich is not installed (the core install)."""
    try:
        from rich.console import Console
        from rich.logging import RichHandler
    except ImportError:
        return None
    return RichHandler(console=Console(file=stream), show_path=False)

"""Logging: the library names loggers under ``unison``; the command line installs the one handler."""

import io
import logging
import sys

import pytest

from unison.apps import logs
from unison.fault.launcher import coordinator


@pytest.fixture
def unison_logger():
    """The ``unison`` logger, given back as it was (handlers and level)."""
    logger = logging.getLogger("unison")
    handlers, level = list(logger.handlers), logger.level
    logger.handlers[:] = []  # a test before it in this process may have installed the command line's
    logger.setLevel(logging.NOTSET)
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_command_line_shows_info_and_above_once_per_process(unison_logger):
    out = io.StringIO()
    handler = logs.install(stream=out)
    assert logs.install(stream=io.StringIO()) is handler  # a second install adds nothing
    assert [h for h in unison_logger.handlers if getattr(h, "unison_cli", False)] == [handler]
    assert unison_logger.level == logging.INFO
    logging.getLogger("unison.launch").info("regroup: epoch 1: members [0, 1] (worker(s) [0, 1] joined)")
    logging.getLogger("unison.launch").debug("not shown")
    (line,) = out.getvalue().splitlines()  # not piped through rich: one line per record
    assert line.endswith("INFO unison.launch: regroup: epoch 1: members [0, 1] (worker(s) [0, 1] joined)")


def test_a_level_the_user_set_is_kept(unison_logger):
    unison_logger.setLevel(logging.WARNING)
    logs.install(stream=io.StringIO())
    assert unison_logger.level == logging.WARNING


def test_rich_on_a_terminal_plain_without_rich(unison_logger, monkeypatch):
    pytest.importorskip("rich")
    from rich.logging import RichHandler

    assert isinstance(logs.install(stream=Terminal()), RichHandler)
    unison_logger.handlers[:] = []
    monkeypatch.setitem(sys.modules, "rich", None)  # the core install: `import rich` fails
    monkeypatch.delitem(sys.modules, "rich.logging", raising=False)
    monkeypatch.delitem(sys.modules, "rich.console", raising=False)
    handler = logs.install(stream=Terminal())
    assert type(handler) is logging.StreamHandler and handler.formatter._fmt == logs.PLAIN_FORMAT


def test_the_coordinator_logs_what_it_sees_at_its_level(caplog):
    boss = coordinator.Coordinator(coordinator.Settings(), None, host="127.0.0.1")
    assert boss.port > 0  # its store bound a port the OS picked
    with caplog.at_level(logging.INFO, logger="unison"):
        caplog.clear()  # what the construction logged, where an earlier test set the level to INFO
        boss.note("regroup", "epoch 1: members [0]")
        boss.note("failure", "worker 1 exited with -9")
        boss.note("abort", "too few members")
    seen = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert seen == [
        ("unison.launch", "INFO", "regroup: epoch 1: members [0]"),
        ("unison.launch", "WARNING", "failure: worker 1 exited with -9"),
        ("unison.launch", "ERROR", "abort: too few members"),
    ]
    assert [kind for _, kind, _ in boss.log] == ["regroup", "failure", "abort"]

"""Workers forked from a template process that has already imported the heavy modules.

``python script.py`` spends seconds importing torch before the script's first line (about 3 s
on a 2-core machine; torch's optimizers import ``torch._dynamo`` on first use, 3 s more), and a
replacement worker of a fault-tolerant job waits that long before it can heal. With
``unison launch --fault-tolerant --preload torch,unison ...`` the launcher starts one template
process that imports those modules once, then forks every worker (and every replacement) from
it. The template is forked from the launcher itself, before its store starts a thread (torch and
unison are imported already: about 2 s of CPU a launch), or, where the launcher already runs
threads of its own, started as a fresh ``python``. The child runs the script as ``python
script.py ARGS`` would: as ``__main__``, with ``sys.argv``, ``sys.path[0]`` the script's folder,
its exit code, its ``atexit`` handlers, in a session of its own, with the environment and the
stderr the launcher gives it.

The template is the launcher's child, in a session of its own (a terminal's Ctrl-C reaches the
launcher, which stops the workers in order); the workers are the template's children. The
launcher holds a ``Forked`` for each: the face of a ``subprocess.Popen`` (``pid``, ``poll``,
``wait``, ``returncode``, ``stderr``) whose exit status the template sends after reaping it.
When the launcher's end of the socket closes, the template exits.

Modules imported in the template read the launcher's environment at import time (a worker's
own variables, ``UNISON_FT_ID``, ``LOCAL_RANK``, are read later, by ``unison.init``). The
template never touches CUDA: forking after CUDA is initialized is not supported.

Example::

    unison launch --fault-tolerant --nproc 4 --preload torch,unison train.py --epochs 3
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, NoReturn, Optional, Sequence

#: Largest message between the launcher and the template (a worker's environment is most of it).
MAX_MESSAGE = 1 << 20
#: Seconds the launcher waits for the template's imports, and for each fork.
START_TIMEOUT_S = 120.0


class TemplateError(RuntimeError):
    """The template could not import a module of ``--preload``, or stopped answering."""


def exit_code(exc: SystemExit) -> int:
    """The exit status ``python`` gives a script that raised ``exc``: None is 0, an integer is
    itself, anything else is printed to stderr and is 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def run_script(argv: Sequence[str]) -> int:
    """Run ``argv[0]`` with arguments ``argv[1:]`` as ``python`` runs a script file, in this
    process, and return its exit status. An uncaught exception is printed by ``sys.excepthook``
    from the script's frame on and kept in ``sys.last_value`` (status 1; a KeyboardInterrupt:
    130, where ``python`` ends by SIGINT). The caller ends the process by ``SystemExit`` with it,
    so the interpreter's own end follows as after ``python script.py``: threading's exit callbacks,
    the non-daemon threads joined, the ``atexit`` handlers, objects finalized, files flushed."""
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        return exit_code(exc)
    except BaseException as exc:
        tb = exc.__traceback__  # from the script's frame on, as python prints it
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>"):
            tb = tb.tb_next
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc.with_traceback(tb), tb
        sys.excepthook(type(exc), exc, tb)
        return 128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    return 0


# ---- the template process ---------------------------------------------------------------------


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode())


def _fresh_random_state() -> None:
    """Give this forked process the random state a new ``python`` would have (Python's
    ``random`` reseeds itself after a fork): torch's default generator seeded anew from the OS
    (or at torch's fixed default seed, where torch starts from it), numpy's global one from the OS."""
    torch = sys.modules.get("torch")
    if torch is not None:
        fixed = torch.Generator().initial_seed()  # the seed a generator starts from
        if torch.initial_seed() == fixed:
            torch.manual_seed(fixed)
        else:
            torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _child(sock: socket.socket, wake: tuple[int, int], request: dict[str, Any], fds: list[int]) -> NoReturn:
    """In the forked worker: leave the template's plumbing, take the request's session, stderr,
    folder and environment, run the script and end with its status: ``SystemExit`` out of the
    template's ``serve``, through the interpreter's usual end. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in wake:
            os.close(fd)
        os.setsid()
        os.dup2(fds[0], 2)
        os.close(fds[0])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_random_state()
        code = run_script(request["argv"])
    except BaseException:
        traceback.print_exc()
    raise SystemExit(code)


def _reap(sock: socket.socket) -> None:
    """Send the exit status of every child that has ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def main(fd: int, modules: Sequence[str]) -> NoReturn:
    """The template process's program: ``serve`` on the socket ``fd``, then exit at once (the
    interpreter's teardown of torch would take the launcher's last second)."""
    serve(socket.socket(fileno=fd), modules)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def serve(sock: socket.socket, modules: Sequence[str]) -> None:
    """The template: import ``modules``, say so, then fork a worker for each request and report
    each worker's exit, until the launcher's end of ``sock`` closes."""
    try:
        for name in modules:
            importlib.import_module(name)
    except BaseException as exc:
        _send(sock, {"error": f"cannot import {name!r}: {type(exc).__name__}: {exc}"})
        return
    _send(sock, {"ready": True})
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a child's end wakes the select below
    signal.set_wakeup_fd(w)
    while True:
        ready, _, _ = select.select([sock.fileno(), r], [], [])
        if r in ready:
            while True:
                try:
                    if not os.read(r, 512):
                        break
                except BlockingIOError:
                    break
        _reap(sock)
        if sock.fileno() in ready:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
            if not data:
                return  # the launcher is gone; its workers go on by themselves
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                _child(sock, (r, w), request, fds)
            for fd in fds:
                os.close(fd)
            _send(sock, {"started": pid})


# ---- the launcher's side ----------------------------------------------------------------------


def _one_thread() -> bool:
    """Whether this process runs one thread of Python and no thread of a store or a group (the
    thread torch starts at its import aside): then a fork of it is as sound as a DataLoader's."""
    if threading.active_count() > 1:
        return False
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:  # no /proc: start a fresh interpreter
        return False
    return threads <= 2


def _forked_template(ours: socket.socket, theirs: socket.socket, modules: Sequence[str]) -> NoReturn:
    """In the template forked from the launcher: torch and unison are imported already (the
    launcher's own imports, about 2 s of CPU a launch saved). What the launcher set for itself is
    put back as a fresh interpreter has it (its log handler, its quick end), then ``main``, which
    ends the template with ``os._exit``. A worker forked from it leaves by ``SystemExit`` (its
    script's status), up through the launcher's frames, none of which catches it, to the
    interpreter's usual end."""
    template = os.getpid()
    try:
        ours.close()
        os.setsid()
        logger = logging.getLogger("unison")
        for handler in [h for h in logger.handlers if getattr(h, "unison_cli", False)]:
            logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
        from ...runtime import ending

        ending.quick_exit(False)
        # Detached: the launcher's frames (a worker's too) keep this object, which would close the
        # descriptor's number again when they are freed, by then another socket's (the store's).
        main(theirs.detach(), modules)
    finally:
        if os.getpid() == template:  # the template itself: an error of its own
            os._exit(1)


class _ForkedTemplate:
    """The template forked from the launcher, with the face of ``subprocess.Popen`` that
    ``Template`` uses: ``poll()``, ``wait(timeout)`` and ``kill()``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("the --preload template", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Forked:
    """A worker forked by the template, with the face of ``subprocess.Popen`` that the
    coordinator uses: ``pid``, ``stderr`` (the read end of its stderr), ``returncode``,
    ``poll()``, ``wait(timeout)``, ``send_signal``, ``terminate`` and ``kill``."""

    def __init__(self, template: "Template", pid: int, stderr: Any) -> None:
        self.template, self.pid, self.stderr = template, pid, stderr
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.template.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Template:
    """The launcher's handle on its template process: ``spawn(argv, env)`` forks a worker.

    The template starts importing ``modules`` at once; the first ``spawn`` waits for it (up to
    ``START_TIMEOUT_S``) and raises ``TemplateError`` if an import failed. ``close()`` ends it.

    Args:
        modules: the modules to import once (``["torch", "unison"]``).
    """

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = list(modules)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process: Any
        if _one_thread():  # the launcher before its store: the template is forked from it
            pid = os.fork()
            if pid == 0:
                _forked_template(ours, theirs, self.modules)
            self.process = _ForkedTemplate(pid)
        else:
            code = (
                "import sys; from unison.fault.launcher import template; template.main(int(sys.argv[1]), sys.argv[2:])"
            )
            self.process = subprocess.Popen(
                [sys.executable, "-c", code, str(theirs.fileno()), *self.modules],
                pass_fds=[theirs.fileno()],
                start_new_session=True,
            )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()  # one fork at a time
        self.cond = threading.Condition()
        self.exits: dict[int, int] = {}
        self.started: list[int] = []
        self.ready: Optional[bool] = None
        self.error: Optional[str] = None
        self.gone = False
        self.reader = threading.Thread(target=self._read, name="unison-template", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            with self.cond:
                if not data:
                    self.gone = True
                    self.cond.notify_all()
                    return
                message = json.loads(data)
                if "exited" in message:
                    self.exits[message["exited"]] = message["code"]
                elif "started" in message:
                    self.started.append(message["started"])
                elif "ready" in message:
                    self.ready = True
                elif "error" in message:
                    self.error = message["error"]
                self.cond.notify_all()

    def _await(self, what: Any) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: what() or self.gone or self.error, START_TIMEOUT_S):
                raise TemplateError(f"the --preload template did not answer within {START_TIMEOUT_S:.0f} s")
            if self.error is not None:
                raise TemplateError(f"--preload: the template {self.error}")
            if not what():
                raise TemplateError(f"the --preload template exited (code {self.process.poll()})")

    def spawn(self, argv: Sequence[str], env: dict[str, str]) -> Forked:
        """Fork a worker running ``argv`` (``[python, script, *args]``: the script and its
        arguments are run) with environment ``env``; its stderr comes through a pipe."""
        self._await(lambda: self.ready)
        read, write = os.pipe()
        try:
            with self.lock:
                request = {"argv": list(argv[1:]), "env": dict(env), "cwd": os.getcwd()}
                socket.send_fds(self.sock, [json.dumps(request).encode()], [write])
                self._await(lambda: self.started)
                with self.cond:
                    pid = self.started.pop(0)
        finally:
            os.close(write)
        return Forked(self, pid, os.fdopen(read, "rb", buffering=0))

    def exit_code(self, pid: int) -> Optional[int]:
        """The exit status of worker ``pid`` once the template reaped it, else None. If the
        template itself is gone, a worker that no longer exists ended unseen: status 1."""
        with self.cond:
            if pid in self.exits:
                return self.exits[pid]
            gone = self.gone
        if gone:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return 1
        return None

    def close(self) -> None:
        """End the template (its workers, if any are left, go on by themselves)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

"""A starter of ``elaswave`` commands for the tests, forked from a process that has
already imported torch and ElasWave, so a command starts in milliseconds instead of the
3-4 s a fresh interpreter takes on the 2-core host (what ElasWave's own zygote does for a
job's Core and workers, :mod:`elaswave.runtime.host.zygote`).

A command run this way is a process of its own: ``elaswave.cli.main.main(argv)`` in a
child forked from a single-threaded server that has only imported modules, with the
caller's environment, working directory and standard streams (passed as SCM_RIGHTS), its
exit code reported when the server reaps it. :func:`tests.runs.elaswave`,
:func:`tests.runs.launch` and :func:`tests.runs.background_job` start commands here. What
a fresh interpreter does and a fork does not (import-time environment, the ``python -m``
entry point) stays tested by the commands the tests exec: the README's command
(``tests/fault/test_run_script.py``, ``fresh=True``), the start-up tests, the hosts of
``tests/fault/test_multihost.py``, ``scripts/gpu_check`` and the examples.
``ELASWAVE_TEST_EXEC=1`` makes every command exec.

The server is started on first use, one per test process, and dies with it.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

EXEC_ENV = "ELASWAVE_TEST_EXEC"
PRELOAD = (
    "elaswave.cli.main",
    "elaswave.cli.config_file",
    "elaswave.runtime.host.launcher",
    "elaswave.runtime.core.process",
    "elaswave.runtime.worker.process",
)


def enabled() -> bool:
    return os.environ.get(EXEC_ENV, "") in ("", "0")


class _Client:
    """The test process's handle on its server."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="elaswave-forkserver-")
        self.path = str(Path(self._dir.name) / "sock")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver", self.path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            cwd=Path(__file__).resolve().parents[1],
        )
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the test fork server did not start ({self.proc.returncode})")
            time.sleep(0.02)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        self._dir.cleanup()


_client: _Client | None = None


def _server() -> _Client:
    global _client
    if _client is None or _client.proc.poll() is not None:
        _client = _Client()
        atexit.register(_client.close)
    return _client


PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL


class Command:
    """An ``elaswave`` command the server started, with what the tests use of
    ``subprocess.Popen`` (text streams)."""

    def __init__(self, argv: list[str], conn: socket.socket, pid: int,
                 streams: tuple[IO[str] | None, IO[str] | None]) -> None:  # fmt: skip
        self.args = ["elaswave", *argv]
        self.pid = pid
        self.returncode: int | None = None
        self.stdout, self.stderr = streams
        self._conn = conn
        self._buffer = b""

    def poll(self) -> int | None:
        return self._answer(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._answer(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """The rest of the piped streams, read to their ends, and the exit."""
        deadline = None if timeout is None else time.monotonic() + timeout
        texts: dict[int, str] = {}

        def read(i: int, stream: IO[str]) -> None:
            texts[i] = stream.read()

        streams = enumerate((self.stdout, self.stderr))  # a second call: both closed
        readers = [threading.Thread(target=read, args=(i, f), daemon=True)
                   for i, f in streams if f is not None and not f.closed]  # fmt: skip
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.01))
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return texts.get(0), texts.get(1)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _answer(self, timeout: float | None) -> int | None:
        """The exit code, once the server has sent it; None if not within ``timeout``."""
        if self.returncode is not None:
            return self.returncode
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            readable, _, _ = select.select([self._conn], [], [], left)
            if not readable:
                return None
            data = self._conn.recv(4096)
            if not data:
                raise RuntimeError(f"the test fork server has gone ({' '.join(self.args)})")
            self._buffer += data
        self.returncode = int(json.loads(self._buffer.split(b"\n", 1)[0])["exit"])
        self._conn.close()
        return self.returncode


def start(argv: list[str], *, stdout: int | IO[Any] = PIPE, stderr: int | IO[Any] = PIPE,
          env: dict[str, str] | None = None) -> Command:  # fmt: skip
    """``elaswave ARGV`` started, as ``subprocess.Popen(..., text=True)`` would: each
    stream PIPE, DEVNULL or an open file."""
    mine: list[int] = []  # the descriptors to close here once the server has its copies
    ours: list[IO[str] | None] = []
    theirs: list[int] = [os.open(os.devnull, os.O_RDONLY)]
    mine.append(theirs[0])
    for spec in (stdout, stderr):
        if spec == PIPE:
            r, w = os.pipe()
            ours.append(open(r, encoding="utf-8", errors="replace"))  # noqa: SIM115
            theirs.append(w)
            mine.append(w)
        elif spec == DEVNULL:
            theirs.append(os.open(os.devnull, os.O_WRONLY))
            mine.append(theirs[-1])
            ours.append(None)
        else:
            theirs.append(spec.fileno())  # type: ignore[union-attr]
            ours.append(None)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(_server().path)
        request = {"argv": argv, "env": dict(os.environ if env is None else env),
                   "cwd": os.getcwd()}  # fmt: skip
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], theirs)
        reply = b""
        while b"\n" not in reply:
            data = conn.recv(4096)
            if not data:
                raise RuntimeError(f"the test fork server refused elaswave {argv}")
            reply += data
    except BaseException:
        conn.close()
        raise
    finally:
        for fd in mine:
            os.close(fd)
    line, rest = reply.split(b"\n", 1)
    command = Command(argv, conn, int(json.loads(line)["pid"]), (ours[0], ours[1]))
    command._buffer = rest
    return command


def run(argv: list[str], *, timeout: float) -> subprocess.CompletedProcess:
    """``elaswave ARGV`` to its end, as ``subprocess.run(capture_output=True, text=True)``
    would run it (``subprocess.TimeoutExpired`` past ``timeout``, the command killed)."""
    command = start(argv)
    try:
        stdout, stderr = command.communicate(timeout)
    except subprocess.TimeoutExpired:
        command.kill()
        raise
    assert command.returncode is not None
    return subprocess.CompletedProcess(command.args, command.returncode, stdout, stderr)


# The server.


def _serve(path: str) -> None:
    from elaswave.runtime.host.zygote import LAZY_IMPORTS
    from elaswave.runtime.job.child import die_with_parent

    die_with_parent()
    for name in (*PRELOAD, *LAZY_IMPORTS):
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for the name: bound and listening
    owners: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            conn, _ = listener.accept()
            pid = _start(conn, [listener, *owners.values()])
            if pid is None:
                conn.close()
            else:
                owners[pid] = conn
        _reap(owners)


def _start(conn: socket.socket, others: list[socket.socket]) -> int | None:
    """Fork the command ``conn`` asks for; its pid. ``others``: the server's other
    sockets, closed in the child (its job's processes would hold them open)."""
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while message and not message.endswith(b"\n"):  # a stream: the rest may come later
        more = conn.recv(1 << 20)
        if not more:
            break
        message += more
    if not message.endswith(b"\n") or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return None
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        for sock in (*others, conn):
            sock.close()
        _child(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def _child(request: dict[str, Any], fds: list[int]) -> None:
    from elaswave.cli import main as cli
    from elaswave.runtime.job.child import exit_now

    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _reopen_standard_streams()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["elaswave", *request["argv"]]
        code = cli.main(request["argv"])
    except SystemExit as exc:  # argparse's errors and --help
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        exit_now(code)


def _reopen_standard_streams() -> None:
    """``sys.stdin``, ``sys.stdout`` and ``sys.stderr`` made for the descriptors the
    caller passed, as a fresh interpreter makes them (the server's were made for
    /dev/null: seekable, block-buffered)."""
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        old = getattr(sys, name)
        line = name == "stderr" or os.isatty(fd)
        new = os.fdopen(fd, mode, buffering=1 if line and mode == "w" else -1,
                        encoding=old.encoding, errors=old.errors, closefd=False)  # fmt: skip
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


def _reap(owners: dict[int, socket.socket]) -> None:
    while owners:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = owners.pop(pid, None)
        if conn is not None:
            answer = {"exit": os.waitstatus_to_exitcode(status)}
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(answer).encode() + b"\n")
            conn.close()


if __name__ == "__main__":
    _serve(sys.argv[1])

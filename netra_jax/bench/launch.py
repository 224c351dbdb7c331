"""`netra-jax bench serve --launch`: start `netra-jax serve --warmup full` as a subprocess on a free loopback port,
wait until its /ready answers 200 (model loaded, every program compiled: no background compile competes with the
sweep), hand its URL to the sweep, then SIGTERM it and wait."""

from __future__ import annotations

import contextlib
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

SERVE_COMMAND = [sys.executable, "-m", "netra_jax.cli"]  # + ["serve", *server args, "--host", H, "--port", P]
STOP_TIMEOUT_S = 60.0  # after SIGTERM (the server drains for up to its --drain-timeout, 30 s by default)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_ready(proc: subprocess.Popen, url: str, timeout: float, log: Path, headers: dict | None = None) -> float:
    """Poll `url`/ready until 200; SystemExit (with the log's tail) if the server exits or the time runs out."""
    t0 = time.monotonic()
    with httpx.Client(timeout=5.0) as client:
        while True:
            if proc.poll() == 2:  # it refused to start (a model that cannot load, a bad flag): its last line says why
                why = _tail(log, 1) or "exit status 2"
                print(f"netra-jax bench serve: the launched server did not start: {why}", file=sys.stderr)
                raise SystemExit(2)
            if proc.poll() is not None:
                raise SystemExit(f"the launched server exited with status {proc.returncode}:\n{_tail(log)}")
            try:
                if client.get(url + "/ready", headers=headers or {}).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout:
                raise SystemExit(f"the launched server was not ready after {timeout:g}s:\n{_tail(log)}")
            time.sleep(0.5)


def stop(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM, wait up to `timeout` s, then SIGKILL; the exit status (-15: died of the signal itself)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            print(f"the launched server did not stop within {timeout:g}s of SIGTERM; killing it", file=sys.stderr)
            proc.kill()
            proc.wait()
    return proc.returncode


@contextlib.contextmanager
def launched(
    server_args: str = "",
    host: str = "127.0.0.1",
    timeout: float = 1800.0,
    log_path: str | None = None,
    headers: dict | None = None,
    pid_file: str | None = None,
) -> Iterator[str]:
    """Run `netra-jax serve SERVER_ARGS [--warmup full] --host HOST --port <free>` (full unless SERVER_ARGS says
    otherwise) for the duration of the block, which gets the base
    URL once the server is ready. Its output goes to `log_path` (default: a file in the temp directory); its process
    id to `pid_file` when given (the server runs in its own session: a caller killed before the block ends can be
    cleaned up after by that id)."""
    port = free_port(host)
    args = shlex.split(server_args)
    full = [] if any(a == "--warmup" or a.startswith("--warmup=") for a in args) else ["--warmup", "full"]
    cmd = [*SERVE_COMMAND, "serve", *args, *full, "--host", host, "--port", str(port)]
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"netra-jax-serve-{port}-", suffix=".log")
        with open(fd, "w"):
            pass
    log = Path(log_path)
    log.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://{host}:{port}"
    print(f"launching: netra-jax {shlex.join(cmd[len(SERVE_COMMAND) :])} (output in {log})", flush=True)
    with open(log, "ab") as out:  # a new session: a Ctrl-C on the benchmark does not reach the server first
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    if pid_file:
        Path(pid_file).write_text(str(proc.pid))
    try:
        secs = wait_ready(proc, url, timeout, log, headers)
        print(f"server ready on {url} after {secs:.1f}s", flush=True)
        yield url
    finally:
        rc = stop(proc)
        print(f"server stopped (exit status {rc})", flush=True)

"""A server in a child process on a free port of 127.0.0.1: started, waited for (`GET /health`), and stopped with
SIGTERM, every step with a time limit. The load generator (`serve_load.py`) and the tests run servers this way."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


@dataclass
class LocalServer:
    """A server started by `start`; its output goes to `log_path`."""

    process: subprocess.Popen
    port: int
    log_path: Path

    @classmethod
    def start(cls, command: list[str], port: int, log_path: Path, env: dict[str, str] | None = None) -> "LocalServer":
        """Starts `command` (which must serve on 127.0.0.1:`port`) in a session of its own, so that `kill` reaches
        the processes it starts too."""
        log = open(log_path, "wb")
        try:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        finally:
            log.close()  # the child holds its own copy
        return cls(process, port, Path(log_path))

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        """Returns once `GET /health` answers 200; raises RuntimeError if the server exits first (with the end of
        its log), TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server did not answer /health within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float) -> int:
        """SIGTERM, then its exit status; if it has not exited after `timeout` seconds, it is killed (with what it
        started) and TimeoutError is raised."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"the server did not exit within {timeout:.0f} s of SIGTERM:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL to the server's session: the server and the processes it started."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


__all__ = ["HOST", "LocalServer", "free_port"]

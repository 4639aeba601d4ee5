"""Helpers for tests that run a server (``vllm serve``) as a subprocess of its own process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess


def free_port() -> int:
    """A local TCP port nothing listens on (free when probed; the server binds it next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def end_group(process: subprocess.Popen) -> None:
    """End ``process`` and its children (started with ``start_new_session=True``): SIGTERM, then
    SIGKILL after a minute; vLLM's engine core is a child that a plain terminate would leave."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

"""A Ray cluster of several nodes on this machine, started as a user scaling vLLM out starts one
(``ray start --head``, then ``ray start --address=HEAD`` per further node), for
release/test_ray.py.

Each node is ``ray start --block`` in a session of its own, with its own share of the
resources (``--num-cpus``, one ``NPU`` each: what vLLM's Ray executor places its ranks by) and
its own ports where two nodes of one machine would collide (the dashboard agent's, the
runtime-environment agent's, the metrics export's).  Every node is given
``--node-ip-address=127.0.0.1``; Ray itself turns that into the host's own address
(``ray._private.services.resolve_ip_for_localhost``: "make sure localhost isn't resolved to
the loopback ip"), and its GCS and raylets listen on every interface, as on any host: the
traffic stays on this machine (between its own addresses), but Ray offers no setting that
binds a multi-node cluster to loopback alone (docs/multi-host.md).

The cluster is stopped by the ids of the processes it started: SIGTERM to each node's
``ray start --block`` (which stops what it started), then SIGKILL to whatever is left in the
nodes' sessions (Ray's workers, each in a process group of its own, stay in their node's
session).  Its logs (Ray's session folder: each worker's ``worker-*.out``) are copied out
before its temporary folder goes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# this folder's (on sys.path as the check's folder)
from serving import free_port

START_S = 120  # a node's start (Ray's own processes; no model yet)
STOP_S = 30  # SIGTERM's grace, before SIGKILL


@dataclass(frozen=True)
class Cluster:
    """A running cluster: the address a driver joins (``RAY_ADDRESS``) and its nodes' sessions."""

    address: str
    sessions: tuple[int, ...]  # each node's ``ray start --block``: the session id of its processes
    temp_dir: Path  # Ray's --temp-dir: its session folder (logs, sockets) is under it

    def logs(self) -> Path:
        """Ray's log folder of this cluster (every node's, one session)."""
        return self.temp_dir / "session_latest" / "logs"


def in_sessions(sessions: tuple[int, ...]) -> list[int]:
    """The pids of the live processes in ``sessions`` (Linux's /proc: each one's session id; a
    zombie, ended and not yet reaped by whoever adopted it, is not live)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # "pid (comm) state ppid pgrp session ...": comm may hold spaces, so after its ')'
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) in sessions and fields[0] != "Z":
                found.append(int(stat.parent.name))
    return found


def _wait_started(proc: subprocess.Popen[bytes], log: Path, what: str) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if "Ray runtime started." in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what} ended (exit {proc.returncode}) before it started:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not start within {START_S} s:\n{log.read_text()[-4000:]}")


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop the nodes ``procs`` started, by their processes' ids: the last node first."""
    sessions = tuple(p.pid for p in procs)
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for pid in in_sessions(sessions):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + STOP_S  # a killed process is gone once the kernel has ended it
    while in_sessions(sessions) and time.monotonic() < deadline:
        time.sleep(0.1)


@contextlib.contextmanager
def cluster(ray: Path, env: dict[str, str], keep_logs: Path, nodes: int = 2, cpus: int = 2) -> Iterator[Cluster]:
    """``nodes`` Ray nodes on this machine, started by the ``ray`` command with ``env``, each
    with ``cpus`` CPUs and one NPU; stopped on exit, their logs copied into ``keep_logs``."""
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's unix sockets live under it
    port = free_port()
    env = {**env, "RAY_USAGE_STATS_ENABLED": "0"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for node in range(nodes):
            args = [
                str(ray),
                "start",
                "--block",
                "--node-ip-address=127.0.0.1",
                f"--num-cpus={cpus}",
                "--resources=" + json.dumps({"NPU": 1}),
                "--object-store-memory=300000000",  # the engines pass no tensors through it
                "--disable-usage-stats",
            ]
            if node == 0:
                args += ["--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp_dir}"]
            else:  # the ports two nodes of one machine would both take by default
                args += [f"--address=127.0.0.1:{port}"]
                args += [f"--{name}-port={free_port()}" for name in ("dashboard-agent-listen", "dashboard-agent-grpc")]
                args += [f"--{name}-port={free_port()}" for name in ("runtime-env-agent", "metrics-export")]
            log = temp_dir / f"node-{node}.log"
            with log.open("wb") as out:
                procs.append(
                    subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                )
            _wait_started(procs[-1], log, f"Ray node {node} ({'head' if node == 0 else 'worker'})")
        yield Cluster(address=f"127.0.0.1:{port}", sessions=tuple(p.pid for p in procs), temp_dir=temp_dir)
    finally:
        stop(procs)
        keep_logs.mkdir(parents=True, exist_ok=True)
        for log in temp_dir.glob("node-*.log"):
            shutil.copy(log, keep_logs / log.name)
        # each worker's own output (a rank's log lines, not deduplicated as the driver's are) and
        # each node's raylet's (which worker processes it started)
        for pattern in ("worker-*.out", "worker-*.err", "raylet*.out"):
            for log in (temp_dir / "session_latest" / "logs").glob(pattern):
                (keep_logs / "ray-logs").mkdir(exist_ok=True)
                shutil.copy(log, keep_logs / "ray-logs" / log.name)
        shutil.rmtree(temp_dir, ignore_errors=True)

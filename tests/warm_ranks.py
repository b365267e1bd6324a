"""Warm ranks: one real `mpirun -np N` job that runs the suite's ordinary launches one
after another in the same processes (started by tests/mpirun.py, never by a test).

A launch on 2 cores spends 5-15 s importing torch (2.8 s of CPU per rank, 2.2 s more
for the optimizer's first import of torch._dynamo), TensorFlow (5 s per rank), MPI and
h5py, and under a second training a test's small run. Here each rank imports once and
then, per request, runs `hpctrain ARGS...` (hpctrain.cli.main) or `python SCRIPT ARGS...`
(runpy) with its stdout and stderr in its own file, exactly as the dump scripts already
run several runs per launch: every run builds its own World use, loop and backend, and
reseeds every random stream.

Protocol: rank 0 accepts one connection at a time on the Unix socket argv[1] and reads
one JSON line {"cmd": [...], "cwd": DIR, "out": DIR, "env": {...}}; every rank runs it and writes
out/rank<r>.log; rank 0 answers {"codes": [exit code per rank]}. An empty cmd ends the
job. After a run that started Horovod (its background thread would cost every later
run CPU), or `hpctrain doctor` (see _probed), the job answers with "retired": true and
ends.
A run that aborts (MPI_Abort, a killed rank) ends this job as it would end its own
launch; tests/mpirun.py then reports the job's exit code and output.

Idle ranks wait in a non-blocking barrier polled every 50 ms at most, not in a spinning
collective: an idle job costs no CPU beside the tests' own jobs. After 15 minutes
without a launch (or once the test session that started it is gone) the job ends.

A spare (tests/mpirun.py starts it under `nice -n 19` with HPCTRAIN_WARM_PRELOAD=1)
imports what a launch would before it serves, on whatever CPU the suite leaves idle;
its first request puts every thread of its ranks back at the suite's priority (where
the user may raise it: root here; otherwise the job keeps running niced).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import runpy
import socket
import sys
import time
import traceback

from mpi4py import MPI

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
IDLE_TIMEOUT_S = 900


def _quiet_barrier(first_s: float = 0.001, most_s: float = 0.05) -> None:
    """A barrier that sleeps between polls, 1 ms at first and then longer, up to 50 ms:
    an idle rank costs 0.2-0.3% of a core (polled every 5 ms it was 1.3%, and the
    suite keeps up to 15 ranks warm), and a launch waits at most 50 ms for it."""
    request = COMM.Ibarrier()
    sleep = first_s
    while not request.Test():
        time.sleep(sleep)
        sleep = min(most_s, sleep * 2)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    sys.stderr.write(f"{exc.code}\n")  # what the interpreter prints for sys.exit("text")
    return 1


def _run(cmd: list[str]) -> int:
    """One launch's command in this process; its exit code."""
    from hpctrain.runtime.logs import set_verbose

    set_verbose(False)  # --verbose is sticky in a process; a launch starts without it
    try:
        if os.path.basename(cmd[0]) == "hpctrain":
            from hpctrain.cli import main

            sys.argv = list(cmd)
            return main(cmd[1:])
        sys.argv = list(cmd[1:])
        runpy.run_path(cmd[1], run_name="__main__")
        return 0
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException:  # noqa: BLE001 - what the interpreter would print, then status 1
        traceback.print_exc()
        return 1


def _launch_path(cmd: list[str], pythonpath: str, path: list[str]) -> list[str]:
    """sys.path as the launch's own interpreter would start: the program's directory
    first (the console script's for `hpctrain`, the script's for `python SCRIPT`; never
    tests/, this file's, so a user module is found only where the product looks), then
    PYTHONPATH, then the interpreter's own (`path` without its first entry)."""
    program = cmd[0] if os.path.basename(cmd[0]) == "hpctrain" else cmd[1]
    extra = [p for p in pythonpath.split(os.pathsep) if p]
    return [os.path.dirname(os.path.abspath(program)), *extra, *path[1:]]


def _run_captured(request: dict) -> int:
    """Run with fds 1 and 2 in out/rank<r>.log (children inherit them), in request's cwd,
    with its run-level environment (tests/mpirun.py: faults, PYTHONPATH) for this run."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log = os.open(
        os.path.join(request["out"], f"rank{RANK}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    )
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    cwd, env, path, argv = os.getcwd(), dict(os.environ), list(sys.path), sys.argv
    try:
        os.chdir(request["cwd"])
        os.environ.update(request["env"])
        sys.path[:] = _launch_path(request["cmd"], request["env"].get("PYTHONPATH", ""), path)
        return _run(request["cmd"])
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:], sys.argv = path, argv
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        os.chdir(cwd)


def _horovod_started() -> bool:
    """Horovod's background thread would cost every later run CPU: retire the job."""
    for name in ("horovod.torch", "horovod.tensorflow"):
        module = sys.modules.get(name)
        if module is not None and module.is_initialized():
            return True
    return False


def _probed(request: dict) -> bool:
    """`hpctrain doctor` probes both frameworks' Horovod builds and then makes the World:
    a Horovod torch run after it in the same process averaged nothing (comm_share 0.01,
    weights 0.16 off after 6 steps; never a user's case, who runs doctor on its own)."""
    cmd = request["cmd"]
    return os.path.basename(cmd[0]) == "hpctrain" and "doctor" in cmd[1:2]


def _preload() -> None:
    """What a first launch imports: torch (with torch._dynamo, which the optimizer's first
    step imports), TensorFlow, both backends, h5py and the CLI."""
    import h5py  # noqa: F401
    import torch._dynamo  # noqa: F401

    import hpctrain.backends.tensorflow  # noqa: F401
    import hpctrain.backends.torch  # noqa: F401
    import hpctrain.cli  # noqa: F401


def _unnice() -> None:
    """Every thread of this rank back to priority 0 (nice applies per thread on Linux);
    without the privilege to raise it, the rank stays as it is."""
    if os.getpriority(os.PRIO_PROCESS, 0) <= 0:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # not permitted, or the thread has ended
            os.setpriority(os.PRIO_PROCESS, int(tid), 0)


def _read_request(conn: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            return {"cmd": []}
        data += chunk
    return json.loads(data)


def serve(socket_path: str) -> None:
    server = None
    if os.environ.pop("HPCTRAIN_WARM_PRELOAD", None) == "1":  # not in the runs' environment
        _preload()
        gc.collect()
        gc.freeze()
        _quiet_barrier()  # rank 0 listens (the job is ready) once every rank has imported
    if RANK == 0:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(socket_path)
        server.listen(1)
        # No launch for this long (or a test session that died without closing the job):
        # the job ends; tests/mpirun.py starts another when one is needed.
        server.settimeout(IDLE_TIMEOUT_S)
    while True:
        conn, request = None, None
        if RANK == 0:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                request = {"cmd": []}
            else:
                conn.settimeout(None)
                request = _read_request(conn)
        _quiet_barrier()
        request = COMM.bcast(request, root=0)
        if not request["cmd"]:
            break
        _unnice()
        code = _run_captured(request)
        # what the run left is freed now (a fresh process's next launch would hold none
        # of it: its memory figures start clean), and what outlives it (modules,
        # caches) is frozen, so these collections scan only what the last run made
        gc.collect()
        gc.freeze()
        _quiet_barrier()
        codes = COMM.gather(code, root=0)
        retire = COMM.allreduce(int(_horovod_started() or _probed(request)), op=MPI.MAX)
        if RANK == 0:
            conn.sendall((json.dumps({"codes": codes, "retired": bool(retire)}) + "\n").encode())
            conn.close()
        if retire:
            break
    if RANK == 0:
        server.close()
        os.unlink(socket_path)


if __name__ == "__main__":
    serve(sys.argv[1])

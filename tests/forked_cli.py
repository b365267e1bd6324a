"""`hpctrain ARGS` as its own process, without paying the interpreter's start each time.

One server process imports the CLI once (no MPI, no framework: `import hpctrain.cli`
loads neither), then forks a child per call that runs `hpctrain.cli.main(ARGS)` with
its stdout and stderr in files: every call starts from the same clean process state a
fresh `hpctrain` has (no World, no --verbose left over, its own exit code), which a call
inside the test process could not promise once another test started a World there.
The SLURM renderer's 106 tests, about a hundred calls: 17 s this way, about 55 s with
a `hpctrain` process started for each call (measured on this 2-core machine).

Protocol (stdin/stdout of the server, one JSON line each): {"argv": [...], "env": {...},
"cwd": DIR} -> {"code": N, "stdout": "...", "stderr": "..."}; the child takes the
caller's environment and working directory at the call, as a subprocess would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

_SERVER = r"""
import json, os, sys, tempfile, traceback
import hpctrain.cli


def read(path):
    with open(path, errors="replace") as f:
        return f.read()


for line in sys.stdin:
    request = json.loads(line)
    argv = request["argv"]
    with tempfile.TemporaryDirectory() as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        pid = os.fork()
        if pid == 0:
            os.environ.clear()
            os.environ.update(request["env"])
            os.chdir(request["cwd"])
            fds = [os.open(p, os.O_WRONLY | os.O_CREAT) for p in (out, err)]
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            sys.argv = ["hpctrain", *argv]
            code = 1
            try:
                code = hpctrain.cli.main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if isinstance(exc.code, str):
                    sys.stderr.write(exc.code + "\n")
            except BaseException:  # what the interpreter prints, then status 1
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code if isinstance(code, int) else 1)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        texts = [read(p) for p in (out, err)]
    sys.stdout.write(json.dumps({"code": code, "stdout": texts[0], "stderr": texts[1]}) + "\n")
    sys.stdout.flush()
"""


class ForkedCli:
    """A server of `hpctrain` calls for one test module (`close()` ends it)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        """`hpctrain` + argv[1:] (argv[0] names the program, as for subprocess.run)."""
        with self.lock:
            request = {"argv": list(argv[1:]), "env": dict(os.environ), "cwd": os.getcwd()}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            timer = threading.Timer(timeout, self.proc.kill)
            timer.start()
            try:
                line = self.proc.stdout.readline()
            finally:
                timer.cancel()
        if not line:
            raise AssertionError(f"the CLI server ended (or {timeout} s passed) during {argv}")
        answer = json.loads(line)
        return subprocess.CompletedProcess(argv, answer["code"], answer["stdout"], answer["stderr"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()

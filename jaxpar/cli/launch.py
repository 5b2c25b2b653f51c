"""`jaxpar-launch -n K [--devices-per-process D] -- COMMAND ...`: K local processes of one distributed run.

Starts COMMAND K times with the coordinator on 127.0.0.1 at a free port, passing each process its index through
JAXPAR_COORDINATOR_ADDRESS / JAXPAR_NUM_PROCESSES / JAXPAR_PROCESS_ID (read by `jaxpar.parallel.distributed`) and, with
`--devices-per-process`, its CPU device count (JAX_NUM_CPU_DEVICES). Output lines are prefixed `[i]`; the
libraries' own chatter (Gloo's connection lines, absl INFO lines, XLA's slow-compile banner) is left out, errors and
anything unknown are shown (jaxpar/cli/output_filter.py), and `--verbose` shows every line as printed. When a
process fails, the others are terminated (SIGTERM, then SIGKILL after `--grace` seconds) and the launcher exits
with the failed process's status; SIGINT/SIGTERM to the launcher are forwarded to every process.

    jaxpar-launch -n 2 --devices-per-process 4 -- jaxpar-train configs/tiny.yaml train.steps=20

Exit status: 0 when every process succeeds, else the failed process's; 2 for bad arguments; as a shell, 127 when
COMMAND is not found and 126 when it is not executable (a directory, a file without the execute bit), before any
process starts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxpar.cli.output_filter import OutputFilter


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(index: int, stream, out, verbose: bool = False) -> None:
    """Copies one process's output to `out` line by line, each line prefixed `[index] `; without `verbose`
    through an `OutputFilter` of its own."""
    keep = None if verbose else OutputFilter()
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        shown = [line] if keep is None else [f"{text}\n" for text in keep(line)]
        if shown:
            out.write("".join(f"[{index}] {text}" for text in shown))
            out.flush()


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(
    command: list[str],
    num_processes: int,
    devices_per_process: int | None = None,
    grace: float = 10.0,
    port: int | None = None,
    verbose: bool = False,
) -> int:
    """Runs `command` as `num_processes` local processes; returns 0, or the first failing process's status
    (128 + signal number for a process killed by a signal). Their output goes to stdout, filtered unless
    `verbose` (`_pump`)."""
    address = f"127.0.0.1:{port or free_port()}"
    procs: list[subprocess.Popen] = []
    pumps = []
    for i in range(num_processes):
        env = dict(
            os.environ,
            JAXPAR_COORDINATOR_ADDRESS=address,
            JAXPAR_NUM_PROCESSES=str(num_processes),
            JAXPAR_PROCESS_ID=str(i),
        )
        if devices_per_process is not None:
            env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(proc)
        pumps.append(threading.Thread(target=_pump, args=(i, proc.stdout, sys.stdout, verbose), daemon=True))
        pumps[-1].start()

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                status = 128 - code if code < 0 else code
                print(
                    f"jaxpar-launch: process {i} exited with status {status}; stopping the others",
                    file=sys.stderr,
                    flush=True,
                )
                _stop(procs, grace)
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for t in pumps:
            t.join(timeout=1.0)
    return status


class _Parser(argparse.ArgumentParser):
    """Adds a hint to put `--` before the command when a command line without `--` has arguments it does not
    know (the command to launch, taken for flags)."""

    double_dash = True

    def error(self, message: str):
        if not self.double_dash and message.startswith("unrecognized arguments: "):
            command = message[len("unrecognized arguments: ") :]
            message += f"; put `--` before the command to run, e.g. jaxpar-launch -n N -- {command}"
        super().error(message)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = _Parser(
        prog="jaxpar-launch",
        usage="%(prog)s [-h] -n NUM_PROCESSES [--devices-per-process D] [--grace S] [--port PORT] [--verbose] "
        "-- COMMAND ...",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.double_dash = split < len(argv)
    p.add_argument("-n", "--num-processes", type=int, required=True)
    p.add_argument("--devices-per-process", type=int, default=None, help="CPU devices simulated per process")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL on failure")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--verbose", action="store_true", help="show every output line, the libraries' chatter too")
    args = p.parse_args(argv[:split])  # exits 0 for --help, 2 for bad flags (with the `--` hint, _Parser)
    command = argv[split + 1 :]
    if not command:
        print(
            "jaxpar-launch: no COMMAND: put the command to run after `--`, e.g. jaxpar-launch -n 2 -- "
            "jaxpar-train configs/tiny.yaml",
            file=sys.stderr,
        )
        return 2
    if args.num_processes < 1 or (args.devices_per_process is not None and args.devices_per_process < 1):
        print("jaxpar-launch: -n and --devices-per-process must be >= 1", file=sys.stderr)
        return 2
    problem = _command_problem(command[0])
    if problem is not None:
        message, status = problem
        print(f"jaxpar-launch: command {command[0]!r} {message}", file=sys.stderr)
        return status
    return launch(command, args.num_processes, args.devices_per_process, args.grace, args.port, args.verbose)


def _command_problem(name: str) -> tuple[str, int] | None:
    """Why `name` cannot be started, with the shell's status for it (127 not found, 126 found but not
    executable), or None."""
    if shutil.which(name) is not None:
        return None
    if os.sep not in name:
        return "is not on PATH; give its path, e.g. .venv/bin/jaxpar-train", 127
    if not os.path.exists(name):
        return "does not exist; give the path of an executable, e.g. .venv/bin/jaxpar-train", 127
    if os.path.isdir(name):
        return "is a directory, not a program; give the path of an executable, e.g. .venv/bin/jaxpar-train", 126
    return "is not executable; chmod +x it, or run it through its interpreter (e.g. .venv/bin/python FILE)", 126


if __name__ == "__main__":
    sys.exit(main())

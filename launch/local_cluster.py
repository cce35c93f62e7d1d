"""Runs a multi-process job on this machine: N controllers of launch/run.py on localhost (CPU, gloo).

  python launch/local_cluster.py --num-processes 2 --pin-cores -- \\
      --config=configs/tiny_arith.py --config.workdir=runs/tiny2 \\
      --config.mesh.sampler_processes='(0,)' --config.mesh.trainer_processes='(1,)'

Every process gets --coordinator_address (a free localhost port), --num_processes and --process_id, and
`--devices-per-process` fake CPU devices. `--pin-cores` gives each process its own block of cores
(os.sched_setaffinity), so the roles run in parallel as they would on separate hosts. Output lines are
prefixed with the process id (and kept in --log-dir when given). When a process fails, the launcher says
which, gives the others `--grace-s` seconds to stop on their own, then ends them; its exit status is the
first failure's (0 when every process succeeded).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def core_blocks(num_processes: int, cores: list[int]) -> list[list[int]]:
    """Contiguous blocks of the available cores, one per process (shared round-robin if too few)."""
    per = max(1, len(cores) // num_processes)
    return [[cores[(i * per + j) % len(cores)] for j in range(per)] for i in range(num_processes)]


def child_env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _pump(i: int, stream, log_file) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(f"[p{i}] {line}")
        sys.stdout.flush()
        if log_file is not None:
            log_file.write(line)
            log_file.flush()


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        ours, run_flags = argv[:split], argv[split + 1 :]
    else:
        ours, run_flags = argv, []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--devices-per-process", type=int, default=1, help="fake CPU devices in each process")
    p.add_argument("--pin-cores", action="store_true", help="give each process its own block of cores")
    p.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    p.add_argument("--log-dir", default="", help="also write process_<i>.log files here")
    p.add_argument("--grace-s", type=float, default=45.0, help="after a failure, wait this long for the rest")
    p.add_argument("--heartbeat-timeout-s", type=int, default=10)
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(ours)
    if args.num_processes < 1:
        p.error("--num-processes must be >= 1")
    if args.devices_per_process < 1:
        p.error("--devices-per-process must be >= 1")
    port = args.port or free_port()
    cores = sorted(os.sched_getaffinity(0))
    blocks = core_blocks(args.num_processes, cores) if args.pin_cores else [None] * args.num_processes
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    env = child_env(args.devices_per_process)
    procs, pumps, logs = [], [], []
    for i in range(args.num_processes):
        cmd = [args.python, RUN, *run_flags, f"--coordinator_address=127.0.0.1:{port}",
               f"--num_processes={args.num_processes}", f"--process_id={i}",
               f"--config.mesh.fake_cpu_devices={args.devices_per_process}",
               f"--heartbeat_timeout_s={args.heartbeat_timeout_s}"]  # fmt: skip
        block = blocks[i]
        pre = (lambda block=block: os.sched_setaffinity(0, block)) if block else None
        log_file = open(os.path.join(args.log_dir, f"process_{i}.log"), "w") if args.log_dir else None
        logs.append(log_file)
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=pre
        )
        procs.append(proc)
        t = threading.Thread(target=_pump, args=(i, proc.stdout, log_file), daemon=True)
        t.start()
        pumps.append(t)
        where = f" on cores {block}" if block else ""
        print(f"[launcher] process {i}{where}: pid {proc.pid}", flush=True)

    def forward(signum, _frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    status = _supervise(procs, args.grace_s)
    for t in pumps:
        t.join(timeout=5)
    for f in logs:
        if f is not None:
            f.close()
    return status


def _supervise(procs: list, grace_s: float) -> int:
    """Waits for every process; after the first failure, stops the rest within `grace_s`."""
    first_failure, deadline = None, None
    while True:
        codes = [proc.poll() for proc in procs]
        if first_failure is None:
            for i, code in enumerate(codes):
                if code not in (None, 0):
                    first_failure = (i, code)
                    deadline = time.monotonic() + grace_s
                    print(f"[launcher] process {i} {describe(code)}; the others stop too", flush=True)
                    break
        if all(c is not None for c in codes):
            break
        if deadline is not None and time.monotonic() > deadline:
            for i, proc in enumerate(procs):
                if proc.poll() is None:
                    print(f"[launcher] process {i} still runs after {grace_s:.0f} s: killing it", flush=True)
                    proc.kill()
            deadline = None
        time.sleep(0.2)
    if first_failure is None:
        print("[launcher] every process finished", flush=True)
        return 0
    for j, proc in enumerate(procs):
        print(f"[launcher] process {j} {describe(proc.returncode)}", flush=True)
    i, code = first_failure
    print(f"[launcher] run failed: process {i} {describe(code)}", flush=True)
    return code if code > 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())

"""Benchmarks, studies, chaos and peer drivers, and the device check: run from a checkout, never installed.

  python -m benchmarks.<name> --help

Each module here is a command like those of `jaxrl_async/cli/` (absl flags, `main`, `run`), or a module
that several of them share (`bench_workload`, `decode_timing`, `eta_study`, `learning_study`, `peer_bench`,
`chaos_runs`). They import the package; the package never imports them. A benchmark that starts another
in a child process gives it `jaxrl_async.cli.command_env()`, which puts this checkout on PYTHONPATH.
Their configs are in `benchmarks/configs/`; `device_check.sh` is the accelerator check.
"""

"""The product's command-line programs (benchmarks and studies live in the checkout's `benchmarks/`).
Each is a module here with absl flags and two entry points:

  main(argv)  the program (absl passes the positional arguments left after the flags);
  run()       `run_command(main, __name__)` (absl's `app.run`): what `[project.scripts]` in
              pyproject.toml (and launch/'s three scripts) call.

Conventions for a new command `x`:
  - `jaxrl_async/cli/x.py` defines its flags at module level with absl (`flags.DEFINE_*`), named as a user
    types them (`--max-new-tokens`, hyphens kept), and a docstring whose first line says what it does.
  - One way to start it: a console script `jaxrl-x = "jaxrl_async.cli.x:run"` in `[project.scripts]`.
    The main job, the local cluster and the server also have `launch/x.py`, the launchers' entry points.
  - absl flags are process-global: one command per process, and a command never imports another command's
    module: what several commands share lives in a module that is no command, or in the library. A
    command starts another in a process of its own with `module_command`; that module ends with
    `if __name__ == "__main__": run()`.
Config files (configs/*.py) that build on another config load it with `config_file.sibling`, so they need
no checkout on `sys.path` either.
"""

import os
import subprocess
import sys
from collections.abc import Callable

from absl import app, flags

_HELP_FLAGS = {"--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml"}


def run_command(main: Callable[[list[str]], None], module_name: str) -> None:
    """`app.run(main)`, with `--help` showing the command's docstring and flags: absl shows those of
    `__main__`, which here is a shim or a console script."""
    for flag in flags.FLAGS.get_key_flags_for_module(module_name):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    sys.modules["__main__"].__doc__ = sys.modules[module_name].__doc__
    try:
        app.run(main)
    except SystemExit as e:
        # absl's help flags print the usage and exit 1; asking for help is no failure.
        if e.code == 1 and set(sys.argv[1:]) & _HELP_FLAGS:
            raise SystemExit(0) from None
        raise


def module_command(module: str, *args: str, python: str = sys.executable) -> list[str]:
    """The command line that runs a command in a fresh interpreter: `module` is a product command here
    (`"run"`: `jaxrl_async.cli.run`) or a dotted module (`"benchmarks.bench_roles"`, which needs the
    checkout on PYTHONPATH: `command_env`). `-P`: the code comes from PYTHONPATH or the installation, never
    from a directory the user happens to be in.
    """
    return [python, "-P", "-m", module if "." in module else f"jaxrl_async.cli.{module}", *args]


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/ lives here


def command_env(force_cpu: bool = False) -> dict[str, str]:
    """This process's environment for a child command: the checkout first on PYTHONPATH (a tool run from
    a checkout starts its children on the same code), JAX on the CPU unless JAX_PLATFORMS says otherwise
    (always, with `force_cpu`)."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    platforms = "cpu" if force_cpu else os.environ.get("JAX_PLATFORMS", "cpu")
    return dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS=platforms)


def run_logged(cmd: list[str], cores: list[int] | None, log: str) -> None:
    """Runs `cmd` (on `cores` when given) with its output in `log`.

    Raises:
      RuntimeError: it failed (with the log's tail).
    """
    wait_logged(spawn_logged(cmd, cores, log), log)


def spawn_logged(cmd: list[str], cores: list[int] | None, log: str) -> subprocess.Popen:
    """Starts `cmd` (on `cores` when given) with its output in `log`; `wait_logged` ends it."""
    pre = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    with open(log, "w") as f:
        return subprocess.Popen(cmd, env=command_env(), stdout=f, stderr=subprocess.STDOUT, preexec_fn=pre)


def wait_logged(proc: subprocess.Popen, log: str) -> None:
    """Waits for a `spawn_logged` process. Raises RuntimeError (with the log's tail) when it failed."""
    if proc.wait() != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        head = " ".join(map(str, proc.args[:5]))
        raise RuntimeError(f"{head} ... failed ({proc.returncode}), {log}:\n{tail}")


def hf_config_file(path: str, flag: str) -> str:
    """The config.json a user means: `path` itself, or the one in the Hugging Face directory `path`.

    Raises:
      app.UsageError: neither exists (the message names `flag`).
    """
    candidate = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(candidate):
        raise app.UsageError(f"{flag}: {path} is neither a config.json nor a directory holding one")
    return candidate

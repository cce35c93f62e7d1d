"""A suite of hostile programs for the code sandbox, shared by the tests and `benchmarks/bench_rewards.py`.

Each case prints BREACH_MARKER only if it escaped containment, so a code-reward test case expecting that
output passes (reward 1) exactly when the sandbox failed.
"""

from __future__ import annotations

import dataclasses

BREACH_MARKER = "BREACHED"
SECRET_ENV = "JAXRL_SANDBOX_TEST_SECRET"


@dataclasses.dataclass(frozen=True)
class HostileCase:
    """A hostile program; `{escape_path}`, `{secret}` and `{port}` are filled in by `render`."""

    name: str
    code: str
    expected: tuple[str, ...]  # sandbox statuses that count as contained


CASES = (
    HostileCase(
        "fork bomb",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        ("timeout", "cpu_limit", "exit_nonzero", "signal"),
    ),
    HostileCase("memory bomb", "x = []\nwhile True:\n    x.append(bytearray(1 << 26))\n", ("memory_limit",)),
    HostileCase("infinite loop", "while True:\n    pass\n", ("timeout", "cpu_limit")),
    HostileCase("sleep past timeout", "import time\ntime.sleep(600)\n", ("timeout",)),
    HostileCase(
        "write outside its dir",
        "import sys\nok = False\nfor p in ['{escape_path}', '/tmp/jaxrl_sandbox_escape.txt']:\n"
        "    try:\n        open(p, 'w').write('x')\n        ok = True\n"
        "    except OSError as e:\n        print(repr(e), file=sys.stderr)\n"
        f"print('{BREACH_MARKER}' if ok else 'contained')\n",
        ("wrong_output",),
    ),
    HostileCase(
        "read parent's env secrets",
        "import os, sys\nfound = '{secret}' in repr(dict(os.environ))\n"
        "for pid in (os.getppid(), 1):\n    try:\n"
        "        found |= '{secret}' in open(f'/proc/{{pid}}/environ').read()\n"
        "    except OSError as e:\n        print(repr(e), file=sys.stderr)\n"
        f"print('{BREACH_MARKER}' if found else 'contained')\n",
        ("wrong_output",),
    ),
    HostileCase(
        "open a network connection",
        "import socket, sys\ns = socket.socket()\ns.settimeout(1)\ntry:\n"
        "    s.connect(('127.0.0.1', {port}))\n"
        f"    print('{BREACH_MARKER}')\n"
        "except OSError as e:\n    print(repr(e), file=sys.stderr)\n    print('contained')\n",
        ("wrong_output",),
    ),
    HostileCase(
        "100 MB of stdout",
        "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n",
        ("output_limit",),
    ),
    HostileCase(
        "kill its parent",
        "import os, signal, sys\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\n"
        f"    print('{BREACH_MARKER}')\n"
        "except OSError as e:\n    print(repr(e), file=sys.stderr)\n    print('contained')\n",
        ("wrong_output",),
    ),
)


def render(case: HostileCase, *, escape_path: str, secret: str, port: int) -> str:
    """The case's program with its placeholders filled in."""
    return case.code.format(escape_path=escape_path, secret=secret, port=port)

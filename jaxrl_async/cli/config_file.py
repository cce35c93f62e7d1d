"""Loading a config file's neighbours by path: config files are not an installed package."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType


def sibling(config_file: str, name: str) -> ModuleType:
    """The module `name`.py in the directory of `config_file` (pass `__file__`), loaded once per path.

    A config file's `from configs import base` would need the repository root on `sys.path`; this does not.

    Raises:
      FileNotFoundError: there is no such file.
    """
    path = os.path.join(os.path.dirname(os.path.abspath(config_file)), name + ".py")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{config_file}: no config {name!r} beside it ({path})")
    key = f"_jaxrl_config_file:{path}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]

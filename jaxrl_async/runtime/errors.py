"""The error a wrong process layout raises, below the modules that raise it (`cluster`, `secret`), so that
neither imports the other to name it."""


class ClusterError(ValueError):
    """A cluster flag or the process layout is wrong; the message names the flag or config field."""

"""The benchmarks' run configs (loaded by path with `--config=benchmarks/configs/NAME.py`)."""

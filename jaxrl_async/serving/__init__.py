"""Serving a trained policy outside the RL loop.

`load` (checkpoint loading and prompt encoding, shared by `jaxrl-generate` and `launch/serve.py`)
needs only the core dependencies. `jetstream_engine`, `driver` and `server` put the sampler engine behind
JetStream's engine API and gRPC service; they import `jetstream`, the optional extra
(`pip install -e ".[serve]"`), so nothing in this package's __init__ imports them.
"""

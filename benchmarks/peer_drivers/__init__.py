"""The peer benchmark's drivers (benchmarks.bench_peers): scripts, not modules of this package. The benchmark
copies `common.py` and a peer's driver beside its spec and runs them with that peer's own interpreter, so
they import only the standard library, each other and the peer's stack, never jaxrl_async."""

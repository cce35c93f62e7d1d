"""`python launch/serve.py --checkpoint DIR`: serve a checkpoint through JetStream's gRPC API
(`jaxrl-serve`), documented in jaxrl_async/cli/serve.py."""

from jaxrl_async.cli.serve import run

if __name__ == "__main__":
    run()

"""`python launch/local_cluster.py ...` = `jaxrl-local-cluster ...`: see jaxrl_async/cli/local_cluster.py."""

from jaxrl_async.cli.local_cluster import run

if __name__ == "__main__":
    run()

"""`python tools/device_check_report.py DIR`: see jaxrl_async/cli/device_check_report.py."""

from jaxrl_async.cli.device_check_report import run

if __name__ == "__main__":
    run()

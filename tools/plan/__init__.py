"""The sharding-plan explorer (`pallasite plan`): `model.py` estimates memory, latency and
throughput of a plan, `cli.py` ranks every plan, `report.py` prints and draws them, `validate.py`
checks the estimates against measured runs."""


def main(argv=None) -> int:
    from .cli import main as cli_main  # imported on use: `pallasite --help` stays quick
    return cli_main(argv)

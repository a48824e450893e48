"""`python -m dsakv.cli`: the `dsakv` command, as the tests, docs and launchers run it."""

from dsakv.cli import run

if __name__ == "__main__":
    run()

"""Code for `python -c` that runs the `nextstep` command line in a fresh interpreter, optionally with packages made
unimportable: what a user meets without an extra installed (torch for training, ray for --engine ray)."""

RUN_CLI = "import sys\nfrom nextstep.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def hide(*packages: str) -> str:
    """Code that makes `packages` (and their submodules) fail to import, as when they are not installed."""
    return f"""
import sys
class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {set(packages)!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)", name=name)
sys.meta_path.insert(0, Hidden())
"""


def cli_without(*packages: str) -> str:
    """Code that runs the command line (its arguments: sys.argv[1:]) with `packages` unimportable."""
    return hide(*packages) + RUN_CLI

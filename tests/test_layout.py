"""The package's arrows point down: no module imports, at load time, a package above its
own (README "Where things are"). Imports inside functions are the entry points' lazy wiring (a
subcommand's parser, a serving mode picked by a flag) and are not counted."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dsakv

SRC = Path(dsakv.__file__).parent
# Bottom first. A package may import the ones before it; the entry points (`cli`, `bench`,
# `calibrate`) sit on top of everything.
ORDER = [
    "errors",
    "config",
    "memory",
    "kernels",
    "distributed",
    "models",
    "engine",
    "server",
    "disagg",
]
RANK = {name: i for i, name in enumerate(ORDER)}


def _package(path: Path) -> str:
    return path.relative_to(SRC).with_suffix("").parts[0]


def _load_time_imports(source: str, here: tuple[str, ...]) -> set[str]:
    """The dsakv packages module `here` (its path under dsakv/, no suffix) imports at load
    time: its top-level statements, the bodies of top-level `if` / `try` included, relative
    imports resolved."""
    tree = ast.parse(source)
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - node.level]
                    names = [".".join(["dsakv", *base, *([node.module] if node.module else [])])]
                    if not base and not node.module:  # `from .. import x`: x is a package
                        names = [f"dsakv.{a.name}" for a in node.names]
                elif node.module == "dsakv":
                    names = [f"dsakv.{a.name}" for a in node.names]
                else:
                    names = [node.module or ""]
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                continue
            else:
                continue
            found.update(n.split(".")[1] for n in names if n.startswith("dsakv."))

    visit(tree.body)
    return found


MODULES = sorted(p for p in SRC.rglob("*.py") if _package(p) in RANK)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path: Path) -> None:
    own = _package(path)
    here = path.relative_to(SRC).with_suffix("").parts
    above = {n for n in _load_time_imports(path.read_text(), here) if RANK.get(n, -1) > RANK[own]}
    assert not above, f"{path.relative_to(SRC)} ({own}) imports {sorted(above)}, above it"


def test_the_check_sees_an_upward_import() -> None:
    """What the old `server/serve.py` did (picked the disaggregated bridge by importing
    `dsakv.disagg`) counts, in each import form, and a lazy import does not."""
    here = ("server", "serve")
    for line in (
        "from dsakv.disagg import DisaggConfig",
        "import dsakv.disagg.serving",
        "from ..disagg import serving",
        "from dsakv import disagg",
        "if True:\n    from ..disagg.serving import bridge_for",
    ):
        assert "disagg" in _load_time_imports(line + "\n", here), line
    lazy = "def f():\n    from dsakv.disagg.serving import bridge_for\n"
    assert _load_time_imports(lazy, here) == set()
    assert _load_time_imports("from .runner import AsyncEngine\n", here) == {"server"}

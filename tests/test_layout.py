"""The package's arrows point down: no module imports, at load time, a package above its
own (README "Where things are"). Imports inside functions are the entry points' lazy wiring (a
subcommand's parser, a serving mode picked by a flag) and are not counted."""

from __future__ import annotations

import ast
from pathlib import Path

import dsakv

SRC = Path(dsakv.__file__).parent
# Bottom first. A package may import the ones before it; the entry points (`cli`, `bench`,
# `calibrate`) sit on top of everything.
ORDER = [
    "errors",
    "writable",
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
                for block in (node.body, node.orelse, getattr(node, "finalbody", [])):
                    visit(block)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                continue
            else:
                continue
            found.update(n.split(".")[1] for n in names if n.startswith("dsakv."))

    visit(tree.body)
    return found


def test_imports_point_down() -> None:
    upward = {}
    for path in sorted(SRC.rglob("*.py")):
        own = _package(path)
        if own not in RANK:
            continue
        here = path.relative_to(SRC).with_suffix("").parts
        found = _load_time_imports(path.read_text(), here)
        above = sorted(n for n in found if RANK.get(n, -1) > RANK[own])
        if above:
            upward[str(path.relative_to(SRC))] = above
    assert not upward, f"modules importing packages above their own: {upward}"


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
        "try:\n    pass\nexcept ImportError:\n    import dsakv.disagg",
    ):
        assert "disagg" in _load_time_imports(line + "\n", here), line
    lazy = "def f():\n    from dsakv.disagg.serving import bridge_for\n"
    assert _load_time_imports(lazy, here) == set()
    assert _load_time_imports("from .runner import AsyncEngine\n", here) == {"server"}

"""The package's arrows point down: no module of a library package imports a package above
its own (README "Where things are").

Every import counts, a function's lazy one included: a lazy import is wired later, not
absent, and one pointing up is a cycle all the same (`disagg/cli.py` once imported
`dsakv.cli` inside its functions while `cli.py` imported it at load). Only the entry points
on top (`cli`, `bench`, `calibrate`) and the package root `dsakv/__init__.py` go
unchecked: they may import anything, and do it lazily so `dsakv plan` and `import dsakv`
stay light."""

from __future__ import annotations

import ast
from pathlib import Path

import dsakv

SRC = Path(dsakv.__file__).parent
# Bottom first. A package may import the ones before it.
ORDER = [
    "errors",
    "writable",
    "procs",
    "metrics",
    "config",
    "memory",
    "kernels",
    "distributed",
    "models",
    "engine",
    "server",
    "disagg",
]
# On top of everything, above one another in no order: not checked.
ENTRY_POINTS = ("cli", "bench", "calibrate")
RANK = {name: i for i, name in enumerate(ORDER)} | {name: len(ORDER) for name in ENTRY_POINTS}


def _package(path: Path) -> str:
    return path.relative_to(SRC).with_suffix("").parts[0]


def _imports(source: str, here: tuple[str, ...]) -> set[str]:
    """The dsakv packages module `here` (its path under dsakv/, no suffix) imports, anywhere
    in it (load time or inside a function), relative imports resolved."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
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
        else:
            continue
        found.update(n.split(".")[1] for n in names if n.startswith("dsakv."))
    return found


def _upward(source: str, here: tuple[str, ...]) -> list[str]:
    """The packages above its own that module `here` imports."""
    own = RANK[here[0]]
    return sorted(n for n in _imports(source, here) if RANK.get(n, -1) > own)


def test_every_package_has_a_place() -> None:
    """A new package or top-level module is placed in ORDER (or is an entry point), so the
    check below cannot skip it unnoticed."""
    found = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    found |= {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"}
    assert found == set(RANK), f"placed nowhere: {found - set(RANK)}; gone: {set(RANK) - found}"


def test_imports_point_down() -> None:
    upward = {}
    for path in sorted(SRC.rglob("*.py")):
        if _package(path) not in ORDER:  # the entry points and dsakv/__init__.py
            continue
        here = path.relative_to(SRC).with_suffix("").parts
        above = _upward(path.read_text(), here)
        if above:
            upward[str(path.relative_to(SRC))] = above
    assert not upward, f"modules importing packages above their own: {upward}"


def test_the_check_sees_an_upward_import() -> None:
    """What the old `server/serve.py` did (picked the disaggregated bridge by importing
    `dsakv.disagg`) counts, in each import form, at load time or lazily; so does what the
    old `disagg/cli.py` did (imported `dsakv.cli`, an entry point, inside its functions)."""
    here = ("server", "serve")
    for line in (
        "from dsakv.disagg import DisaggConfig",
        "import dsakv.disagg.serving",
        "from ..disagg import serving",
        "from dsakv import disagg",
        "if True:\n    from ..disagg.serving import bridge_for",
        "try:\n    pass\nexcept ImportError:\n    import dsakv.disagg",
        "def f():\n    from dsakv.disagg.serving import bridge_for",
        "class A:\n    def f(self):\n        import dsakv.disagg",
    ):
        assert _upward(line + "\n", here) == ["disagg"], line
    lazy_cli = "def _cmd_router(args):\n    from dsakv.cli import check_listen\n"
    assert _upward(lazy_cli, ("disagg", "cli")) == ["cli"]
    assert _upward("from .runner import AsyncEngine\n", here) == []
    assert _imports("from .runner import AsyncEngine\n", here) == {"server"}
    assert _upward("from dsakv.procs import free_port\n", ("memory", "storage")) == []

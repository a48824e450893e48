"""`scripts/check_system_libs.sh` (run by every `make install`): silent when libibverbs.so.1
is there, installs libibverbs1 as root with apt, otherwise one line naming the command.

The commands it runs (`ldconfig`, `id`, `apt-get`) are small stand-ins on PATH that act on
a state directory: `apt-get install` makes the library appear to `ldconfig`, as dpkg would.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_system_libs.sh"
CACHE_LINE = "\tlibibverbs.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libibverbs.so.1"


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def _run(tmp_path: Path, *, installed: bool, uid: int, apt: bool, apt_fails: bool = False):
    """The script with stand-ins for this machine's state; returns (result, apt-get calls)."""
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    if installed:
        (state / "installed").touch()
    calls = state / "apt-calls"
    _stub(bin_dir, "ldconfig", f'[ -e {state}/installed ] && printf "%s\\n" "{CACHE_LINE}"; :')
    _stub(bin_dir, "id", f'[ "$1" = -u ] && echo {uid}')
    if apt:
        marks = "" if apt_fails else f'[ "$1" = install ] && : > {state}/installed'
        _stub(
            bin_dir,
            "apt-get",
            f'echo "DEBIAN_FRONTEND=$DEBIAN_FRONTEND $*" >> {calls}\n{marks}\nexit 0',
        )
    # Only the stand-ins and bash's own directory: no real apt-get, dnf or sudo.
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    r = subprocess.run(
        ["/bin/bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30
    )
    return r, calls.read_text().splitlines() if calls.exists() else []


def test_present_library_is_silent_and_installs_nothing(tmp_path):
    r, calls = _run(tmp_path, installed=True, uid=0, apt=True)
    assert (r.returncode, r.stdout, r.stderr, calls) == (0, "", "", [])


def test_root_with_apt_updates_then_installs_libibverbs1(tmp_path):
    r, calls = _run(tmp_path, installed=False, uid=0, apt=True)
    assert r.returncode == 0, r.stderr
    assert calls == [
        "DEBIAN_FRONTEND= update -qq",
        "DEBIAN_FRONTEND=noninteractive install -y -qq libibverbs1",
    ]
    assert "installing libibverbs1" in r.stderr


def test_an_install_that_does_not_bring_the_library_fails(tmp_path):
    r, _ = _run(tmp_path, installed=False, uid=0, apt=True, apt_fails=True)
    assert r.returncode == 1
    assert "still does not list libibverbs.so.1" in r.stderr


@pytest.mark.parametrize(
    "uid, apt, command",
    [
        (1000, True, "run: sudo apt-get update && sudo apt-get install -y libibverbs1"),
        (0, False, "run: install your distribution's package that provides libibverbs.so.1"),
    ],
    ids=["not-root", "no-apt"],
)
def test_otherwise_one_line_with_the_command_and_exit_1(tmp_path, uid, apt, command):
    r, calls = _run(tmp_path, installed=False, uid=uid, apt=apt)
    assert r.returncode == 1 and calls == []
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and r.stdout == ""
    assert lines[0].startswith("error: libibverbs.so.1 is missing") and command in lines[0]


def test_make_install_runs_the_check_even_when_the_venv_is_up_to_date(tmp_path):
    """`make -n install` with a fresh stamp: nothing to install, the check still runs."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".dsakv-installed").touch()  # newer than pyproject.toml and the Makefile
    r = subprocess.run(
        ["make", "--no-print-directory", "-n", "install", f"VENV={venv}"],
        cwd=SCRIPT.parent.parent,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "MAKEFLAGS": ""},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["bash scripts/check_system_libs.sh"]

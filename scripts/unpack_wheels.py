"""Unpack the wheels this interpreter can import into a folder (scripts/device_check.sh puts
it on PYTHONPATH): `python scripts/unpack_wheels.py SITE WHEEL...`.

`make wheelhouse` fetches the GPU image's wheels (CPython 3.12); unpacked whole on another
interpreter, their compiled parts (pydantic_core, xgrammar) shadow the working ones and
break the dry run there. As pip does, a wheel none of whose tags this interpreter supports
is left out; each one left out is named on stderr.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename


def unpack(site: str, wheels: list[str]) -> list[str]:
    """Extract the compatible `wheels` into `site`; returns the names of those left out."""
    ours = set(sys_tags())
    skipped = []
    for wheel in wheels:
        name = Path(wheel).name
        if ours & set(parse_wheel_filename(name)[3]):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site)
        else:
            skipped.append(name)
    return skipped


if __name__ == "__main__":
    for name in unpack(sys.argv[1], sys.argv[2:]):
        print(f"unpack_wheels: {name} is not for this interpreter; left out", file=sys.stderr)

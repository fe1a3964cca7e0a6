"""The oldest version of each framework the integrations are tested with, and the refusal of an older one.

``pyproject.toml``'s extras declare exactly these floors (``tests/test_versions.py`` checks it), and
``make test-oldest`` installs them pinned (``python src/gradaccum/integrations/_versions.py`` prints the
pins) and runs the integration tests there. What fails below them: docs/index.md.

Standard library only, so that the Makefile can read it before anything is installed."""
from __future__ import annotations

import re
import sys
from importlib import metadata
from typing import Optional, Tuple

__all__ = ["FLOORS", "require"]

#: distribution name -> the oldest release tested (make test-oldest installs exactly these)
FLOORS = {
    "transformers": "5.19.0",
    "accelerate": "1.10.1",  # TRL 1.16's own floor (transformers 5.19 takes 1.1)
    "trl": "1.16.0",
    "datasets": "4.7.0",  # TRL 1.16's own floor
    "sentence-transformers": "6.2.0",
    "pytorch-lightning": "2.5.0",
    "deepspeed": "0.19.8",
}


def release(version: str) -> Tuple[int, ...]:
    """The numeric release of a version string: ``"5.19.0.dev0"`` -> ``(5, 19, 0)``, ``"2.5"`` -> ``(2, 5, 0)``."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    parts = tuple(int(p) for p in match.group(0).split(".")) if match else (0,)
    return parts + (0,) * (3 - len(parts))


def installed(package: str) -> Optional[str]:
    """The installed version of distribution ``package``, or None where it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def require(package: str, who: str) -> None:
    """Raise ImportError when ``package`` is installed older than its :data:`FLOORS` entry (nothing where it
    is not installed: the import then says so itself)."""
    version, floor = installed(package), FLOORS[package]
    if version is not None and release(version) < release(floor):
        raise ImportError(f"{who}: {package} {version} is older than {floor}, the oldest tested with it; "
                          f"pip install '{package}>={floor}'")


if __name__ == "__main__":  # the pins of make test-oldest, or with --installed what an environment holds
    if sys.argv[1:] == ["--installed"]:
        for name in ("torch", *FLOORS):
            print(f"{name}=={installed(name)}")
    else:
        print(" ".join(f"{name}=={version}" for name, version in FLOORS.items()))

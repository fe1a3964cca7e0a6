"""The command line (grows in the CLI issue)."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="gradaccum")
    parser.add_argument("--version", action="version", version=f"gradaccum {__version__}")
    parser.parse_args(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The one checksum scheme of the command line's checkpoints: SHA-256, as hex, written beside what it covers.

* ``last.pt`` (and a sharded checkpoint's ``gradaccum.pt``) holds :func:`digest` of its other
  contents under :data:`CHECKSUM_KEY`, compared after loading (:func:`contents_damaged`). It covers
  what the archive's own CRC-32s cannot: a damaged zip directory can make torch's reader take a
  record's bytes from elsewhere while every record still matches its CRC.
* A sharded checkpoint's ``gradaccum.pt`` holds :func:`digest` of every other file of its folder
  under :data:`SHARD_CHECKSUMS` (DCP's files carry no checksum of their own), compared before
  anything loads (:func:`files_damaged`).

:func:`digest` is one function for both: a file's bytes, or a checkpoint's contents as
``torch.load`` returns them. Checkpoints written before these checksums still read: a ``last.pt``
without one has the CRC-32s torch.save wrote for its records checked (:func:`records_damaged`), and
a sharded checkpoint without them has nothing to compare. Each check returns why the checkpoint is
damaged, in words, or None.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path
from typing import Any, Dict, Optional

import torch

__all__ = ["CHECKSUM_KEY", "SHARD_CHECKSUMS", "contents_damaged", "digest", "file_digests", "files_damaged",
           "records_damaged", "with_checksum"]

#: the key under which a checkpoint holds the :func:`digest` of its other contents
CHECKSUM_KEY = "checksum"
#: the key of a sharded checkpoint's gradaccum.pt under which the digest of each other file of its folder is kept
SHARD_CHECKSUMS = "shards"
_BLOCK = 1 << 24


def digest(obj: Any) -> str:
    """SHA-256 (hex) of a file's bytes (``obj`` a Path), or of a checkpoint's contents as
    ``torch.load`` returns them: every key, value and tensor (dtype, shape, bytes), in order."""
    h = hashlib.sha256()
    if isinstance(obj, Path):
        with open(obj, "rb") as f:
            for block in iter(lambda: f.read(_BLOCK), b""):
                h.update(block)
    else:
        _feed(h, obj)
    return h.hexdigest()


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        h.update(f"{{{len(obj)}".encode())
        for key, value in obj.items():
            h.update(repr(key).encode())
            _feed(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__}[{len(obj)}".encode())
        for value in obj:
            _feed(h, value)
    else:
        h.update(f"{type(obj).__name__}:{obj!r}".encode())


def with_checksum(state: Dict[str, Any]) -> Dict[str, Any]:
    """``state`` with the :func:`digest` of its contents under :data:`CHECKSUM_KEY`, to save."""
    return {**state, CHECKSUM_KEY: digest(state)}


def contents_damaged(state: Dict[str, Any]) -> Optional[str]:
    """Remove the checksum from a loaded ``state`` (which must hold one) and compare it with its contents."""
    if state.pop(CHECKSUM_KEY) != digest(state):
        return "what it holds does not match the checksum written with it: damaged on disk or in transfer"
    return None


def file_digests(folder: Path, *, but: str) -> Dict[str, str]:
    """:func:`digest` of every file in ``folder`` but ``but`` (the file that holds them)."""
    return {p.name: digest(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != but}


def files_damaged(folder: Path, expected: Dict[str, str]) -> Optional[str]:
    """Compare the files of ``folder`` with the digests written with them; a missing one is damage too."""
    for name, written in expected.items():
        file = folder / name
        if not file.is_file():
            return f"its file {name} is missing"
        if digest(file) != written:
            return f"its file {name} does not match the checksum written with it: damaged on disk or in transfer"
    return None


def records_damaged(path: Path) -> Optional[str]:
    """For a checkpoint written before its contents had a checksum: torch.save stores a CRC-32 of
    every record, which torch.load never reads, so flipped bytes inside a tensor would load as
    other weights. A record whose stored CRC is 0 is not checked: torch writes 0 when told not to
    compute them (``torch.utils.serialization.config.save.compute_crc32 = False``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.CRC == 0:
                    continue
                with archive.open(info) as record:  # reading to the end compares the CRC
                    try:
                        while record.read(_BLOCK):
                            pass
                    except zipfile.BadZipFile:
                        return (f"the bytes of its record {info.filename} do not match their stored checksum: "
                                "damaged on disk or in transfer")
    except Exception:  # noqa: BLE001 - a damaged header raises anything from BadZipFile to UnicodeDecodeError
        return "a damaged torch.save archive"
    return None

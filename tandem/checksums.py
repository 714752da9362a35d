"""Each file of a checkpoint as it was written: its size and CRC-32, recorded in `checksums.json`
when the checkpoint is committed, compared before the checkpoint is loaded.

A file damaged after its save but still of its right size (a bad sector, a copy that flipped a
bit) passes every structural check: a flipped byte inside a tensor of a DCP shard or a safetensors
file loads as another number, silently. Its CRC-32 no longer matches.

Cost: recording reads every file once more, right after it was written (from the page cache as a
rule, at zlib's CRC-32 speed, a small share of the time writing took); a check reads the files it
covers once. A checkpoint written before checksums were recorded has no `checksums.json`, and a
file the record does not name is not compared: both load as before.
"""

import json
import zlib
from collections.abc import Callable
from pathlib import Path

RECORD = "checksums.json"
CHUNK = 1 << 22  # bytes read at a time: a checkpoint's files can be GBs


def crc32(file: Path) -> int:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def record(directory: Path) -> None:
    """Write `directory/checksums.json`: every file under `directory` (its relative POSIX name) ->
    its size and CRC-32. Call it once every file is complete, before the directory is committed."""
    files = sorted(f for f in directory.rglob("*") if f.is_file() and f != directory / RECORD)
    entries = {
        f.relative_to(directory).as_posix(): {"bytes": f.stat().st_size, "crc32": crc32(f)} for f in files
    }
    (directory / RECORD).write_text(json.dumps({"files": entries}, indent=1))


def damage(directory: Path, covers: Callable[[str], bool]) -> dict[Path, str]:
    """The recorded files of `directory` that `covers` (given the relative POSIX name) and that are
    no longer as written -> file: what differs (missing, another size, another CRC-32). {} when all
    match, when nothing was recorded (an older checkpoint), or for a file the record does not name.
    A record that cannot be read is itself the damage found."""
    path = directory / RECORD
    if not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text())["files"]
        recorded = {name: (int(e["bytes"]), int(e["crc32"])) for name, e in entries.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        return {path: f"{path} is unreadable ({type(e).__name__}: {e})"}
    found = {}
    for name, (size, crc) in sorted(recorded.items()):
        file = directory / name
        if not covers(name):
            continue
        if not file.is_file():
            found[file] = f"{file} is missing"
        elif (have := file.stat().st_size) != size:
            short = have < size
            found[file] = f"{file} is {'truncated' if short else 'too long'} ({have} of {size} bytes written)"
        elif crc32(file) != crc:
            found[file] = f"{file} is corrupt (its CRC-32 is not the one recorded when it was written)"
    return found

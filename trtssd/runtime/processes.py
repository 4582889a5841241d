"""What /proc says about a process: its start time (so a reused pid is never mistaken for the
one we started), the processes below it, the /dev/shm segments it maps and the files it holds
open. Used to find and clean up after the processes we start (the draft's MPI job,
tritonserver), their segments and their temporary files. On a system without /proc every
answer is empty."""

from __future__ import annotations

import os

SHM_DIR = "/dev/shm/"


def start_time(pid: int) -> int | None:
    """Process start time (clock ticks since boot); None when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
    except OSError:
        return None
    return None if fields[0] in "ZX" else int(fields[19])


def descendants(root: int) -> list[int]:
    """Every process below ``root``."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def mapped_segments(pid: int, prefixes: tuple[str, ...]) -> set[str]:
    """Names of the /dev/shm segments starting with one of ``prefixes`` that ``pid`` maps."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    names = set()
    for line in lines:
        path = line.split(maxsplit=5)[-1]
        name = path[len(SHM_DIR):]
        if path.startswith(SHM_DIR) and name.startswith(prefixes) and not path.endswith("(deleted)"):
            names.add(name)
    return names


def open_files(pid: int, name_prefixes: tuple[str, ...]) -> set[str]:
    """Paths of the files ``pid`` holds open whose name starts with one of ``name_prefixes``."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    paths = set()
    for fd in fds:
        try:
            path = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if os.path.basename(path).startswith(name_prefixes) and path.startswith("/"):
            paths.add(path)
    return paths

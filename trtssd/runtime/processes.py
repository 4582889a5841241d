"""What the system says about a process, through psutil: its start time (so a reused pid is never
mistaken for the one we started), the processes below it, the /dev/shm segments it maps and the
files it holds open. Used to find and clean up after the processes we start (the draft's MPI
job, tritonserver), their segments and their temporary files. A process that is gone, or that we
may not inspect, gives empty answers."""

from __future__ import annotations

import os

import psutil

SHM_DIR = "/dev/shm/"
_UNSEEN = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


def start_time(pid: int) -> float | None:
    """Process start time (seconds since the epoch); None when gone or a zombie."""
    try:
        process = psutil.Process(pid)
        if process.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return None
        return process.create_time()
    except _UNSEEN:
        return None


def descendants(root: int) -> list[int]:
    """Every process below ``root``."""
    try:
        return [child.pid for child in psutil.Process(root).children(recursive=True)]
    except _UNSEEN:
        return []


def mapped_segments(pid: int, prefixes: tuple[str, ...]) -> set[str]:
    """Names of the /dev/shm segments starting with one of ``prefixes`` that ``pid`` maps."""
    try:
        maps = psutil.Process(pid).memory_maps(grouped=True)
    except _UNSEEN:
        return set()
    # psutil strips the " (deleted)" mark of an unlinked file, so whether it still exists is asked.
    return {region.path[len(SHM_DIR):] for region in maps
            if region.path.startswith(SHM_DIR) and region.path[len(SHM_DIR):].startswith(prefixes)
            and os.path.exists(region.path)}


def open_files(pid: int, name_prefixes: tuple[str, ...]) -> set[str]:
    """Paths of the files ``pid`` holds open whose name starts with one of ``name_prefixes``."""
    try:
        files = psutil.Process(pid).open_files()
    except _UNSEEN:
        return set()
    return {f.path for f in files if os.path.basename(f.path).startswith(name_prefixes)}

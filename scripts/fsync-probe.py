#!/usr/bin/env python3
"""What an fdatasync costs on a disk, by how the file was written (docs/DESIGN.md §55).

usage: scripts/fsync-probe.py [DIR] [WRITES]

Writes WRITES (default 3,000) records of 300 bytes to a scratch file in DIR (default: the
current directory; put it on the disk a node's data dir is on), each followed by
fdatasync, three ways, twice each:
- append:    the file grows with every write (what a new RocksDB WAL file does);
- prealloc:  the file's size is set first (posix_fallocate), the blocks are unwritten;
- overwrite: the file was written and synced before (what a recycled WAL file is).
Prints syncs per second, p50 and p99 latency and this process's CPU per sync.
"""
import os
import sys
import tempfile
import time


def run(directory, mode, n, size=300):
    fd, path = tempfile.mkstemp(prefix="fsync-probe-", dir=directory)
    try:
        if mode in ("prealloc", "overwrite"):
            os.posix_fallocate(fd, 0, n * size + 4096)
            if mode == "overwrite":
                os.write(fd, b"\1" * (n * size + 4096))
                os.fsync(fd)
                os.lseek(fd, 0, os.SEEK_SET)
        buf = b"x" * size
        lat = []
        cpu0, t0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            a = time.perf_counter()
            os.write(fd, buf)
            os.fdatasync(fd)
            lat.append(time.perf_counter() - a)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        os.close(fd)
        os.remove(path)
    lat.sort()
    print(
        f"{mode:10s} {n / wall:8.0f} syncs/s  p50 {lat[n // 2] * 1e6:7.0f} us  "
        f"p99 {lat[n * 99 // 100] * 1e6:7.0f} us  cpu/sync {cpu / n * 1e6:6.1f} us"
    )


def main():
    try:
        directory = sys.argv[1] if len(sys.argv) > 1 else "."
        n = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
        if n < 100 or not os.path.isdir(directory):
            raise ValueError
    except ValueError:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        sys.exit(2)
    for _ in range(2):
        for mode in ("append", "prealloc", "overwrite"):
            run(directory, mode, n)


if __name__ == "__main__":
    main()

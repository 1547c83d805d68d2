"""On a CPU, a continuous-batching worker thread that steps as fast as the thread that started it.

torch runs its intra-op parallelism on OpenMP, which in torch's Linux builds is GNU libgomp. libgomp keeps a pool of
threads for every thread that starts parallel work, and once the process holds more of its threads than it has CPUs
it lets a waiting thread spin only briefly before sleeping: every parallel region (a forward has hundreds) must then
wake its threads through the kernel. A manager's worker thread builds a second pool beside the one the caller's
thread built while it loaded and warmed up the model, which is what made steps in a worker thread slower than the
same steps in the calling thread (measured in docs/continuous-batching.md).

`release_openmp_threads` frees the calling thread's pool (OpenMP 5.0's `omp_pause_resource_all`, which libgomp
implements by ending that thread's pool threads). Nothing else changes: the caller's next parallel op builds a new
pool, and while it holds one, the worker's steps are slower again.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

# `omp_pause_soft` of OpenMP's `omp_pause_resource_t`; libgomp frees the calling thread's pool for either kind.
OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime this process has loaded (torch's), or None: another runtime, or not Linux."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)  # the loaded library itself: dlopen of a mapped path returns its handle
        except OSError:
            continue
        if hasattr(library, "omp_pause_resource_all"):
            return library
    return None


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP thread pool, so that a worker thread's parallel work runs on a pool of its
    own that the waiting threads of this one do not slow. Returns whether it was freed (False where torch does not
    run on libgomp)."""
    library = _libgomp()
    return library is not None and library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


__all__ = ["release_openmp_threads"]

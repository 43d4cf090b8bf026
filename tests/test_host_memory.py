"""`distft.host_memory`: on glibc, a tensor's memory comes from malloc's heap and stays there
when freed, so the next one of its size faults no page in; elsewhere the C library is left as is.
The suite runs as every distft process on the CPU does (tests/conftest.py)."""

from __future__ import annotations

import ctypes
import os
import platform
import resource

import torch

from distft.host_memory import OPT_OUT_ENV, keep_freed_memory

MIB = 1 << 20


class MallInfo2(ctypes.Structure):  # glibc's `struct mallinfo2` (malloc.h, glibc >= 2.33)
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def mallinfo() -> MallInfo2:
    call = ctypes.CDLL(None).mallinfo2
    call.restype = MallInfo2
    return call()


def test_freed_tensors_stay_in_the_heap_for_the_next_steps():
    """A 64 MiB activation made and freed step after step: always from the heap, never a mapping of
    its own, and the heap not trimmed, so that a step finds its pages there again. When it does
    depends on the rest of the heap (small objects land in a freed block and make it grow first;
    in a long-lived test process for several steps), so only that it does is asserted: glibc's
    default maps the block afresh every step, 16,384 faults of 4 KiB pages each time."""
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is (glibc and os.environ.get(OPT_OUT_ENV) != "0")
    if not keep_freed_memory():
        return
    faults, mapped = [], mallinfo().hblkhd  # bytes malloc holds in mappings of their own
    for _ in range(16):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        activation = torch.ones(64 * MIB // 4)  # above glibc's default mmap threshold (32 MiB at most)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        assert mallinfo().hblkhd - mapped < 64 * MIB  # from the heap
        assert activation[-1].item() == 1.0
        del activation
    assert mallinfo().arena >= 64 * MIB  # freed, and kept: the heap was not trimmed
    assert sum(fault < 64 * MIB // 4096 // 8 for fault in faults) >= 2, faults  # pages found again

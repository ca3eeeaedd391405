# SPDX-License-Identifier: MIT
"""A CUDA program's calls to libresidency_cuda.so, the CUDA preload (docs/cuda-programs.md).

Standard library only, no compiler. Under the preload every device allocation of 2 MiB or more
sleeps after the keep-alive and wakes at its next launch or copy at the same address, without any
call from the program; these calls say what the preload cannot know, and let the program sleep or
wake at a moment of its choosing (torch_memory_saver's region()/pause()/resume()):

    LD_PRELOAD=/path/to/libresidency_cuda.so RESIDENCY_KEEP_ALIVE=5m RESIDENCY_GPU_BUDGET=100% python3 serve.py

    import residency_cuda
    with residency_cuda.region("weights"):   # read-only from now on: a sleep copies them once
        model = load_model().to("cuda")
    residency_cuda.sleep()                    # all of it now, whatever the keep-alive
    residency_cuda.wake()                     # before a burst, so that its first launch does not wait

Without the preload in the process every call does nothing (loaded() says which), so the same
program runs either way.

region(tag)
    A context manager: the device allocations this thread makes inside it carry `tag`:
    "weights" (read-only after they are filled: the first sleep copies them to the host, later
    sleeps only what a copy or memset wrote since), "kv" or "unknown" (written by kernels: copied
    at every sleep; the default), "scratch" (nothing to keep: dropped at sleep). Regions nest.
    With PyTorch's caching allocator only memory it allocates inside the region is tagged: empty
    its cache first (torch.cuda.empty_cache()) or load into a fresh process.
tag(address, size, tag) -> int
    Tags every managed allocation that lies wholly inside [address, address + size) afterwards
    ("weights" only changes anything then); returns the bytes now carrying the tag.
sleep()        every device's memory sleeps now.
wake()         wakes it now; raises RuntimeError when it could not be woken (the log says why).
managed_bytes() -> int   device memory the preload manages now, awake or asleep.
loaded() -> bool         whether libresidency_cuda.so is in this process.
"""
import contextlib
import ctypes

__all__ = ["region", "tag", "sleep", "wake", "managed_bytes", "loaded", "TAGS"]

TAGS = ("weights", "kv", "scratch", "unknown")


def _find():
    try:
        lib = ctypes.CDLL(None)  # the process's global scope, where LD_PRELOAD put the preload
        push = lib.residency_cuda_region_push
    except (OSError, AttributeError):
        return None
    push.argtypes = [ctypes.c_char_p]
    push.restype = ctypes.c_int
    lib.residency_cuda_region_pop.argtypes = []
    lib.residency_cuda_region_pop.restype = ctypes.c_int
    lib.residency_cuda_tag.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    lib.residency_cuda_tag.restype = ctypes.c_longlong
    lib.residency_cuda_sleep.argtypes = []
    lib.residency_cuda_sleep.restype = ctypes.c_int
    lib.residency_cuda_wake.argtypes = []
    lib.residency_cuda_wake.restype = ctypes.c_int
    lib.residency_cuda_managed_bytes.argtypes = []
    lib.residency_cuda_managed_bytes.restype = ctypes.c_ulonglong
    return lib


_lib = _find()


def _tag_bytes(name):
    if not isinstance(name, str) or name not in TAGS:
        raise ValueError("residency_cuda: tag %r: accepted: %s" % (name, ", ".join(TAGS)))
    return name.encode()


def loaded():
    """Whether libresidency_cuda.so is loaded into this process."""
    return _lib is not None


@contextlib.contextmanager
def region(name):
    """with region("weights"): the device allocations this thread makes inside carry the tag."""
    tag_bytes = _tag_bytes(name)
    if _lib is None:
        yield
        return
    if _lib.residency_cuda_region_push(tag_bytes) != 0:
        raise RuntimeError("residency_cuda: region(%r): regions nest at most 16 deep on a thread" % (name,))
    try:
        yield
    finally:
        _lib.residency_cuda_region_pop()


def tag(address, size, name):
    """Tags the managed allocations wholly inside [address, address + size); returns their bytes."""
    tag_bytes = _tag_bytes(name)
    if not isinstance(address, int) or not isinstance(size, int) or address < 0 or size < 0:
        raise ValueError("residency_cuda: tag(address=%r, size=%r): give two non-negative ints "
                         "(a tensor's data_ptr() and untyped_storage().nbytes())" % (address, size))
    if _lib is None:
        return 0
    return int(_lib.residency_cuda_tag(address, size, tag_bytes))


def sleep():
    """Every device's memory sleeps now."""
    if _lib is not None:
        _lib.residency_cuda_sleep()


def wake():
    """Wakes it now; RuntimeError when it could not be (the preload's log line says why)."""
    if _lib is not None and _lib.residency_cuda_wake() != 0:
        raise RuntimeError("residency_cuda: wake: device memory could not be woken (see the preload's log)")


def managed_bytes():
    """Device memory the preload manages now, awake or asleep (0 without the preload)."""
    return int(_lib.residency_cuda_managed_bytes()) if _lib is not None else 0

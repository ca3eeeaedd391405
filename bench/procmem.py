# SPDX-License-Identifier: MIT
"""What the kernel holds of a process, read and changed from outside (Linux): /proc/PID/status
figures, and a pageout of every mapping (process_madvise MADV_PAGEOUT, Linux >= 5.10, root or
CAP_SYS_NICE). Shared by the bench scripts."""
import ctypes, os

SYS_pidfd_open, SYS_process_madvise, MADV_PAGEOUT = 434, 440, 21  # x86-64 and arm64
_libc = ctypes.CDLL(None, use_errno=True)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def status(pid, keys=("VmRSS", "RssAnon", "RssFile", "VmLck", "VmSwap")):
    """{key: MiB} from /proc/PID/status."""
    out = {}
    for line in open(f"/proc/{pid}/status"):
        k, _, v = line.partition(":")
        if k in keys:
            out[k] = int(v.split()[0]) / 1024
    return out


def page_out(pid, which=None):
    """MADV_PAGEOUT over every mapping of PID, file and anonymous (or those whose /proc/PID/maps
    line `which(line)` accepts); returns the bytes advised.
    One range per call: the kernel stops a vector at the first range it refuses (a locked one,
    a CUDA process's /dev/nvidia* mappings), and that must not spare the ranges after it."""
    pidfd = _libc.syscall(SYS_pidfd_open, pid, 0)
    if pidfd < 0:
        return 0
    done = 0
    try:
        for line in open(f"/proc/{pid}/maps"):
            if "[vsyscall]" in line or (which is not None and not which(line)):
                continue
            a, b = (int(x, 16) for x in line.split()[0].split("-"))
            iov = _Iovec(a, b - a)
            done += max(_libc.syscall(SYS_process_madvise, pidfd, ctypes.byref(iov), 1, MADV_PAGEOUT, 0), 0)
    finally:
        os.close(pidfd)
    return done


def _mapping_name(header):
    """A /proc/PID/smaps header line's mapping, as a reader names it: the file's base name, or
    [heap], [stack], [anon:NAME], or [anon] for nameless anonymous memory."""
    f = header.split(maxsplit=5)
    if len(f) < 6:
        return "[anon]"
    return os.path.basename(f[5]) if f[5].startswith("/") else f[5]


def smaps(pid):
    """{mapping name: {"Rss": kB, "Swap": kB, "Locked": kB}}, summed over the mappings of one name."""
    out, cur = {}, None
    for line in open(f"/proc/{pid}/smaps"):
        key = line.split(":", 1)[0]
        if "-" in line.split(" ", 1)[0] and not key.endswith(("Rss", "Swap", "Locked")):
            cur = out.setdefault(_mapping_name(line.rstrip("\n")), {"Rss": 0, "Swap": 0, "Locked": 0})
        elif cur is not None and key in ("Rss", "Swap", "Locked"):
            cur[key] += int(line.split()[1])
    return out


def read_back(before, after):
    """What came back between two smaps() snapshots: {name: (Rss gained kB, Swap read back kB)},
    only the mappings that gained pages, largest first."""
    out = {}
    for name, a in after.items():
        b = before.get(name, {"Rss": 0, "Swap": 0})
        gained, swapped_in = a["Rss"] - b["Rss"], b["Swap"] - a["Swap"]
        if gained > 0 or swapped_in > 0:
            out[name] = (gained, swapped_in)
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0]))

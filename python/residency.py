# SPDX-License-Identifier: MIT
"""residency from Python: the C API (include/residency/residency.h) through ctypes.

One file, standard library only, no compiler: it loads libresidency.so and calls it. The library
is looked for in this order:
  1. the path in RESIDENCY_LIBRARY, if set (nothing else is tried then);
  2. ctypes.util.find_library("residency") (an installed library the loader knows);
  3. libresidency.so.1, then libresidency.so (the loader's own search: LD_LIBRARY_PATH, ...).
If none loads, importing this module raises ImportError naming each one tried and why it failed.
From a build tree: RESIDENCY_LIBRARY=build/src/libresidency.so.1 PYTHONPATH=python python3 ...

A manager holds memory resident (on Linux: mlock) while it is used and gives it back after the
keep-alive, as the C API's does; the README's "Configuration (environment)" says what each knob
means.

    import mmap, residency
    weights = mmap.mmap(-1, 64 << 20)               # the engine's memory; a model file's mmap too
    with residency.Manager("posix", keep_alive="10m") as m:
        m.register(weights, tag="weights")          # locked now
        m.sleep()                                   # given back now (or after the keep-alive)
        m.wake()                                    # locked again before the next request
        with m.use():                               # resident for this call, whatever happens
            decode()
        print(m.stats()["wired_bytes"])

Manager(backend="auto", **knobs)
    backend: "auto" (cuda, metal, else posix), "posix", "cuda", "cuda:N" (device N), "metal",
    "sim". knobs: the keys of residency_config_set (keep_alive, wired_limit, set_max_pct, layout,
    release_on_pressure, pressure_floor, pressure_quiet, shared_budget, shared_priority,
    budget_wait, state_file, log, log_time, host_budget), each a str parsed as its RESIDENCY_*
    variable would be (keep_alive="10m", wired_limit="8GiB", shared_budget="llm:60%",
    log="debug"); an int or float is written out (wired_limit=1 << 30 is bytes, keep_alive=30
    seconds), a bool is 1 or 0, None leaves the key as it is. The environment's RESIDENCY_*
    variables are the defaults; knobs override them. A bad variable or knob raises ResidencyError
    with the library's message, which names the value and the accepted forms.
    `with Manager(...) as m:` closes it at the end; close() does the same. Closing unregisters
    every region, frees every allocation and destroys the manager; a call afterwards raises
    ValueError, as a closed file's does. Calls may come from any thread; a close() while other
    threads' calls run takes effect when the last of them returns, and ends the use() scopes still
    open (the library warns; their end then only frees them).

m.register(buffer_or_address, size=None, tag="weights", priority=0) -> Region
    buffer_or_address: any contiguous buffer (bytearray, mmap, memoryview, array.array, a numpy
    array; read-only ones too, such as an mmap of a model file with access=mmap.ACCESS_READ), or
    an int address with its size. size: of a buffer, its first size bytes (default: all of it).
    tag: "weights" (kept across a release), "kv" or "scratch" (which the cuda backend may discard
    on release). The region holds the buffer (an exported view: an mmap cannot be closed or
    resized) until it is unregistered. Region: .id .address .size .tag .priority; unregister()
    (a second time does nothing), touch() (marks it just used); a context manager that
    unregisters it at the end.
m.allocate(size, tag="weights", priority=0) -> Allocation
    Backend memory (cuda: device memory at an address that never moves across sleep and wake).
    The host backends allocate nothing: on posix this raises ResidencyError (RESIDENCY_UNSUPPORTED).
    Allocation: .id .address .size .tag .priority; free(); cuda_array(shape, typestr, strides)
    (below).
m.sleep()      gives the memory back now (residency_release_now).
m.wake()       makes it resident again now (residency_prefetch, then residency_touch).
m.prefetch()   a request arrived: re-wire in the background, so that the next touch finds it done.
m.touch()      once per compute (what keeps the keep-alive from expiring while in use).
with m.use(synchronize=None) as scope:
    resident from the start of the block to its end (residency_use_begin/_end). synchronize: a
    callable run first at the end (wait for the device's work, e.g. torch.cuda.synchronize);
    an exception it raises is raised again at the end of the block. scope.unwired is None, or the
    library's message when only part of the memory could be made resident (over a budget).
m.set_wired_limit(bytes)
m.stats() -> dict: the fields of residency/stats_fields.h under their C names (rewire_time_ns);
    resident is a bool.

Errors: ResidencyError(status, message): .status is the residency_status name
("RESIDENCY_INVALID_ARGUMENT"), .code its number, str() and .message the library's
residency_last_error(). Bad Python arguments (an unknown tag, a buffer that is not contiguous) raise
ValueError or TypeError before the library is called.

PyTorch on a GPU. NOT run in CI: it needs a GPU, PyTorch and a CUDA build of libresidency
(-DRESIDENCY_WITH_CUDA=ON; tests/python/test_residency.py runs on the posix backend only).
Allocation.cuda_array(shape, typestr, strides=None) returns an object with
__cuda_array_interface__ (version 3) over the allocation, which torch.as_tensor (and CuPy, Numba)
wraps without a copy; typestr as numpy writes it: "<f2" float16, "<f4" float32, "|u1" uint8.
The tensor is a view: it must not be used after free() or close(), which give the memory back.

    import torch, residency
    with residency.Manager("cuda:0", keep_alive="30s") as m:
        a = m.allocate(1 << 30, tag="weights")                    # 1 GiB of device memory
        w = torch.as_tensor(a.cuda_array((1 << 29,), "<f2"), device="cuda:0")
        w.copy_(weights_on_host)                                  # load once
        for request in requests:
            m.prefetch()                                          # wake in the background
            with m.use(synchronize=torch.cuda.synchronize):      # resident for the call
                serve(w, request)
        # Idle past the keep-alive, the device memory is given back; w keeps its address, and
        # after the next wake its contents ("weights"; "kv" and "scratch" may come back empty).
"""

import ctypes
import ctypes.util
import os
import re
import sys
import threading

__all__ = ["ResidencyError", "Manager", "Region", "Allocation", "STATS_FIELDS", "TAGS", "library_version"]

# The ABI this module was written for (RESIDENCY_ABI_VERSION in residency.h).
ABI_VERSION = 1

# residency_status, by number.
_STATUS_NAMES = {
    0: "RESIDENCY_OK",
    1: "RESIDENCY_INVALID_ARGUMENT",
    2: "RESIDENCY_LIMIT_EXCEEDED",
    3: "RESIDENCY_PERMISSION_DENIED",
    4: "RESIDENCY_OUT_OF_MEMORY",
    5: "RESIDENCY_UNSUPPORTED",
    6: "RESIDENCY_NOT_FOUND",
    7: "RESIDENCY_IO_ERROR",
    8: "RESIDENCY_BACKEND_ERROR",
    9: "RESIDENCY_INTERRUPTED",
}

# Tags and their residency_class.
TAGS = {"weights": 0, "kv": 1, "scratch": 2}

# The fields of residency_stats after struct_size, in the order of RESIDENCY_STATS_FIELDS in
# include/residency/stats_fields.h, which is the C ABI. Written out here rather than parsed from
# the header, which an installed library may not ship; tests/python/test_residency.py compares
# the two lists, so a field added there fails the test until it is added here.
STATS_FIELDS = [
    ("U64", "tracked_bytes"),
    ("U64", "admitted_bytes"),
    ("U64", "wired_bytes"),
    ("U64", "pending_bytes"),
    ("U64", "wired_limit"),
    ("U32", "regions"),
    ("U32", "sets"),
    ("FLAG", "resident"),
    ("U64", "commits"),
    ("U64", "residency_requests"),
    ("U64", "releases"),
    ("U64", "rewires"),
    ("NS", "rewire_time"),
    ("U64", "scheduler_wakeups"),
    ("U64", "wire_failures"),
    ("U64", "release_failures"),
    ("U64", "pressure_releases"),
    ("U64", "pressure_restores"),
    ("U64", "pressure_cap"),
    ("U64", "shared_budget"),
    ("U64", "shared_held"),
    ("U64", "shared_asks"),
    ("U64", "shared_gave_back"),
    ("U64", "shared_short"),
]

# Each TYPE's C type and name spelling (RESIDENCY_STATS_C_TYPE_* / _NAME_* in stats_fields.h).
_STATS_C_TYPES = {"U64": ctypes.c_uint64, "U32": ctypes.c_uint32, "FLAG": ctypes.c_int, "NS": ctypes.c_uint64}


def _stats_c_name(kind, name):
    return name + "_ns" if kind == "NS" else name


class _Stats(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t)] + [
        (_stats_c_name(kind, name), _STATS_C_TYPES[kind]) for kind, name in STATS_FIELDS
    ]


class _BackendOptions(ctypes.Structure):  # residency_backend_options
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("kind", ctypes.c_char_p),
        ("cuda_device", ctypes.c_int),
        ("metal_device", ctypes.c_void_p),
        ("metal_attach_to_queues", ctypes.c_int),
    ]


_SYNCHRONIZE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _candidates():
    path = os.environ.get("RESIDENCY_LIBRARY")
    if path:
        return [path]
    names = [ctypes.util.find_library("residency")]
    if sys.platform == "darwin":
        names += ["libresidency.1.dylib", "libresidency.dylib"]
    names += ["libresidency.so.1", "libresidency.so"]
    return [n for i, n in enumerate(names) if n and n not in names[:i]]


def _load():
    tried = []
    for name in _candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            tried.append("%s (%s)" % (name, e))
            continue
        if not hasattr(lib, "residency_abi_version"):
            tried.append("%s (not libresidency: no residency_abi_version)" % name)
            continue
        lib.residency_abi_version.restype = ctypes.c_uint32
        abi = lib.residency_abi_version()
        if abi != ABI_VERSION:
            tried.append("%s (ABI %d; this module speaks ABI %d)" % (name, abi, ABI_VERSION))
            continue
        return lib
    how = ("RESIDENCY_LIBRARY is set, so only it was tried" if os.environ.get("RESIDENCY_LIBRARY")
           else "set RESIDENCY_LIBRARY to libresidency.so.1's path (a build: build/src/libresidency.so.1), "
           "or install the library (cmake --install) where the loader looks")
    raise ImportError("residency: cannot load libresidency; tried: " + "; ".join(tried) + ". " + how)


_lib = _load()

_p = ctypes.c_void_p
_pp = ctypes.POINTER(ctypes.c_void_p)
_u64p = ctypes.POINTER(ctypes.c_uint64)
for _name, _res, _args in [
    ("residency_version", ctypes.c_char_p, []),
    ("residency_last_error", ctypes.c_char_p, []),
    ("residency_config_from_env", ctypes.c_int, [_pp]),
    ("residency_config_set", ctypes.c_int, [_p, ctypes.c_char_p, ctypes.c_char_p]),
    ("residency_config_free", None, [_p]),
    ("residency_backend_create", ctypes.c_int, [ctypes.POINTER(_BackendOptions), _pp]),
    ("residency_backend_release", None, [_p]),
    ("residency_manager_create", ctypes.c_int, [_p, ctypes.c_char_p, _p, _p, _pp]),
    ("residency_manager_create_with_backend", ctypes.c_int, [_p, _p, _p, _p, _pp]),
    ("residency_manager_destroy", None, [_p]),
    ("residency_register", ctypes.c_int, [_p, _p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _u64p]),
    ("residency_unregister", ctypes.c_int, [_p, ctypes.c_uint64]),
    ("residency_allocate", ctypes.c_int, [_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _pp, _u64p]),
    ("residency_free", ctypes.c_int, [_p, _p]),
    ("residency_set_wired_limit", ctypes.c_int, [_p, ctypes.c_uint64]),
    ("residency_touch", None, [_p]),
    ("residency_touch_region", None, [_p, ctypes.c_uint64]),
    ("residency_prefetch", None, [_p]),
    ("residency_use_begin", _p, [_p, _SYNCHRONIZE_FN, _p, ctypes.POINTER(ctypes.c_int)]),
    ("residency_use_end", None, [_p]),
    ("residency_release_now", None, [_p]),
    ("residency_get_stats", ctypes.c_int, [_p, ctypes.POINTER(_Stats)]),
]:
    _fn = getattr(_lib, _name)
    _fn.restype, _fn.argtypes = _res, _args


def library_version():
    """The loaded library's version ("0.1.0")."""
    return _lib.residency_version().decode()


class ResidencyError(Exception):
    """A call into libresidency failed: .status (the residency_status name), .code, .message."""

    def __init__(self, code, message):
        self.code = code
        self.status = _STATUS_NAMES.get(code, "residency_status %d" % code)
        self.message = message
        super().__init__(message)


def _error(code, context=None):
    message = (_lib.residency_last_error() or b"").decode(errors="replace")
    if context:
        message = context + ": " + message
    return ResidencyError(code, message or _STATUS_NAMES.get(code, str(code)))


def _check(code, context=None):
    if code != 0:
        raise _error(code, context)


def _class_of(tag):
    if tag not in TAGS:
        raise ValueError("residency: unknown tag %r; accepted: %s" % (tag, ", ".join(TAGS)))
    return TAGS[tag]


def _knob_text(key, value):
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float, str)):
        return str(value)
    raise TypeError("residency: knob %s=%r: give a str, int, float or bool" % (key, value))


def _address_of(view):
    """The address of a contiguous memoryview's first byte (read-only ones too)."""
    if view.nbytes == 0:
        return 0
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    # ctypes takes only writable buffers: ask CPython for the Py_buffer, whose first member is
    # `void* buf`, and release it at once (the memoryview keeps the export alive).
    py_buffer = (ctypes.c_byte * 256)()  # room for a Py_buffer (80 bytes on 64-bit CPython)
    get, release = ctypes.pythonapi.PyObject_GetBuffer, ctypes.pythonapi.PyBuffer_Release
    get.argtypes, get.restype = [ctypes.py_object, ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    release.argtypes, release.restype = [ctypes.c_void_p], None
    get(view, py_buffer, 0)  # PyBUF_SIMPLE; raises on failure
    try:
        return ctypes.c_void_p.from_buffer(py_buffer).value
    finally:
        release(py_buffer)


class Region:
    """A registered range: .id .address .size .tag .priority."""

    def __init__(self, manager, region_id, address, size, tag, priority, view):
        self._manager, self._view = manager, view
        self.id, self.address, self.size, self.tag, self.priority = region_id, address, size, tag, priority

    def unregister(self):
        """Stops tracking it (unlocks it) and lets go of the buffer. A second call does nothing."""
        self._manager._unregister(self)

    def touch(self):
        """Marks it just used (the budget's least-recently-used order), and touches the manager."""
        self._manager._call(_lib.residency_touch_region, self.id)

    def _let_go(self):
        if self._view is not None:
            self._view.release()
            self._view = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unregister()

    def __repr__(self):
        return "<residency.Region id=%d address=0x%x size=%d tag=%s>" % (self.id, self.address, self.size, self.tag)


class _CudaArray:
    """__cuda_array_interface__ (version 3) over part of an Allocation; keeps the Allocation."""

    def __init__(self, allocation, shape, typestr, strides):
        self._allocation = allocation
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (allocation.address, False),
            "strides": strides,
            "version": 3,
        }


class Allocation:
    """Backend memory from Manager.allocate: .id .address .size .tag .priority."""

    def __init__(self, manager, allocation_id, address, size, tag, priority):
        self._manager = manager
        self.id, self.address, self.size, self.tag, self.priority = allocation_id, address, size, tag, priority

    def free(self):
        """Gives the memory back (residency_free). A second call does nothing."""
        self._manager._free(self)

    def cuda_array(self, shape, typestr="|u1", strides=None):
        """An object with __cuda_array_interface__ over this memory, for torch.as_tensor, CuPy,
        Numba. typestr as numpy's ("<f2", "<f4", "|u1"); strides in bytes, None for C order."""
        shape = tuple(int(n) for n in shape)
        m = re.fullmatch(r"[<>|=][a-zA-Z](\d+)", typestr)
        if not m:
            raise ValueError("cuda_array: typestr %r: write it as numpy does ('<f4', '<f2', '|u1')" % typestr)
        itemsize, extent = int(m.group(1)), 0
        if all(shape):
            if strides is None:
                extent = itemsize
                for n in shape:
                    extent *= n
            else:
                strides = tuple(int(s) for s in strides)
                if len(strides) != len(shape) or min(strides) < 0:
                    raise ValueError("cuda_array: strides %r do not fit shape %r" % (strides, shape))
                extent = itemsize + sum((n - 1) * s for n, s in zip(shape, strides))
        if extent > self.size:
            raise ValueError("cuda_array: shape %r of %s needs %d bytes; the allocation has %d"
                             % (shape, typestr, extent, self.size))
        return _CudaArray(self, shape, typestr, strides)

    def __repr__(self):
        return "<residency.Allocation id=%d address=0x%x size=%d tag=%s>" % (
            self.id, self.address, self.size, self.tag)


class _UseScope:
    """with m.use(): residency_use_begin at the start, residency_use_end at the end."""

    def __init__(self, manager, synchronize):
        self._manager = manager
        self._synchronize = synchronize
        self._callback = _SYNCHRONIZE_FN()  # NULL; else the ctypes callback, alive as long as the scope
        self._raised = None
        self._scope = None
        self.unwired = None

    def _run_synchronize(self, _user):
        try:
            self._synchronize()
        except BaseException as e:  # never across C; raised again by __exit__
            self._raised = e

    def __enter__(self):
        if self._scope is not None:
            raise RuntimeError("residency: this use() scope is open already; call m.use() for another")
        if self._synchronize is not None:
            self._callback = _SYNCHRONIZE_FN(self._run_synchronize)
        status = ctypes.c_int(0)
        scope = self._manager._call(_lib.residency_use_begin, self._callback, None, ctypes.byref(status))
        if not scope:
            raise _error(status.value, "use()")
        self._scope = scope
        if status.value != 0:  # open, but only partly wired (over a budget)
            self.unwired = _error(status.value).message
        return self

    def __exit__(self, *exc):
        scope, self._scope = self._scope, None
        # Valid even after the manager was closed (residency.h: it then only frees the scope).
        _lib.residency_use_end(scope)
        raised, self._raised = self._raised, None
        if raised is not None and exc[0] is None:
            raise raised


class Manager:
    """A residency manager: Manager(backend="auto", **knobs); see the module's documentation."""

    def __init__(self, backend="auto", **knobs):
        self._lock = threading.Lock()
        self._handle = None
        self._closing = False
        self._calls = 0  # calls in flight, counted under _lock; the last one after close() tears down
        self._regions = {}
        self._allocations = {}
        if not isinstance(backend, str):
            raise TypeError("residency: backend %r: give a str such as 'auto', 'posix', 'cuda:0'" % (backend,))
        kind, device = backend, None
        if backend.startswith("cuda:"):
            number = backend[len("cuda:"):]
            if not number.isdigit():
                raise ValueError("residency: backend %r: write cuda:N with N a device number (cuda:0)" % backend)
            kind, device = "cuda", int(number)
        cfg = ctypes.c_void_p()
        _check(_lib.residency_config_from_env(ctypes.byref(cfg)), "Manager: the environment")
        try:
            for key, value in knobs.items():
                if value is None:
                    continue
                code = _lib.residency_config_set(cfg, key.encode(), _knob_text(key, value).encode())
                _check(code, "Manager(%s=%r)" % (key, value))
            handle = ctypes.c_void_p()
            if device is None:
                _check(_lib.residency_manager_create(cfg, kind.encode(), None, None, ctypes.byref(handle)),
                       "Manager(%r)" % backend)
            else:
                options = _BackendOptions(ctypes.sizeof(_BackendOptions), b"cuda", device, None, 0)
                b = ctypes.c_void_p()
                _check(_lib.residency_backend_create(ctypes.byref(options), ctypes.byref(b)), "Manager(%r)" % backend)
                try:
                    _check(_lib.residency_manager_create_with_backend(cfg, b, None, None, ctypes.byref(handle)),
                           "Manager(%r)" % backend)
                finally:
                    _lib.residency_backend_release(b)  # the manager keeps it alive
        finally:
            _lib.residency_config_free(cfg)
        self._handle = handle.value

    # --- calls, counted so that close() never destroys what a call on another thread uses ---

    def _begin(self):
        with self._lock:
            if self._closing:
                raise ValueError("residency: the manager is closed")
            self._calls += 1
            return self._handle

    def _end(self):
        with self._lock:
            self._calls -= 1
            handle = self._take_handle_if_idle()
        if handle:
            self._teardown(handle)

    def _call(self, fn, *args):
        handle = self._begin()
        try:
            return fn(handle, *args)
        finally:
            self._end()

    def _take_handle_if_idle(self):  # with _lock held
        if not self._closing or self._calls or not self._handle:
            return None
        handle, self._handle = self._handle, None
        return handle

    def _teardown(self, handle):
        with self._lock:
            regions, self._regions = list(self._regions.values()), {}
            allocations, self._allocations = list(self._allocations.values()), {}
        for region in regions:  # quietly: destroy would warn of each region left
            _lib.residency_unregister(handle, region.id)
            region._let_go()
        for allocation in allocations:
            _lib.residency_free(handle, allocation.address)
        _lib.residency_manager_destroy(handle)

    def close(self):
        """Unregisters every region, frees every allocation, destroys the manager. Idempotent."""
        with self._lock:
            self._closing = True
            handle = self._take_handle_if_idle()
        if handle:
            self._teardown(handle)

    @property
    def closed(self):
        return self._closing

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the module may be half gone
            pass

    # --- regions and allocations ---

    def register(self, buffer_or_address, size=None, tag="weights", priority=0):
        """Tracks a buffer (or an int address with its size); returns a Region."""
        cls = _class_of(tag)
        if size is not None and size < 0:
            raise ValueError("residency: register: size %d is negative" % size)
        view, region = None, None
        try:
            if isinstance(buffer_or_address, int) and not isinstance(buffer_or_address, bool):
                if size is None:
                    raise TypeError("residency: register(address) needs size=")
                address = buffer_or_address
            else:
                view = memoryview(buffer_or_address)  # TypeError for what is not a buffer
                if not view.contiguous:
                    raise ValueError("residency: register: the buffer is not contiguous; register each part, "
                                     "or the whole of what it views")
                if size is None:
                    size = view.nbytes
                elif size > view.nbytes:
                    raise ValueError("residency: register: size %d, but the buffer has %d bytes" % (size, view.nbytes))
                address = _address_of(view)
            region_id = ctypes.c_uint64()
            handle = self._begin()
            try:
                _check(_lib.residency_register(handle, address, size, cls, priority, ctypes.byref(region_id)),
                       "register")
                region = Region(self, region_id.value, address, size, tag, priority, view)
                with self._lock:  # before _end: a close() waiting for this call unregisters it
                    self._regions[region.id] = region
            finally:
                self._end()
            return region
        except BaseException:
            if view is not None and region is None:
                view.release()
            raise

    def _unregister(self, region):
        with self._lock:
            if self._closing or self._regions.pop(region.id, None) is None:
                return  # unregistered already, or close() does it
            self._calls += 1
            handle = self._handle
        try:
            _check(_lib.residency_unregister(handle, region.id), "unregister")
        finally:
            region._let_go()
            self._end()

    def allocate(self, size, tag="weights", priority=0):
        """Backend memory (cuda); the host backends raise ResidencyError. Returns an Allocation."""
        cls = _class_of(tag)
        ptr, allocation_id = ctypes.c_void_p(), ctypes.c_uint64()
        handle = self._begin()
        try:
            _check(_lib.residency_allocate(handle, size, cls, priority, ctypes.byref(ptr), ctypes.byref(allocation_id)),
                   "allocate")
            allocation = Allocation(self, allocation_id.value, ptr.value, size, tag, priority)
            with self._lock:
                self._allocations[allocation.address] = allocation
            return allocation
        finally:
            self._end()

    def _free(self, allocation):
        with self._lock:
            if self._closing or self._allocations.pop(allocation.address, None) is None:
                return
            self._calls += 1
            handle = self._handle
        try:
            _check(_lib.residency_free(handle, allocation.address), "free")
        finally:
            self._end()

    # --- residency ---

    def touch(self):
        """Once per compute: keeps the memory resident (re-wires it first if it was released)."""
        self._call(_lib.residency_touch)

    def prefetch(self):
        """A request arrived: re-wire in the background now."""
        self._call(_lib.residency_prefetch)

    def wake(self):
        """Makes the memory resident again now: residency_prefetch, then residency_touch."""
        self._call(_lib.residency_prefetch)
        self._call(_lib.residency_touch)

    def sleep(self):
        """Gives the memory back now (residency_release_now)."""
        self._call(_lib.residency_release_now)

    def use(self, synchronize=None):
        """with m.use(): resident for the block. synchronize: run first at its end (or None)."""
        if synchronize is not None and not callable(synchronize):
            raise TypeError("residency: use(synchronize=%r): give a callable or None" % (synchronize,))
        return _UseScope(self, synchronize)

    def set_wired_limit(self, limit):
        """The wired budget, in bytes."""
        _check(self._call(_lib.residency_set_wired_limit, limit), "set_wired_limit")

    def stats(self):
        """The manager's statistics, a dict by the C names of stats_fields.h."""
        out = _Stats()
        out.struct_size = ctypes.sizeof(_Stats)
        _check(self._call(_lib.residency_get_stats, ctypes.byref(out)), "stats")
        stats = {}
        for kind, name in STATS_FIELDS:
            c_name = _stats_c_name(kind, name)
            field = getattr(_Stats, c_name)
            if field.offset + field.size > out.struct_size:  # an older library: fields it lacks
                continue
            value = getattr(out, c_name)
            stats[c_name] = bool(value) if kind == "FLAG" else value
        return stats

    def __repr__(self):
        return "<residency.Manager %s>" % ("closed" if self._closing else "0x%x" % self._handle)

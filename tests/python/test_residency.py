# SPDX-License-Identifier: MIT
# python/residency.py on the posix backend, as a Python user sees it: VmLck (/proc/self/status)
# grows by the registered 16 MiB on wake() and inside use(), and goes back on sleep() and at the
# end of `with Manager(...)`; stats() has the header's fields; bad knobs, tags and calls raise what
# the module's documentation says; the README's Python block runs. Standard library only (unittest).
# Run by ctest (tests/python/CMakeLists.txt) with RESIDENCY_LIBRARY set to the built library and
# PYTHONPATH to python/; by hand:
#   RESIDENCY_LIBRARY=build/src/libresidency.so.1 python3 tests/python/test_residency.py
import contextlib
import io
import mmap
import os
import pathlib
import re
import resource
import subprocess
import sys
import tempfile
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "python"))  # after PYTHONPATH: ctest's wins

# The tests set what they use: a RESIDENCY_* variable of the caller's shell (a keep-alive, a shared
# budget) must not change them. Config::from_env reads the environment at Manager(), after this.
for _name in [n for n in os.environ if n.startswith("RESIDENCY_") and n != "RESIDENCY_LIBRARY"]:
    del os.environ[_name]

import residency  # noqa: E402

MiB = 1 << 20
SIZE = 16 * MiB
PAGE_KB = resource.getpagesize() // 1024
# Every test's manager: no pressure releases (another test's memory hog must not unlock ours
# mid-test) and no state file in /dev/shm (other tests list the managed processes).
QUIET = {"release_on_pressure": False, "state_file": False, "log": "warn"}


def vmlck_kb():
    with open("/proc/self/status") as f:
        return int(re.search(r"^VmLck:\s+(\d+) kB", f.read(), re.M).group(1))


def why_mlock_is_not_permitted(nbytes):
    """None where this process may lock nbytes more (and a MiB to spare); else the reason."""
    if not sys.platform.startswith("linux"):
        return "VmLck is Linux's (/proc/self/status)"
    with open("/proc/self/status") as f:
        cap_eff = int(re.search(r"^CapEff:\s*([0-9a-fA-F]+)", f.read(), re.M).group(1), 16)
    if cap_eff >> 14 & 1:  # CAP_IPC_LOCK: RLIMIT_MEMLOCK does not apply
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= vmlck_kb() * 1024 + nbytes + MiB:
        return None
    return ("mlock of %d MiB is not permitted here: RLIMIT_MEMLOCK is %d KiB and no CAP_IPC_LOCK "
            "(ulimit -l unlimited)" % (nbytes // MiB, soft // 1024))


def header_stats_fields():
    """(TYPE, name) of each X(...) of RESIDENCY_STATS_FIELDS in include/residency/stats_fields.h."""
    text = (ROOT / "include" / "residency" / "stats_fields.h").read_text()
    start = text.index("#define RESIDENCY_STATS_FIELDS(X)")
    lines = []
    for line in text[start:].splitlines()[1:]:
        lines.append(line)
        if not line.rstrip().endswith("\\"):
            break
    body = re.sub(r"/\*.*?\*/", "", "\n".join(lines), flags=re.S)
    return re.findall(r"\bX\(\s*(\w+)\s*,\s*(\w+)\s*,", body)


def readme_python_block():
    """The ```python block of the README's "From Python" section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### From Python"):]
    return re.search(r"^```python\n(.*?)^```$", section, re.S | re.M).group(1)


class WithoutLocking(unittest.TestCase):
    """What needs no mlock: the fields, errors, arguments."""

    def test_stats_fields_are_the_headers(self):
        from_header = header_stats_fields()
        self.assertGreater(len(from_header), 20, "the header's list was not found")
        self.assertEqual(residency.STATS_FIELDS, from_header,
                         "python/residency.py's STATS_FIELDS must list stats_fields.h's fields, in its order")
        with residency.Manager("posix", **QUIET) as m:
            names = [name + "_ns" if kind == "NS" else name for kind, name in from_header]
            self.assertEqual(list(m.stats()), names, "the library filled every field")

    def test_a_bad_knob_names_its_value(self):
        with self.assertRaises(residency.ResidencyError) as e:
            residency.Manager("posix", keep_alive="soon", **QUIET)
        self.assertEqual(e.exception.status, "RESIDENCY_INVALID_ARGUMENT")
        self.assertIn('"soon"', str(e.exception))
        self.assertIn("keep_alive", str(e.exception))

    def test_an_unknown_knob_lists_the_keys(self):
        with self.assertRaises(residency.ResidencyError) as e:
            residency.Manager("posix", keepalive="10m", **QUIET)
        self.assertIn("unknown key 'keepalive'", str(e.exception))
        self.assertIn("keep_alive", str(e.exception))

    def test_an_unknown_backend_is_an_error(self):
        with self.assertRaises(residency.ResidencyError):
            residency.Manager("tpu", **QUIET)
        with self.assertRaisesRegex(ValueError, "cuda:N"):
            residency.Manager("cuda:first", **QUIET)

    def test_a_bad_tag_names_the_accepted_ones(self):
        with residency.Manager("posix", **QUIET) as m:
            with self.assertRaisesRegex(ValueError, "'weight'.*weights, kv, scratch"):
                m.register(bytearray(4096), tag="weight")
            with self.assertRaisesRegex(ValueError, "weights, kv, scratch"):
                m.allocate(4096, tag="cache")
            self.assertEqual(m.stats()["regions"], 0)

    def test_allocate_on_posix_is_an_error(self):
        with residency.Manager("posix", **QUIET) as m:
            with self.assertRaises(residency.ResidencyError) as e:
                m.allocate(MiB)
            self.assertEqual(e.exception.status, "RESIDENCY_UNSUPPORTED")
            self.assertIn("does not allocate", e.exception.message)

    def test_a_closed_manager_refuses_calls(self):
        m = residency.Manager("posix", **QUIET)
        m.close()
        m.close()
        self.assertTrue(m.closed)
        for call in (m.touch, m.wake, m.sleep, m.stats, lambda: m.register(bytearray(4096))):
            with self.assertRaisesRegex(ValueError, "closed"):
                call()

    def test_an_address_needs_a_size_and_a_buffer_must_be_contiguous(self):
        with residency.Manager("posix", **QUIET) as m:
            with self.assertRaises(TypeError):
                m.register(0x1000)
            with self.assertRaisesRegex(ValueError, "not contiguous"):
                m.register(memoryview(bytearray(8192))[::2])
            with self.assertRaisesRegex(ValueError, "size 8193"):
                m.register(bytearray(8192), size=8193)

    def test_cuda_array_describes_the_allocation(self):
        # No GPU here: an Allocation as allocate() would return it on cuda, to check the interface.
        a = residency.Allocation(None, 7, 0x7F0000000000, 4 * MiB, "weights", 0)
        i = a.cuda_array((1024, 1024), "<f4").__cuda_array_interface__
        self.assertEqual(i, {"shape": (1024, 1024), "typestr": "<f4", "data": (0x7F0000000000, False),
                             "strides": None, "version": 3})
        with self.assertRaisesRegex(ValueError, "needs 8388608 bytes"):
            a.cuda_array((1024, 2048), "<f4")
        with self.assertRaisesRegex(ValueError, "typestr"):
            a.cuda_array((16,), "float32")

    def test_no_library_is_an_import_error_naming_it(self):
        env = dict(os.environ, RESIDENCY_LIBRARY="/nonexistent/libresidency.so.1",
                   PYTHONPATH=str(ROOT / "python"))
        p = subprocess.run([sys.executable, "-c", "import residency"], env=env, capture_output=True, text=True)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("ImportError", p.stderr)
        self.assertIn("/nonexistent/libresidency.so.1", p.stderr)


class Locking(unittest.TestCase):
    """What a user sees in VmLck on the posix backend."""

    def setUp(self):
        reason = why_mlock_is_not_permitted(SIZE)
        if reason:
            self.skipTest(reason)
        self.before = vmlck_kb()

    def assertLockedMore(self, kb, message):
        self.assertGreaterEqual(vmlck_kb() - self.before, kb, message)

    def assertBackToBefore(self, message):
        self.assertLessEqual(abs(vmlck_kb() - self.before), 2 * PAGE_KB, message)

    def test_wake_sleep_and_use(self):
        weights = mmap.mmap(-1, SIZE)
        with residency.Manager("posix", keep_alive="10m", **QUIET) as m:
            region = m.register(weights, tag="weights")
            self.assertEqual((region.size, region.tag), (SIZE, "weights"))
            m.wake()
            self.assertLockedMore(SIZE // 1024, "wake() locks the 16 MiB")
            m.sleep()
            self.assertBackToBefore("sleep() unlocks them")
            self.assertFalse(m.stats()["resident"])
            with m.use():
                self.assertLockedMore(SIZE // 1024, "use() locks them again")
                self.assertTrue(m.stats()["resident"])
            self.assertLockedMore(SIZE // 1024, "they stay locked after use() under keep_alive 10m")
            s = m.stats()
            self.assertEqual((s["tracked_bytes"], s["regions"]), (SIZE, 1))
            self.assertGreaterEqual(s["wired_bytes"], SIZE)
            m.sleep()
            m.touch()
            self.assertLockedMore(SIZE // 1024, "touch() after sleep() locks them again")
        self.assertBackToBefore("the end of `with Manager(...)` unlocks everything")
        weights.close()  # the manager let go of the buffer

    def test_keep_alive_zero_unlocks_at_the_end_of_use(self):
        weights = bytearray(SIZE)
        calls = []
        with residency.Manager("posix", keep_alive="0", **QUIET) as m:
            m.register(weights, tag="kv")
            with m.use(synchronize=lambda: calls.append(vmlck_kb() - self.before)) as scope:
                self.assertIsNone(scope.unwired)
                self.assertLockedMore(SIZE // 1024, "locked inside use()")
            self.assertBackToBefore("keep_alive 0: unlocked at the end of use()")
        self.assertEqual(len(calls), 1, "synchronize ran once")
        self.assertGreaterEqual(calls[0], SIZE // 1024, "synchronize ran before the release")

    def test_synchronize_raising_is_raised_at_the_end_of_use(self):
        with residency.Manager("posix", keep_alive="0", **QUIET) as m:
            m.register(bytearray(MiB))
            with self.assertRaises(ZeroDivisionError):
                with m.use(synchronize=lambda: 1 / 0):
                    pass
            self.assertBackToBefore("released all the same")

    def test_a_region_holds_its_buffer_until_unregistered(self):
        weights = mmap.mmap(-1, SIZE)
        with residency.Manager("posix", keep_alive="10m", **QUIET) as m:
            region = m.register(weights)
            with self.assertRaises(BufferError):
                weights.close()  # an mmap cannot go while registered
            region.unregister()
            region.unregister()  # a second time does nothing
            self.assertBackToBefore("unregister() unlocks it")
            self.assertEqual(m.stats()["regions"], 0)
            weights.close()

    def test_a_read_only_file_mapping(self):
        with tempfile.TemporaryFile() as f:
            f.truncate(SIZE)
            model = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            with residency.Manager("posix", keep_alive="10m", **QUIET) as m:
                with m.register(model, tag="weights") as region:
                    self.assertEqual(region.size, SIZE)
                    m.wake()
                    self.assertLockedMore(SIZE // 1024, "a read-only mapping locks as well")
                self.assertBackToBefore("the region's `with` unregistered it")
            model.close()

    def test_the_readme_block_runs(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(readme_python_block(), {})
        self.assertEqual(out.getvalue(), "16 MiB wired\n")
        self.assertBackToBefore("nothing left locked")


if __name__ == "__main__":
    # Exit 77 (ctest's SKIP_RETURN_CODE) when every test that ran was skipped: ctest then shows the
    # test as skipped rather than passed. `test_residency.py Locking` runs one class.
    result = unittest.main(verbosity=2, exit=False).result
    if result.testsRun and len(result.skipped) == result.testsRun:
        sys.exit(77)
    sys.exit(0 if result.wasSuccessful() else 1)

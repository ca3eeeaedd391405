# SPDX-License-Identifier: MIT
"""python/residency_cuda.py with and without libresidency_cuda.so in the process (no GPU needed:
the calls reach the preload, which has no device to manage here).

  test_residency_cuda.py Without   # plain python3: every call does nothing
  test_residency_cuda.py With      # under LD_PRELOAD=libresidency_cuda.so
"""
import sys
import unittest

import residency_cuda as rc


class Common:
    def test_a_bad_tag_is_named_with_the_accepted_ones(self):
        for bad in ("Weights", "", None, 3):
            with self.assertRaises(ValueError) as e:
                with rc.region(bad):
                    pass
            self.assertIn("accepted: weights, kv, scratch, unknown", str(e.exception))
        with self.assertRaises(ValueError):
            rc.tag(0, 4096, "ro")
        with self.assertRaises(ValueError) as e:
            rc.tag(-1, 4096, "weights")
        self.assertIn("non-negative ints", str(e.exception))

    def test_sleep_wake_and_nothing_managed(self):
        rc.sleep()
        rc.wake()
        self.assertEqual(rc.managed_bytes(), 0)
        self.assertEqual(rc.tag(0x7f0000000000, 1 << 30, "weights"), 0)


class Without(Common, unittest.TestCase):
    def test_not_loaded_and_regions_do_nothing(self):
        self.assertFalse(rc.loaded())
        with rc.region("weights"):
            with rc.region("kv"):
                pass


class With(Common, unittest.TestCase):
    def test_loaded_and_regions_nest_up_to_sixteen(self):
        self.assertTrue(rc.loaded())
        with rc.region("weights"):
            with rc.region("scratch"):
                pass
        stack = []
        try:
            for _ in range(16):
                cm = rc.region("kv")
                cm.__enter__()
                stack.append(cm)
            with self.assertRaises(RuntimeError) as e:
                with rc.region("kv"):
                    pass
            self.assertIn("at most 16 deep", str(e.exception))
        finally:
            for cm in reversed(stack):
                cm.__exit__(None, None, None)
        with rc.region("weights"):  # every level was popped: there is room again
            pass

    def test_a_region_is_popped_when_its_block_raises(self):
        for _ in range(20):  # more than the depth: a leaked level would run out
            with self.assertRaises(KeyError):
                with rc.region("weights"):
                    raise KeyError("x")


if __name__ == "__main__":
    which = sys.argv.pop(1) if len(sys.argv) > 1 else "Without"
    suite = unittest.TestLoader().loadTestsFromTestCase({"Without": Without, "With": With}[which])
    sys.exit(0 if unittest.TextTestRunner(verbosity=2).run(suite).wasSuccessful() else 1)

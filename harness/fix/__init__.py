"""The fix engine: from a verified cause (and the sweep's cleaners and leaks) to a verified patch.

The sweep drives it (harness.sweep imports it, never the reverse); it runs tests only through
the `replay` the sweep hands it (harness.fix.case.ReplayIn).
"""

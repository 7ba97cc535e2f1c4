"""Module-level settings: an attribute the polluter rebinds and never restores."""

DEBUG = False

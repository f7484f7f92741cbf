"""Kernel launchers. Each module owns one kernel family: its specs, parameter struct and launch."""

"""Spindle: a planner and runtime for multi-task multi-modal training (ASPLOS 2025)."""

__version__ = "0.1.0"

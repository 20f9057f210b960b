"""Shared plumbing: one-line user errors, units of bytes, located JSON errors, tables, progress, output checks."""

"""Backends of the frontend language: engine (in-process), remote (a server), mock (tests)."""

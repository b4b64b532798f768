"""Fixtures shared by the whole suite."""

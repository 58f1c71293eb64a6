"""Distributed execution (chapter 10)."""

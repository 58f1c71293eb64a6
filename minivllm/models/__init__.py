"""Models, their layers, and weight loading (chapter 06)."""

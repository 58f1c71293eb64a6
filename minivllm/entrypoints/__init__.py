"""User entry points: the offline `LLM` class (chapter 01) and, later, the server (chapter 11)."""

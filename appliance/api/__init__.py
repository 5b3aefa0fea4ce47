"""OpenAI-compatible HTTP routes (issue #4)."""

"""Admin web console (a later issue)."""

"""Model architectures, their configuration, weight loading and GGUF import."""

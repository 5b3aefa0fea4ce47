"""TEE evidence collection and offline verification, policy, key release (a later issue)."""

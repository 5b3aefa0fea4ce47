"""The appliance's fail-closed start-up: `startup` runs it, step by step; `audit_events` builds
what it records in the audit log; `key_release` releases a sealed model's data key to a passing
verdict; `weights` loads the served model and names it by the digest of its weights."""

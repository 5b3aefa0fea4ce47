"""TEE evidence: collection (NVML, configfs-tsm) and offline verification (`gpu/`, `cpu/`),
policy, the verdict, key providers (`keys/`) and the sealed-model format (`sealed/`); the
command line is `python -m attestation`."""

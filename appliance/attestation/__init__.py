"""The appliance's side of attestation: collecting evidence from the TEE it runs in, verifying
it through the `attestation` package's offline verifiers, holding the standing verdict that
gates key release and inference, signing verdicts for clients, and re-attesting on a timer.

The seams are Protocols (`appliance.attestation.evidence`): evidence sources (NVML and
configfs-tsm on a real machine; synthetic devices in tests) and the verifier.
"""

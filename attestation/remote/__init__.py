"""Attesting an Inferno appliance from the client's side, offline: the client draws its own
nonce, fetches `/v1/attestation` over the TLS connection it will send prompts on, verifies the
GPU and CPU evidence itself against its own pinned roots and policy, and checks that the
evidence binds the very TLS key its connection's peer presented (report_data v2,
attestation.binding). It trusts nothing the appliance says about itself.

Public API:
  AppliancePolicy.from_file(path)        the client policy (policy.py)
  ApplianceTrust.load(directory)         the client's pinned roots, RIMs, collateral (trust.py)
  verify_appliance(document, *, nonce, peer_spki_sha256, policy, trust, at) -> Verdict
                                         pure (verify.py)
  fetch_attestation(transport, origin, nonce)  one /v1/attestation over an httpx transport,
                                         with its connection's peer key (connection.py)
  AttestedTransport(...)                 an httpx transport (the `openai` client's
                                         http_client) that attests before any request body
                                         leaves, and pins the attested key (transport.py)
  AsyncAttestedTransport(...)            the same for httpx.AsyncClient, openai.AsyncOpenAI
                                         (async_transport.py)

`python -m attestation verify-appliance https://HOST:PORT --policy FILE --trust DIR` is the
command line. This package imports httpx only in its edge modules (connection.py,
transport.py, async_transport.py), and neither torch nor the appliance.
"""

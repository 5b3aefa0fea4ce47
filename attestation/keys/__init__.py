"""Key release: the data key of a sealed model, released only against a trusted verdict.

`KeyProvider` (provider.py) is the one seam the boot gate calls. Providers:
  file    (file.py)    a key-encryption key in a local file; development only, refused when
                       production is set;
  pkcs11  (pkcs11.py)  an AES key-encryption key that never leaves an HSM (tested on SoftHSM2);
  broker  (broker.py)  an on-premises key broker that checks the evidence itself and returns the
                       data key encrypted to the appliance's attested key-release key.
`open_key_provider(settings, production=...)` builds the first two from their settings.
"""

from attestation.keys.provider import (
    FileKeySettings,
    KeyProvider,
    KeyProviderSettings,
    Pkcs11KeySettings,
    open_key_provider,
    require_trusted,
)

__all__ = [
    "FileKeySettings",
    "KeyProvider",
    "KeyProviderSettings",
    "Pkcs11KeySettings",
    "open_key_provider",
    "require_trusted",
]

"""Start-up steps 5 and 6 (appliance.boot.startup): the sealed model's data key is released to
the passing verdict, then its weights are decrypted straight into memory and loaded.

Order, each step failing closed:
  1. the manifest verifies under the pinned manifest key and every listed file is present
     (SealedModel.open): a tampered directory never gets a key released for it;
  2. the key provider releases the data key for the manifest's key id and wrapped key, given
     the verdict (every provider refuses an untrusted one before touching a key);
  3. the weights are decrypted in parallel into host memory and loaded
     (LoadedModel.load_sealed); the data key is not kept.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from appliance.config import SealedSettings
from appliance.engine.engine_config import EngineConfig
from attestation.keys import (
    FileKeySettings,
    KeyProvider,
    KeyProviderSettings,
    Pkcs11KeySettings,
    open_key_provider,
)
from attestation.sealed import SealedModel
from attestation.sealed.manifest import load_manifest_public_key
from attestation.verdict import Verdict

if TYPE_CHECKING:  # torch: imported by the preload thread (appliance.boot.engine_preload)
    from appliance.boot.engine_preload import EnginePreload
    from appliance.boot.weights import LoadedModel


def key_provider(settings: SealedSettings, *, production: bool) -> KeyProvider:
    """The provider `settings` name (opens no device and reads no key yet). Raises
    KeyReleaseError for the file provider in production."""
    provider_settings: KeyProviderSettings
    if settings.key_provider == "file":
        assert settings.file_key_dir is not None, "checked by SealedSettings"
        provider_settings = FileKeySettings(settings.file_key_dir)
    else:
        assert settings.hsm_module and settings.hsm_token_label and settings.hsm_pin_file, (
            "checked by SealedSettings"
        )
        provider_settings = Pkcs11KeySettings(
            settings.hsm_module, settings.hsm_token_label, settings.hsm_pin_file
        )
    return open_key_provider(provider_settings, production=production)


def release_and_load(
    config: EngineConfig,
    settings: SealedSettings,
    provider: KeyProvider,
    verdict: Verdict,
    *,
    preload: EnginePreload | None = None,
) -> LoadedModel:
    """Steps 1-3 of the module docstring; `preload` is waited for before the engine's first
    step (LoadedModel.load_sealed). Raises SealedModelError (manifest, files, chunks),
    KeyReleaseError (the provider refused or failed), EngineError (an unusable model) or
    PreloadError."""
    assert settings.manifest_public_key_file is not None, "a sealed model is configured"
    manifest_key = load_manifest_public_key(settings.manifest_public_key_file)
    sealed = SealedModel.open(config.model_dir, manifest_key=manifest_key)
    manifest = sealed.manifest
    started_s = time.monotonic()
    data_key = provider.release_data_key(manifest.key_id, manifest.wrapped_key, verdict)
    released_ms = (time.monotonic() - started_s) * 1000
    # Only now torch and the engine: steps 1 and 2 went on while the preload imported them.
    loaded_model, waited_ms = load_modules()
    loaded = loaded_model.load_sealed(
        config, sealed, data_key, workers=settings.decrypt_workers, preload=preload
    )
    loaded = loaded.with_phase("key_release_ms", round(released_ms, 3))
    return loaded if preload is None else loaded.with_phase("torch_wait_ms", waited_ms)


def load_modules() -> tuple[type[LoadedModel], float]:
    """The load's class, importing torch and the engine (appliance.boot.weights), and how long
    that took in ms: beside the engine's preload, the wait for the preload's own import of
    them (importlib's lock). Call it from the load's thread: `/live` and `/health` answer
    meanwhile."""
    started_s = time.monotonic()
    from appliance.boot.weights import LoadedModel

    return LoadedModel, round((time.monotonic() - started_s) * 1000, 3)

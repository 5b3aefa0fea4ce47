"""The served model from a sealed directory: the embedded SmolLM2 sealed, its key released by the
`file` provider against a trusted verdict, decrypted in memory and loaded: it answers exactly as
the plaintext model does and carries the same weights digest. A wrong key loads nothing. A load
leaves nothing a start would freeze for good: no tensor and no holder of the key in a cycle."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from appliance.boot.weights import LoadedModel, digest_sealed_weights, digest_weights
from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.errors import ModelLoadError
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.tokenizer import Tokenizer
from appliance.errors import ModelFilesError
from attestation.errors import SealedModelError
from attestation.keys.file import FileKeyProvider
from attestation.sealed import SealedModel, seal_model
from attestation.verdict import Check, Verdict
from tests.appliance.engine.models.test_sealed_images import collector_paused  # noqa: F401

TRUSTED = Verdict(checks=(Check("test", True),), at=datetime(2026, 1, 1, tzinfo=UTC))


@pytest.fixture(scope="module")
def sealed_smollm2(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[SealedModel, bytes]:
    keys = tmp_path_factory.mktemp("keys")
    provider = FileKeyProvider(keys, production=False)
    provider.create_key("dev-kek")
    signing_key = Ed25519PrivateKey.generate()
    out = tmp_path_factory.mktemp("sealed") / "smollm2"
    seal_model(
        smollm2_dir, out, model_id="HuggingFaceTB/SmolLM2-135M-Instruct", key_id="dev-kek",
        wrap_data_key=provider.wrap_data_key, signing_key=signing_key, chunk_size=8 << 20,
        workers=2,
    )  # fmt: skip
    sealed = SealedModel.open(out, manifest_key=signing_key.public_key())
    manifest = sealed.manifest
    data_key = provider.release_data_key(manifest.key_id, manifest.wrapped_key, TRUSTED)
    return sealed, data_key


@pytest.mark.slow
def test_a_sealed_model_answers_as_the_plaintext_model_does(
    smollm2_dir: Path,
    smollm2_engine: Callable[..., Engine],
    sealed_smollm2: tuple[SealedModel, bytes],
) -> None:
    sealed, data_key = sealed_smollm2
    loaded = LoadedModel.load_sealed(
        EngineConfig(model_dir=sealed.directory), sealed, data_key, workers=2
    )
    plain = smollm2_engine()
    params = SamplingParams(temperature=0.0, max_tokens=16)
    prompt = "The capital of France is"
    [expected] = plain.generate([prompt], params)
    [answer] = loaded.engine.generate([prompt], params)
    assert answer.token_ids == expected.token_ids and answer.text
    assert loaded.weights_digest == digest_weights(smollm2_dir)


def test_the_sealed_digest_equals_the_plaintext_digest_without_decrypting(
    smollm2_dir: Path, sealed_smollm2: tuple[SealedModel, bytes]
) -> None:
    sealed, _ = sealed_smollm2
    assert digest_sealed_weights(sealed) == digest_weights(smollm2_dir)


def test_a_wrong_key_loads_nothing(sealed_smollm2: tuple[SealedModel, bytes]) -> None:
    sealed, _ = sealed_smollm2
    with pytest.raises(SealedModelError, match="not the key this model was sealed with"):
        LoadedModel.load_sealed(
            EngineConfig(model_dir=sealed.directory), sealed, os.urandom(32), workers=2
        )


def test_a_tokenizer_that_cannot_load_fails_the_sealed_load_with_its_own_error(
    sealed_smollm2: tuple[SealedModel, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer loads in a thread beside the decryption; its failure still fails the load,
    with its own error rather than another's."""
    sealed, data_key = sealed_smollm2

    def unusable(path: Path) -> Tokenizer:
        raise ModelLoadError(f"cannot load {path / 'tokenizer.json'} (truncated)")

    monkeypatch.setattr(Tokenizer, "from_model_dir", unusable)
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json \(truncated\)"):
        LoadedModel.load_sealed(
            EngineConfig(model_dir=sealed.directory), sealed, data_key, workers=2
        )


def test_the_engine_config_must_name_the_sealed_directory(
    smollm2_dir: Path, sealed_smollm2: tuple[SealedModel, bytes]
) -> None:
    sealed, data_key = sealed_smollm2
    with pytest.raises(ModelFilesError, match="is not the sealed directory"):
        LoadedModel.load_sealed(EngineConfig(model_dir=smollm2_dir), sealed, data_key, workers=2)


def _cyclic_garbage() -> list[object]:
    """Every object that only a collection can free now (reference cycles nothing reaches)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.usefixtures("collector_paused")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_sealed_load_leaves_no_tensor_and_no_holder_of_the_key_in_a_cycle(
    sealed_smollm2: tuple[SealedModel, bytes], device: str
) -> None:
    """What a start leaves in reference cycles is frozen at ready without a collection
    (appliance.boot.collector_pause), so is never freed: after the load and the engine's build
    (on a GPU: the pinned ring, the KV pool's profile, the CUDA graphs), that must hold no
    tensor (host or device memory, plaintext weights included) and nothing that refers to the
    data key."""
    sealed, data_key = sealed_smollm2
    config = EngineConfig(model_dir=sealed.directory, device=device, max_model_len=512)
    loaded = LoadedModel.load_sealed(config, sealed, data_key, workers=2)
    try:
        garbage = _cyclic_garbage()
        tensors = [repr(o.shape) for o in garbage if isinstance(o, torch.Tensor)]
        holders = [
            type(o).__name__ for o in garbage if any(r is data_key for r in gc.get_referents(o))
        ]
        del garbage
        assert (tensors, holders) == ([], [])
    finally:
        loaded.engine.close()


@pytest.mark.slow
def test_a_sealed_model_on_three_processes_answers_as_the_plaintext_model_on_one(
    smollm2_dir: Path, sealed_smollm2: tuple[SealedModel, bytes]
) -> None:
    """Tensor parallelism: every rank, rank 0 included, decrypts its own part of the sealed
    weights (appliance.engine.models.sealed_images.SealedShardImages)."""
    from appliance.engine.tokenizer import Tokenizer
    from tests.appliance.engine.parallel.test_tensor_parallel import build_engine, compare

    sealed, data_key = sealed_smollm2
    settings = {"max_num_batched_tokens": 8, "num_kv_blocks": 32, "num_cpu_threads": 1}
    config = EngineConfig(model_dir=sealed.directory, tensor_parallel_size=3, **settings)
    loaded = LoadedModel.load_sealed(config, sealed, data_key, workers=2)
    try:
        tokenizer = Tokenizer.from_model_dir(smollm2_dir)
        plain = build_engine(smollm2_dir, 1, tokenizer, **settings)
        prompt = tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
        assert compare((plain, loaded.engine), [prompt], params, scale_by_logits=True) >= 4
        assert loaded.weights_digest == digest_weights(smollm2_dir)
    finally:
        loaded.engine.close()

"""A sealed model's weight files decrypted onto the engine's device: straight into the image on
the CPU, through the ring of staging chunks elsewhere (exercised on the CPU with staging=True,
and on a GPU through pinned memory). Same bytes as the source; a bad chunk leaves nothing; and
nothing of it needs a garbage collection to be freed."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from appliance.engine.models.loader import load_model
from appliance.engine.models.sealed_images import SealedImages, StagingRing
from attestation.sealed import SealedModel
from attestation.sealed.errors import ChunkAuthenticationError
from attestation.sealed.model import ChunkReader
from tests.attestation.sealed.conftest import SealedFixture, flip_bit, seal, write_model

from .conftest import build_hf_model, save_checkpoint


@pytest.fixture
def sealed(tmp_path: Path) -> SealedFixture:
    return seal(write_model(tmp_path / "src"), tmp_path / "sealed")


def _open(fixture: SealedFixture) -> SealedModel:
    return SealedModel.open(fixture.sealed, manifest_key=fixture.public_key)


@pytest.mark.parametrize(("staging", "workers"), [(False, 2), (True, 1), (True, 2), (True, 8)])
def test_every_file_arrives_byte_for_byte(
    sealed: SealedFixture, staging: bool, workers: int
) -> None:
    images = SealedImages(
        _open(sealed), sealed.data_key, torch.device("cpu"), workers=workers, staging=staging
    )
    assert list(images) == sorted(e.name for e in sealed.manifest.sealed_files)
    for name in images:
        # With 1 or 2 workers the ring (workers + 2 slots) is smaller than the file: reused.
        assert sealed.manifest.file(name).num_chunks > 4
        assert images[name].numpy().tobytes() == (sealed.source / name).read_bytes()


def test_a_bad_chunk_leaves_a_zeroed_image_and_zeroed_slots(sealed: SealedFixture) -> None:
    name = "model-00001-of-00002.safetensors"
    path = sealed.sealed / (name + ".sealed")
    flip_bit(path, path.stat().st_size - 1)  # the tag of the last chunk
    model = _open(sealed)
    image = torch.full((model.manifest.file(name).size,), 7, dtype=torch.uint8)
    ring = StagingRing(model.manifest.chunk_size, workers=2, pinned=False)
    with (
        model.chunk_reader(sealed.data_key) as reader,
        pytest.raises(ChunkAuthenticationError, match="failed authentication"),
    ):
        ring.copy(reader, name, image)
    assert not image.any()
    assert not any(slot.any() for slot in ring.slots)


def test_one_ring_serves_every_file_and_holds_no_plaintext_once_closed(
    sealed: SealedFixture,
) -> None:
    images = SealedImages(
        _open(sealed), sealed.data_key, torch.device("cpu"), workers=2, staging=True
    )
    with images:
        images.prepare()
        ring = images._ring
        for name in images:
            assert images[name].numpy().tobytes() == (sealed.source / name).read_bytes()
            assert images._ring is ring
        assert ring is not None and any(slot.any() for slot in ring.slots)
    assert not any(slot.any() for slot in ring.slots)
    assert images._ring is None


def test_a_ring_pinned_in_the_background_serves_every_file_and_is_wiped(
    sealed: SealedFixture,
) -> None:
    images = SealedImages(
        _open(sealed), sealed.data_key, torch.device("cpu"), workers=2, staging=True
    )
    with images:
        images.prepare_in_background()
        assert images._pinning is not None
        rings = set()
        for name in images:
            assert images[name].numpy().tobytes() == (sealed.source / name).read_bytes()
            rings.add(id(images._ring))
        ring = images._ring
        assert images._pinning is None and len(rings) == 1
        assert ring is not None and any(slot.any() for slot in ring.slots)
    assert not any(slot.any() for slot in ring.slots)


def test_a_background_ring_that_failed_fails_the_first_file_and_closes_quietly(
    sealed: SealedFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: out of memory (pinning)")

    monkeypatch.setattr(StagingRing, "__init__", no_memory)
    images = SealedImages(
        _open(sealed), sealed.data_key, torch.device("cpu"), workers=2, staging=True
    )
    with images:
        images.prepare_in_background()
        with pytest.raises(RuntimeError, match="out of memory"):
            images[next(iter(images))]
    assert images._ring is None and images._pinning is None
    # Closed before it was waited for: the failure is not raised again.
    other = SealedImages(
        _open(sealed), sealed.data_key, torch.device("cpu"), workers=2, staging=True
    )
    other.prepare_in_background()
    other.close()
    assert other._ring is None and other._pinning is None


@pytest.mark.parametrize(
    "name", ["llama2", "qwen3", "granite", "phi3-longrope", "gemma3", "gemma3-multimodal"]
)
def test_a_sealed_checkpoint_loads_the_same_model_as_its_files(tmp_path: Path, name: str) -> None:
    source = save_checkpoint(build_hf_model(name), tmp_path / "m", max_shard_size="100KB")
    fixture = seal(source, tmp_path / "sealed")
    model = _open(fixture)
    images = SealedImages(model, fixture.data_key, torch.device("cpu"), workers=2, staging=True)
    from_sealed = load_model(fixture.sealed, weights=images)
    from_files = load_model(source)
    files_params = dict(from_files.named_parameters())
    for name, param in from_sealed.named_parameters():
        assert torch.equal(param, files_params[name]), name


@pytest.mark.gpu
def test_the_pinned_ring_delivers_every_file_to_the_gpu(sealed: SealedFixture) -> None:
    images = SealedImages(_open(sealed), sealed.data_key, torch.device("cuda"), workers=2)
    for name in images:
        image = images[name]
        assert image.is_cuda
        assert image.cpu().numpy().tobytes() == (sealed.source / name).read_bytes()


@pytest.mark.gpu
def test_a_bad_chunk_on_the_gpu_leaves_a_zeroed_device_image(sealed: SealedFixture) -> None:
    name = "model-00001-of-00002.safetensors"
    path = sealed.sealed / (name + ".sealed")
    flip_bit(path, path.stat().st_size - 1)
    model = _open(sealed)
    image = torch.full((model.manifest.file(name).size,), 7, dtype=torch.uint8, device="cuda")
    ring = StagingRing(model.manifest.chunk_size, workers=2, pinned=True)
    with (
        model.chunk_reader(sealed.data_key) as reader,
        pytest.raises(ChunkAuthenticationError),
    ):
        ring.copy(reader, name, image)
    assert not image.any().item()
    assert not any(slot.any() for slot in ring.slots)


@pytest.fixture
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off, as through a start (appliance.boot.collector_pause):
    only reference counting frees anything."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("background", [False, True], ids=["ring-now", "ring-in-background"])
def test_the_ring_the_images_and_the_key_s_holders_need_no_collection_to_be_freed(
    tmp_path: Path,
    device: str,
    background: bool,
    collector_paused: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Anything here in a reference cycle would outlive a start whose collector is paused, and
    never be freed once the start's objects are frozen at ready: the staging ring and its slots
    (pinned on a GPU), every decrypted image, and the objects holding the data key
    (`SealedImages`, `ChunkReader`) are freed by reference counting alone once the load is
    done."""
    source = save_checkpoint(build_hf_model("llama2"), tmp_path / "m", max_shard_size="100KB")
    fixture = seal(source, tmp_path / "sealed")
    freed: list[weakref.ref[object]] = []
    make_reader = ChunkReader.__init__

    def recorded_reader(reader: ChunkReader, *args: object) -> None:
        make_reader(reader, *args)  # type: ignore[arg-type]
        freed.append(weakref.ref(reader))

    monkeypatch.setattr(ChunkReader, "__init__", recorded_reader)

    class RecordedImages(SealedImages):
        def __getitem__(self, name: str) -> torch.Tensor:
            image = super().__getitem__(name)
            freed.append(weakref.ref(image))
            return image

    images = RecordedImages(
        _open(fixture), fixture.data_key, torch.device(device), workers=2, staging=True
    )
    with images:
        if background:
            images.prepare_in_background()
        images.prepare()
        assert images._ring is not None
        freed += [weakref.ref(images._ring), *map(weakref.ref, images._ring.slots)]
        model = load_model(fixture.sealed, device=device, weights=images)
    freed.append(weakref.ref(images))
    del images
    num_files = len(fixture.manifest.sealed_files)
    assert len(freed) == 2 * num_files + 1 + 4 + 1  # readers and images, the ring, 4 slots
    assert [ref for ref in freed if ref() is not None] == []
    assert next(model.parameters()).device.type == device  # what the load keeps: the model


def test_a_ring_made_beforehand_is_used_and_wiped_not_dropped(sealed: SealedFixture) -> None:
    model = _open(sealed)
    ring = StagingRing(model.manifest.chunk_size, workers=2, pinned=False)
    with SealedImages(model, sealed.data_key, torch.device("cpu"), workers=2, ring=ring) as images:
        for name in images:
            assert images[name].numpy().tobytes() == (sealed.source / name).read_bytes()
        assert any(slot.any() for slot in ring.slots)
    assert not any(slot.any() for slot in ring.slots)


def test_a_ring_with_smaller_chunks_than_the_model_is_refused(sealed: SealedFixture) -> None:
    ring = StagingRing(1024, workers=1, pinned=False)
    with pytest.raises(ValueError, match="smaller than the model's"):
        SealedImages(_open(sealed), sealed.data_key, torch.device("cpu"), ring=ring)


def _tensor_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's (begin, end) bytes in a safetensors file."""
    import json
    import struct

    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    header.pop("__metadata__", None)
    return {
        n: (8 + size + i["data_offsets"][0], 8 + size + i["data_offsets"][1])
        for n, i in header.items()
    }


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_decrypts_only_chunks_of_its_part_and_loads_its_shard(
    tmp_path: Path, rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank r of 2: the chunks that lie wholly in the other rank's rows of the embedding are
    never decrypted; the shard loaded equals the shard read from the plain files."""
    from appliance.engine.models.config import ModelConfig
    from appliance.engine.models.loader import parts_of
    from appliance.engine.models.sealed_images import SealedShardImages
    from appliance.engine.parallel.sharding import ShardPlan
    from attestation.sealed.model import ChunkReader

    source = save_checkpoint(build_hf_model("llama-attention-bias"), tmp_path / "m")
    fixture = seal(source, tmp_path / "sealed")
    decrypted: set[int] = set()
    decrypt = ChunkReader.decrypt_chunk_into

    def recording(reader: ChunkReader, name: str, index: int, out: memoryview) -> None:
        decrypted.add(index)
        decrypt(reader, name, index, out)

    monkeypatch.setattr(ChunkReader, "decrypt_chunk_into", recording)
    plan = ShardPlan.for_model(ModelConfig.from_model_dir(source), rank, 2)
    with SealedShardImages(_open(fixture), fixture.data_key, parts_of(plan), workers=2) as images:
        from_sealed = load_model(fixture.sealed, weights=images, shard=plan)
        assert images.num_chunks_decrypted == len(decrypted) < images.num_chunks
    from_files = load_model(source, shard=plan)
    files_params = dict(from_files.named_parameters())
    for name, param in from_sealed.named_parameters():
        assert torch.equal(param, files_params[name]), name
    [file_name] = [f.name for f in fixture.manifest.sealed_files]
    begin, end = _tensor_spans(source / file_name)["model.embed_tokens.weight"]
    half = (end - begin) // 2
    other = (begin + half, end) if rank == 0 else (begin, begin + half)
    chunk = fixture.manifest.chunk_size
    inside_other = set(range(-(-other[0] // chunk), other[1] // chunk))  # wholly inside
    assert inside_other and not inside_other & decrypted

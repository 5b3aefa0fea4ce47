"""The loader fed in-memory safetensors images (a sealed model's decrypted weights) instead of
files: the same model as from the files, tensors viewed in place, and hostile images refused
with a ModelLoadError, each named by its defect."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from appliance.engine.errors import ModelLoadError
from appliance.engine.models.loader import _image_tensors, load_model

from .conftest import build_hf_model, save_checkpoint


def _images(model_dir: Path) -> dict[str, bytearray]:
    return {p.name: bytearray(p.read_bytes()) for p in sorted(model_dir.glob("*.safetensors"))}


def _assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    params_b = dict(b.named_parameters())
    for name, param in a.named_parameters():
        assert torch.equal(param, params_b[name]), name


def test_images_load_the_same_model_as_the_files(tiny_checkpoints) -> None:
    model_dir, _ = tiny_checkpoints("llama2")
    from_files = load_model(model_dir)
    images = {name: memoryview(image) for name, image in _images(model_dir).items()}
    _assert_same_parameters(load_model(model_dir, weights=images), from_files)


def test_sharded_images_load_the_same_model(tmp_path: Path) -> None:
    sharded = save_checkpoint(build_hf_model("llama2"), tmp_path / "m", max_shard_size="100KB")
    images = _images(sharded)
    assert len(images) > 1
    _assert_same_parameters(load_model(sharded, weights=images), load_model(sharded))


def test_image_tensors_match_the_safetensors_library_and_share_memory() -> None:
    tensors = {
        "w": torch.randn(5, 7).to(torch.bfloat16),
        "b": torch.randn(3, dtype=torch.float64),
        "i": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "e": torch.empty(0, 4),
        "m": torch.tensor([True, False]),
    }
    image = bytearray(save(tensors, metadata={"format": "pt"}))
    parsed = dict(_image_tensors(Path("x.safetensors"), memoryview(image)))
    reference = load(bytes(image))
    assert parsed.keys() == reference.keys()
    for name, tensor in reference.items():
        assert parsed[name].dtype == tensor.dtype and torch.equal(parsed[name], tensor)
    parsed["i"][0, 0] = 99  # a view, not a copy: the write lands in the image
    assert load(bytes(image))["i"][0, 0] == 99


def _image(header: dict, data: bytes, header_size: int | None = None) -> memoryview:
    raw = json.dumps(header).encode()
    size = len(raw) if header_size is None else header_size
    return memoryview(bytearray(struct.pack("<Q", size) + raw + data))


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
HOSTILE = {
    "shorter_than_its_header_size": (memoryview(bytearray(b"\x01\x02")), "shorter than"),
    "header_size_past_the_end": (_image({"a": F32x2}, bytes(8), 10_000), "exceeds the image"),
    "header_not_json": (memoryview(bytearray(struct.pack("<Q", 3) + b"{{{")), "not JSON"),
    "header_a_list": (_image([], b""), "not a JSON object"),  # type: ignore[arg-type]
    "unknown_dtype": (_image({"a": {**F32x2, "dtype": "Q7"}}, bytes(8)), "unusable dtype"),
    "span_not_matching_shape": (_image({"a": {**F32x2, "shape": [3]}}, bytes(8)), "not \\[3\\]"),
    "gap_between_tensors": (
        _image({"a": F32x2, "b": {**F32x2, "data_offsets": [12, 20]}}, bytes(20)),
        "does not follow",
    ),
    "overlapping_tensors": (
        _image({"a": F32x2, "b": {**F32x2, "data_offsets": [4, 12]}}, bytes(12)),
        "does not follow",
    ),
    "trailing_bytes": (_image({"a": F32x2}, bytes(9)), "cover 8 data bytes of 9"),
    "data_cut_short": (_image({"a": F32x2}, bytes(7)), "cover 8 data bytes of 7"),
    "negative_offset": (_image({"a": {**F32x2, "data_offsets": [-8, 0]}}, bytes(8)), "spans -8..0"),
}


@pytest.mark.parametrize("defect", sorted(HOSTILE))
def test_a_hostile_image_is_refused(defect: str) -> None:
    image, message = HOSTILE[defect]
    with pytest.raises(ModelLoadError, match=message):
        list(_image_tensors(Path("model.safetensors"), image))


def test_a_hostile_image_is_refused_by_load_model_naming_the_file(tiny_checkpoints) -> None:
    model_dir, _ = tiny_checkpoints("llama2")
    images = _images(model_dir)
    name = next(iter(images))
    images[name] = images[name][:-1]
    with pytest.raises(ModelLoadError, match=f"{name} is not a valid safetensors image"):
        load_model(model_dir, weights=images)

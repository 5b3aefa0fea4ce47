"""The FP8 quantization a checkpoint declares in its `config.json` (`quantization_config`),
parsed once; anything else is refused here, naming the field, before a weight is read.

Two layouts are accepted, those vLLM serves FP8 checkpoints in:
- `quant_method: "compressed-tensors"` (llm-compressor; e.g. RedHatAI's Llama-3.1-8B-Instruct-
  FP8 models), `format: "float-quantized"`: config groups targeting `Linear` with weights
  `{type: float, num_bits: 8, strategy: channel | tensor}` and input activations `{type: float,
  num_bits: 8}`, dynamic per token or static per tensor. Tensors: `<module>.weight` F8_E4M3,
  `<module>.weight_scale` ([out, 1] per channel, [1] or [] per tensor), `<module>.input_scale`
  when static. `ignore`: module names (or `re:` regular expressions) left unquantized.
- `quant_method: "fp8"` (Qwen3-*-FP8, DeepSeek-V3): `activation_scheme: dynamic` and either
  `weight_block_size: [bn, bk]` with `<module>.weight_scale_inv` ([ceil(out/bn), ceil(in/bk)]:
  the real weight is weight * scale_inv of its block), or, without blocks, vLLM's per-tensor
  `<module>.weight_scale` (and `input_scale` under `activation_scheme: static`). Unquantized
  modules: `ignored_layers` (vLLM) or `modules_to_not_convert` (transformers), matched as
  transformers matches them (a name containing the entry).

Inferno keeps one form in memory (kernels.ops.Fp8Weight): a scale per output channel. A
per-tensor scale becomes every row's; a block-scaled weight is requantized per row at load
(loader). Embeddings, norms and the LM head are not quantized in either layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from appliance.engine.errors import ModelLoadError

WeightScales = Literal["channel", "tensor", "block"]


@dataclass(frozen=True, slots=True)
class Fp8Checkpoint:
    """What an FP8 checkpoint holds. `scales`: how its weight scales are laid out;
    `block_size`: (rows, columns) of a block for "block"; `static_input`: activations are
    quantized with each module's stored `input_scale` rather than per token."""

    scales: WeightScales
    block_size: tuple[int, int] | None
    static_input: bool
    # Modules left unquantized: checkpoint module names, matched as the layout matches them.
    ignore: tuple[str, ...] = ()
    ignore_by_substring: bool = False

    def ignores(self, module: str) -> bool:
        """Whether the checkpoint left `module` (its own name, e.g. `model.layers.0.mlp.
        down_proj`) unquantized: compressed-tensors names it or matches it with `re:`; the
        fp8 layout names a part of it."""
        if self.ignore_by_substring:
            return any(entry in module for entry in self.ignore)
        return any(
            re.fullmatch(entry[3:], module) if entry.startswith("re:") else entry == module
            for entry in self.ignore
        )

    @property
    def scale_name(self) -> str:
        """The tensor name suffix of a module's weight scales in the checkpoint."""
        return "weight_scale_inv" if self.scales == "block" else "weight_scale"

    @classmethod
    def from_config(cls, raw: Any, source: str) -> Fp8Checkpoint | None:
        """`raw`: config.json's `quantization_config`, or None for an unquantized checkpoint.
        Raises ModelLoadError naming the first field that asks for something unsupported."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{source}: quantization_config must be an object")
        method = raw.get("quant_method")
        if method == "compressed-tensors":
            return _compressed_tensors(raw, f"{source}: quantization_config")
        if method == "fp8":
            return _fp8(raw, f"{source}: quantization_config")
        raise ModelLoadError(
            f"{source}: quantization_config.quant_method {method!r} is not supported; Inferno "
            "loads FP8 checkpoints ('compressed-tensors' float-quantized, or 'fp8'), or "
            "unquantized ones (engine.quantization = 'fp8' quantizes those on load)"
        )


def _compressed_tensors(raw: dict[str, Any], where: str) -> Fp8Checkpoint:
    if raw.get("format") != "float-quantized":
        _refuse(where, "format", raw.get("format"), "'float-quantized'")
    if raw.get("kv_cache_scheme") is not None:
        _refuse(where, "kv_cache_scheme", raw.get("kv_cache_scheme"), "null")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(f"{where}.config_groups must be a non-empty object")
    schemes = set()
    for name, group in groups.items():
        at = f"{where}.config_groups.{name}"
        if not isinstance(group, dict):
            raise ModelLoadError(f"{at} must be an object")
        if group.get("targets") != ["Linear"]:
            _refuse(at, "targets", group.get("targets"), '["Linear"]')
        if group.get("output_activations") is not None:
            _refuse(at, "output_activations", group.get("output_activations"), "null")
        schemes.add((_ct_weights(group.get("weights"), at), _ct_inputs(group, at)))
    if len(schemes) > 1:
        raise ModelLoadError(f"{where}.config_groups: groups with different schemes are refused")
    (scales, static_input), *_ = schemes
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(entry, str) for entry in ignore):
        raise ModelLoadError(f"{where}.ignore must be a list of module names")
    for entry in ignore:
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as exc:
                raise ModelLoadError(f"{where}.ignore: {entry!r} is not a regex: {exc}") from None
    return Fp8Checkpoint(scales, None, static_input, tuple(ignore))


def _ct_weights(weights: Any, at: str) -> WeightScales:
    if not isinstance(weights, dict):
        raise ModelLoadError(f"{at}.weights must be an object")
    _expect(weights, at + ".weights", type="float", num_bits=8)
    if weights.get("symmetric", True) is not True or weights.get("dynamic", False) is not False:
        raise ModelLoadError(f"{at}.weights: only symmetric, static weight scales are supported")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor"):
        _refuse(at + ".weights", "strategy", strategy, "'channel' or 'tensor'")
    return strategy  # type: ignore[no-any-return]


def _ct_inputs(group: dict[str, Any], at: str) -> bool:
    """Whether the group's input activations use a static scale (else dynamic per token)."""
    inputs = group.get("input_activations")
    if not isinstance(inputs, dict):
        raise ModelLoadError(
            f"{at}.input_activations: weight-only FP8 (W8A16) is not supported; Inferno runs "
            "FP8 projections as W8A8 (FP8 input activations, dynamic per token or static)"
        )
    _expect(inputs, at + ".input_activations", type="float", num_bits=8)
    scheme = (inputs.get("strategy"), inputs.get("dynamic"))
    if scheme == ("token", True):
        return False
    if scheme == ("tensor", False):
        return True
    raise ModelLoadError(
        f"{at}.input_activations: strategy {scheme[0]!r} with dynamic {scheme[1]!r} is not "
        "supported; use 'token' with dynamic true, or 'tensor' with dynamic false"
    )


def _fp8(raw: dict[str, Any], where: str) -> Fp8Checkpoint:
    if raw.get("fmt", "e4m3") != "e4m3":
        _refuse(where, "fmt", raw.get("fmt"), "'e4m3'")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        _refuse(where, "activation_scheme", scheme, "'dynamic' or 'static'")
    block = raw.get("weight_block_size")
    if block is not None:
        if not (
            isinstance(block, list)
            and len(block) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)
        ):
            _refuse(where, "weight_block_size", block, "two positive integers")
        if scheme != "dynamic":
            _refuse(where, "activation_scheme", scheme, "'dynamic' with weight_block_size")
    names = [*(raw.get("ignored_layers") or []), *(raw.get("modules_to_not_convert") or [])]
    if not all(isinstance(name, str) for name in names):
        raise ModelLoadError(f"{where}: ignored_layers/modules_to_not_convert must list names")

    ignore = {"ignore": tuple(names), "ignore_by_substring": True}
    if block is None:
        return Fp8Checkpoint("tensor", None, scheme == "static", **ignore)
    return Fp8Checkpoint("block", (block[0], block[1]), False, **ignore)


def _expect(section: dict[str, Any], at: str, **wanted: object) -> None:
    for key, value in wanted.items():
        if section.get(key) != value:
            _refuse(at, key, section.get(key), repr(value))


def _refuse(at: str, field: str, value: object, supported: str) -> NoReturn:
    raise ModelLoadError(f"{at}.{field} {value!r} is not supported; supported: {supported}")

"""A model's `generation_config.json`: the ids that end its generation and the sampling its
authors recommend.

Read as vLLM's `--generation-config auto` (its default) reads it: `eos_token_id` (one id or
several: Llama 3 ends on `<|eot_id|>` and `<|eom_id|>`, Qwen3 on `<|im_end|>` and
`<|endoftext|>`), and the sampling defaults `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty` and `max_new_tokens`, which apply to a request that leaves them out.
Like vLLM, `do_sample` is not read: a checkpoint that states a temperature samples at it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.engine.errors import ModelLoadError

FILE_NAME = "generation_config.json"


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets; None: the API's own default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config's `max_new_tokens`

    def stated(self) -> dict[str, float | int]:
        """The defaults the model states, for the start-up log (vLLM logs them too)."""
        return {
            name: value
            for name in self.__slots__  # type: ignore[attr-defined]
            if (value := getattr(self, name)) is not None
        }


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    defaults: SamplingDefaults = SamplingDefaults()

    @classmethod
    def from_model_dir(cls, path: Path) -> GenerationConfig:
        """The model directory's generation_config.json, or an empty one when it has none.

        Raises `ModelLoadError` naming the file and field for a value of the wrong type or out
        of its range (a checkpoint's defaults are refused, not silently replaced).
        """
        file = Path(path) / FILE_NAME
        if not file.is_file():
            return cls()
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read {file} ({exc}); re-import the model") from exc
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{file} is not a JSON object; re-import the model")
        return cls.from_json(raw, source=str(file))

    @classmethod
    def from_json(cls, raw: dict[str, Any], *, source: str = FILE_NAME) -> GenerationConfig:
        eos = raw.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
        if eos_ids is None:
            eos_ids = []
        if not isinstance(eos_ids, list) or not all(_is_token_id(i) for i in eos_ids):
            raise ModelLoadError(
                f"{source}: eos_token_id must be a token id or a list of token ids"
            )
        read = _FieldReader(raw, source)
        defaults = SamplingDefaults(
            temperature=read.number("temperature", low=0.0, high=2.0),
            top_p=read.number("top_p", low=0.0, high=1.0, low_open=True),
            top_k=read.integer("top_k", low=0),
            min_p=read.number("min_p", low=0.0, high=1.0),
            repetition_penalty=read.number("repetition_penalty", low=0.0, low_open=True),
            max_tokens=read.integer("max_new_tokens", low=1),
        )
        return cls(tuple(eos_ids), defaults)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _FieldReader:
    """Optional fields of one file; null is the same as absent (transformers writes nulls)."""

    def __init__(self, raw: dict[str, Any], source: str):
        self._raw = raw
        self._source = source

    def number(
        self, name: str, *, low: float, high: float = math.inf, low_open: bool = False
    ) -> float | None:
        value = self._raw.get(name)
        if value is None:
            return None
        in_range = isinstance(value, int | float) and not isinstance(value, bool)
        if in_range:
            in_range = math.isfinite(value) and (value > low if low_open else value >= low)
            in_range = in_range and value <= high
        if not in_range:
            bounds = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
            if high == math.inf:
                bounds = f"{'above' if low_open else 'at least'} {low:g}"
            raise ModelLoadError(f"{self._source}: {name} must be a number {bounds}")
        return float(value)

    def integer(self, name: str, *, low: int) -> int | None:
        value = self._raw.get(name)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ModelLoadError(f"{self._source}: {name} must be an integer of at least {low}")
        return value

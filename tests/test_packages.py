"""The top-level packages are this repository's, not PyPI's namesakes (`installer`, `kernels`)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["appliance", "attestation", "audit", "kernels", "installer"])
def test_top_level_package_resolves_to_this_repository(name: str) -> None:
    module = importlib.import_module(name)
    [location] = module.__path__
    assert Path(location).resolve() == REPO_ROOT / name

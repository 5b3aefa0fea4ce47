"""The installer's fixtures: one set of bundle inputs and one built bundle per module, and this
checkout's wheel once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.installer.bundles import BundleInputs, build_bundle, build_project_wheel, make_inputs


@pytest.fixture(scope="module")
def bundle_inputs(tmp_path_factory: pytest.TempPathFactory) -> BundleInputs:
    return make_inputs(tmp_path_factory.mktemp("inputs"))


@pytest.fixture(scope="module")
def built_bundle(bundle_inputs: BundleInputs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bundle directory (and BUNDLE.tar beside it); tests copy it before changing anything."""
    return build_bundle(bundle_inputs, tmp_path_factory.mktemp("built") / "bundle")


@pytest.fixture(scope="session")
def project_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout's `inferno` wheel, built once per session (a few seconds)."""
    return build_project_wheel(tmp_path_factory.mktemp("project-wheel"))

"""The console's tests serve the API tests' engine (tests/appliance/api/conftest.py)."""

from tests.appliance.api.conftest import api_engine

__all__ = ["api_engine"]

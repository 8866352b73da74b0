"""Quiet coremltools in the Core ML backend tests."""

import logging

import pytest


@pytest.fixture(autouse=True)
def _quiet_coremltools():
    logging.getLogger("coremltools").setLevel(logging.ERROR)
    yield

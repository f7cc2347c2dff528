"""Fixtures shared by the end-to-end tests."""

import pytest

from zerotrain.models.tiny import build_tiny_pipeline


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny Flux pipeline folder written by save_pretrained (random weights, trained tokenizers)."""
    return build_tiny_pipeline("tiny-flux", tmp_path_factory.mktemp("model") / "tiny-flux")

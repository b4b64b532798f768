"""The packages that export their names lazily (``gateway/lazy.py``) still export every
name they did when they imported them eagerly: the benches and users import them."""

from __future__ import annotations

import importlib

import pytest

import gateway.cache.embedding
import gateway.sim

PACKAGES = [gateway.cache.embedding, gateway.sim]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_every_exported_name_resolves_from_its_home(package) -> None:
    for name in [*package.__all__, *package._HOMES]:
        value = getattr(package, name)
        home = package._HOMES.get(name)
        if home is not None:
            assert value is getattr(importlib.import_module(f"{package.__name__}.{home}"), name)


def test_the_names_the_benches_import_are_still_there() -> None:
    from gateway.cache.embedding import MODEL_NAME, EmbeddingTier, learned, local, rules

    assert MODEL_NAME == local.MODEL_NAME and EmbeddingTier.__name__ == "EmbeddingTier"
    assert callable(rules) and learned.__name__ == "gateway.cache.embedding.learned"


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_an_unknown_name_is_an_attribute_error(package) -> None:
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        package.nothing_here  # noqa: B018

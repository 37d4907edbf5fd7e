"""The one skip policy of the C extensions' tests: a missing build fails where a compiler could have built it,
and skips only without a compiler or under PAGEDKV_NATIVE=0."""

from __future__ import annotations

import pytest
from native_policy import require_native


def test_a_missing_build_fails_where_a_compiler_is_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_NATIVE", "1")
    monkeypatch.setattr("native_policy.shutil.which", lambda name: f"/usr/bin/{name}")
    with pytest.raises(BaseException) as raised:  # a skip raised here must fail the test, not skip it
        require_native("pagedkv.ops._cpu_decode", False)
    assert raised.type is pytest.fail.Exception and "is not built although" in str(raised.value)


@pytest.mark.parametrize(("env", "compiler"), [("0", "/usr/bin/cc"), ("1", None)])
def test_a_missing_build_skips_without_a_compiler_or_when_told(
    monkeypatch: pytest.MonkeyPatch, env: str, compiler: str | None
) -> None:
    monkeypatch.setenv("PAGEDKV_NATIVE", env)
    monkeypatch.setattr("native_policy.shutil.which", lambda name: compiler)
    with pytest.raises(BaseException) as raised:
        require_native("pagedkv.core._native", False)
    assert raised.type is pytest.skip.Exception and "PAGEDKV_NATIVE=0" in str(raised.value)


def test_a_build_present_neither_fails_nor_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("native_policy.shutil.which", lambda name: None)
    require_native("pagedkv.core._native", True)

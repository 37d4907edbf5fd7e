"""One policy for every C extension's tests: where a C compiler could have built the extension (and
PAGEDKV_NATIVE is not 0), a missing build fails the module; only a machine without a compiler, or one told to
build none, skips it. Used by the core's `_native` tests and the ops' `_cpu_decode` tests alike."""

from __future__ import annotations

import os
import shutil

import pytest


def native_expected() -> bool:
    """Whether this machine should have built the C extensions: a compiler is present and PAGEDKV_NATIVE != 0."""
    return os.environ.get("PAGEDKV_NATIVE", "1") != "0" and bool(shutil.which("cc") or shutil.which("gcc"))


def require_native(module: str, built: bool, detail: object = "") -> None:
    """Fail (expected but not built) or skip (not expected) the calling test module when `module` is missing."""
    if built:
        return
    if native_expected():
        pytest.fail(f"{module} is not built although a C compiler is present{f': {detail}' if detail else ''}",
                    pytrace=False)  # fmt: skip
    pytest.skip(f"{module} is not built (no C compiler, or PAGEDKV_NATIVE=0)", allow_module_level=True)

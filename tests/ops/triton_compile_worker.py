"""Worker process of tests/ops/test_triton_compile.py: compiles one kernel specialization to a cubin.

It runs in a spawned process because the test session runs Triton's interpreter (TRITON_INTERPRET=1),
which patches `triton.language` in ways the real compiler cannot use; `init_worker` (the pool's
initializer) removes the variable before triton is imported there, so the kernels are ordinary JIT
functions. Importing this module changes nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile


def init_worker() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def cuobjdump_path() -> str:
    import triton.backends.nvidia as nvidia

    path = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    if not os.path.exists(path):
        raise RuntimeError(f"triton's cuobjdump not found at {path}; cannot read register use")
    return path


def compile_kernel(
    kernel_name: str,
    types: dict[str, str],
    constexprs: dict[str, object],
    arch: int,
    options: dict[str, int],
) -> dict[str, int]:
    """Compile `pagedkv.ops.triton_kernels.<kernel_name>` for sm_<arch>; return cuobjdump's resource use.

    Arguments not in `types` or `constexprs` are i32. Pointers and `stride_*` arguments (except the
    block table's row stride) get the 16-divisibility the runtime infers for torch tensors and strides
    that are multiples of 16. Raises RuntimeError (picklable) on a compile error.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedkv.ops import triton_kernels

    fn = getattr(triton_kernels, kernel_name)
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names
    }
    aligned = [
        i
        for i, name in enumerate(fn.arg_names)
        if name.endswith("_ptr") or (name.startswith("stride_") and name != "stride_table")
    ]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    try:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", arch, 32),
            options=options,
        )
    except Exception as exc:  # compiler exceptions do not all pickle; keep the message
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from None
    cubin = compiled.asm["cubin"]
    if cubin[:4] != b"\x7fELF":
        raise RuntimeError("triton.compile did not produce a cubin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run(
            [cuobjdump_path(), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", report)}

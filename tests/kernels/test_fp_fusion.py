"""The kernels compile with FP fusion (FMA contraction) on, as they were tuned and tested,
whatever Triton's default (3.9 warns that 3.10 turns it off), and a user's own choice stays."""
import os
import subprocess
import sys

import pytest

_SCRIPT = """
import warnings
warnings.simplefilter("error")  # Triton 3.9's warning about the default would fail the compile
import nanovllm.kernels  # noqa: F401
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def axpb(x_ptr, a, b):
    tl.store(x_ptr, tl.load(x_ptr) * a + b)


src = ASTSource(fn=axpb, signature={"x_ptr": "*fp32", "a": "fp32", "b": "fp32"})
print(triton.compile(src, target=GPUTarget("cuda", 90, 32)).metadata.enable_fp_fusion)
"""


@pytest.mark.parametrize("user, fused", [(None, "True"), ("0", "False")])
def test_kernels_compile_with_fp_fusion(tmp_path, user: str | None, fused: str) -> None:
    """Without TRITON_DEFAULT_FP_FUSION the package sets it on (no warning); a user's 0 stays."""
    script = tmp_path / "compile_axpb.py"  # a file: Triton reads a kernel's source back
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    if user is not None:
        env["TRITON_DEFAULT_FP_FUSION"] = user
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [fused], out.stdout

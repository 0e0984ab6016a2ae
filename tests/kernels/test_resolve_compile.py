"""The Triton kernel compiles for Hopper (sm_90) without a GPU.

The interpreter runs Python semantics and misses what only the compiler
rejects (constexpr rules, layouts of gathers and sorts, scf.if/for bodies).
This compiles the kernel ahead of time with Triton's bundled toolchain, in
a subprocess because this folder's tests run Triton in interpreter mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import importlib, sys
    import triton
    from triton.backends.compiler import GPUTarget
    R = importlib.import_module("hisparse.kernels.resolve")
    fn = R._resolve_kernel
    word = sys.argv[1]
    ptrs = dict(topk_ptr="*i32", nreal_ptr="*i32", res_ptr="*i32", pages_ptr="*i64", host_ptr=word,
                hrows_ptr="*i32", tags_ptr="*i32", stamp_ptr="*i64", step_ptr="*i64", kv_ptr=word,
                phys_ptr="*i32", cnt_ptr="*i32")
    ints = ["QK", "K", "NB", "H", "bt", "s_tb", "s_tq", "s_tk", "s_rb", "s_rn", "s_pb", "s_pn",
            "s_hrb", "s_hrh", "s_tgb", "s_tgh", "s_stb", "s_sth", "s_cb"]
    row = 164 if word == "*i32" else 656
    const = dict(HOST_STRIDE=row, KV_STRIDE=row, ROW_WORDS=row, ROW_BLOCK=triton.next_power_of_2(row),
                 COPY_ROWS=8, E_BLOCK=64, E_BITS=6, H_BLOCK=32, H_BITS=5,
                 POS_SENT=R._POS_SENT, I64_MAX=R._I64_MAX)
    sig = {**ptrs, **{k: "i32" for k in ints}, **{k: "constexpr" for k in const}}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in ptrs}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert k.asm["cubin"], "no cubin"
    print("ok", len(k.asm["ptx"]))
""")


def _toolchain() -> bool:
    try:
        import triton

        return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                           "ptxas"))
    except ImportError:
        return False


@pytest.mark.skipif(not _toolchain(), reason="Triton without its NVIDIA toolchain")
@pytest.mark.parametrize("word", ["*i32", "*u8"])
def test_kernel_compiles_for_sm90(word):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", SCRIPT, word], capture_output=True, text=True, cwd=root,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")

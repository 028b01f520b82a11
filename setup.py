"""Packaging metadata lives in pyproject.toml; this file only adds the native CPU
kernels (kvrelay/model/kernels/csrc), built against the torch already installed.

They are built by ``make`` (``KVRELAY_BUILD_NATIVE=1 python setup.py build_ext
--inplace``), never under pip's build isolation, which would pull an unpinned torch
into a throwaway environment; a plain ``pip install`` builds none, and kvrelay then
runs its pure-torch kernels.
"""

import os

from setuptools import setup

ext_modules = []
cmdclass = {}
if os.environ.get("KVRELAY_BUILD_NATIVE") == "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    src = "kvrelay/model/kernels/csrc/"
    ext_modules.append(
        CppExtension(
            "kvrelay.model.kernels._native",
            [src + "bindings.cpp", src + "isa_avx512.cpp", src + "isa_avx512_vnni.cpp",
             src + "isa_avx2.cpp",
             src + "gemm_bf16.cpp", src + "gemm_bf16_amx.cpp", src + "attn_bf16.cpp",
             src + "attn_prefill_amx.cpp"],
            # -fno-wrapv undoes Python's -fwrapv (4x slower loops: gcc may no longer
            # assume int indices do not overflow); no-math-errno and no-trapping-math
            # let it vectorize floorf and selects. No -ffast-math: no reassociation.
            extra_compile_args=[
                "-O3", "-fno-wrapv", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-Wno-psabi",
            ],
            extra_link_args=["-fopenmp"],
        )
    )
    cmdclass["build_ext"] = BuildExtension

setup(ext_modules=ext_modules, cmdclass=cmdclass)

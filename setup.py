"""Builds the native module `tandem.csrc._native` (pybind11, C++ only; CUDA kernels build separately).

The module is optional at run time: `tandem.csrc` falls back to numpy when it is missing, so a failed
compiler here costs prefill-admission latency, not correctness.
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "tandem.csrc._native",
            ["csrc/prompt.cpp"],
            # Header edits must trigger a rebuild of the in-place module.
            depends=["csrc/prompt.h"],
            include_dirs=["csrc"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    ]
)

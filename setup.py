"""Package set-up. Metadata lives in pyproject.toml.

The native extension (csrc/) is built on first use by torch.utils.cpp_extension (see chunkmem/memory/native.py),
not here: building it at install time would make pip fetch a CUDA build of torch into an isolated
build environment. Without a compiler chunkmem runs on pure PyTorch.
"""

from setuptools import setup

setup()

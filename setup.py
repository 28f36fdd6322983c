"""Build bbio and its cffi extension (``csrc/build_ffi.py``)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["bbio", "bbio.*"]),
    cffi_modules=["csrc/build_ffi.py:ffibuilder"],
)

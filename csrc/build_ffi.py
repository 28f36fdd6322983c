"""cffi build script (out-of-line API mode) for bbio's native core.

setup.py names it in ``cffi_modules``; it compiles ``bbio/_bbio_native``.
Only ``bbio/_native.py`` may import the result.
"""

from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).resolve().parent

ffibuilder = FFI()
ffibuilder.cdef((CSRC / "bbio_native_api.h").read_text())
ffibuilder.set_source(
    "bbio._bbio_native",
    '#include <stdint.h>\n#include <stddef.h>\n#include "bbio_native_api.h"\n',
    sources=["csrc/bbio_native.c"],
    include_dirs=["csrc"],
    extra_compile_args=["-O3", "-std=gnu11"],
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)

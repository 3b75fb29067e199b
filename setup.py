"""Builds the fused CPU kernels (``functorch_optim/_fused_kernels.cc``) with the package.

Everything else about the package is in ``pyproject.toml``. The kernels are a plain shared
library loaded through ctypes and registered with XLA's FFI (``functorch_optim/_fused.py``),
compiled against the XLA FFI headers of the build-time jaxlib (``jax.ffi.include_dir()``),
with ``-ffp-contract=off`` (the kernels place every fused multiply-add by hand, where XLA
contracts one) and, on x86-64, one clone of each element loop per instruction-set level,
chosen when the library loads (``FO_CLONES`` in the source). The build writes the
library's SHA-256 beside it (``<library>.sha256``); the loader checks it before loading.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

FLAGS = ["-std=c++20", "-O3", "-g0", "-ffp-contract=off", "-fno-math-errno", "-w"]


class BuildKernels(build_ext):
    """``build_ext`` with the FFI headers of the build-time jaxlib and a checksum file."""

    def build_extensions(self):
        import jax  # a build requirement (pyproject.toml)

        for ext in self.extensions:
            ext.include_dirs.append(jax.ffi.include_dir())
        super().build_extensions()

    def build_extension(self, ext):
        super().build_extension(ext)
        library = Path(self.get_ext_fullpath(ext.name))
        digest = hashlib.sha256(library.read_bytes()).hexdigest()
        library.with_name(library.name + ".sha256").write_text(digest + "\n")

    def copy_extensions_to_source(self):
        # editable installs: the checksum travels with the library into the source tree
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            name = self.get_ext_filename(self.get_ext_fullname(ext.name))
            built = Path(self.build_lib) / name
            package_dir = Path(build_py.get_package_dir(".".join(ext.name.split(".")[:-1])))
            target = package_dir / Path(name).name
            target.with_name(target.name + ".sha256").write_bytes(
                built.with_name(built.name + ".sha256").read_bytes()
            )

    def get_outputs(self):
        outputs = super().get_outputs()
        return outputs + [f"{output}.sha256" for output in outputs]


setup(
    ext_modules=[
        Extension(
            "functorch_optim._fused_kernels",
            sources=["functorch_optim/_fused_kernels.cc"],
            language="c++",
            extra_compile_args=FLAGS,
        )
    ],
    cmdclass={"build_ext": BuildKernels},
)

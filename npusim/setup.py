"""Only what pyproject.toml cannot say: ship npusim.pth into site-packages.

The .pth installs a finder for ``import torch_npu`` when NPUGRAPH_SIM_TORCH_NPU=1 (see
npusim_hook.py); it imports nothing else otherwise.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "npusim.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(self.build_lib) / PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildWithPth})

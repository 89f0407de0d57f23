"""Installed by scripts/sglang_venv.sh into the SGLang venv (with a .pth line importing it).

SGLang imports torchvision while loading model configs (multimodal helpers) that kvpool's
tests never use. PyPI's torchvision wheels are built against CUDA torch and fail to load beside
torch 2.13.0's CPU build. This finder makes `torchvision` and its submodules importable as
placeholders: any name read from them is a class that refuses to be instantiated, so a real use
fails loudly instead of computing something wrong.
"""

import importlib.abc
import importlib.machinery
import sys
import types

_NAME = "torchvision"


class _Refusing(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Refusing(name, (), {"__init__": _refuse, "__module__": cls.__module__})


def _refuse(self, *args, **kwargs):
    raise RuntimeError(f"{type(self).__name__}: torchvision is a placeholder in this venv")


class _Placeholder(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Refusing(name, (), {"__init__": _refuse, "__module__": self.__name__})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == _NAME or fullname.startswith(_NAME + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Placeholder(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+placeholder"
        module.kvpool_placeholder = True
        return module

    def exec_module(self, module):
        return None


sys.meta_path.insert(0, _Finder())

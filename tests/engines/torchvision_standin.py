"""A stand-in ``torchvision`` for importing SGLang's request classes on a CPU machine.

Why: ``sglang.srt.managers.io_struct`` (the msgspec request structs the HTTP server decodes bodies into)
imports ``torchvision`` only through a multimodal helper (``sglang/srt/multimodal/internvl_utils.py``);
nothing that weightstream's protocol check touches uses it. The PyPI torchvision wheels are built against
CUDA torch and do not import beside the CPU torch (``operator torchvision::nms does not exist``), so
tests/engines/sglang_check.py imports this module first: it installs a meta-path finder that answers every
``torchvision`` / ``torchvision.*`` import with an inert module (attributes are do-nothing objects, plus the
``InterpolationMode`` enum the helper reads at import time). Used only by the SGLang check, never by
weightstream itself."""

import enum
import importlib.abc
import importlib.machinery
import sys
import types


class _Dummy:
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return self

    def __getattr__(self, name):
        return _Dummy()


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        return _Dummy


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0+stub"
        m.__file__ = "<torchvision-stub>"
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())

"""Warnings that name the user's line.

autoshard warns from deep inside torch's machinery -- a backend dynamo calls, a tensor subclass's
``__torch_dispatch__`` under pytree, an autograd hook -- where a fixed ``stacklevel`` lands on a torch file
(``torch/utils/_pytree.py``) that tells the user nothing. :func:`warn` walks the stack instead and attributes the
warning to the first frame that is none of autoshard's, torch's, the standard library's or generated code
(dynamo's ``<eval_with_key>`` graphs): the model's or the training script's line that led there. The usual
warning filters and their once-per-location registry apply to that line.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings

import torch

__all__ = ["warn", "user_frame"]

def _directory(path: str) -> str:
    return os.path.dirname(os.path.abspath(path)) + os.sep


_LIBRARIES = (_directory(os.path.dirname(__file__)), _directory(torch.__file__))
"""The autoshard package and torch: their frames are not the user's."""
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_SITE_PACKAGES = tuple({os.path.abspath(sysconfig.get_paths()[key]) + os.sep for key in ("purelib", "platlib")})


def _is_users(filename: str) -> bool:
    if filename.startswith("<"):  # generated: dynamo's graphs, exec'd code
        return False
    path = os.path.abspath(filename)
    if path.startswith(_LIBRARIES):
        return False
    return not path.startswith(_STDLIB) or path.startswith(_SITE_PACKAGES)


def user_frame():
    """The innermost frame of the calling stack outside autoshard, torch, the standard library and generated code
    (the outermost frame when every frame is theirs)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and not _is_users(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to :func:`user_frame`."""
    frame = user_frame()
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__", "<unknown>"),
                           registry=frame.f_globals.setdefault("__warningregistry__", {}))

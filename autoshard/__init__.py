"""autoshard: sequence (context) parallelism as a torch.compile backend.

    model = torch.compile(model, backend=autoshard.backend(mesh))

See README.md for the tour and DESIGN notes in the module docstrings.
"""

from . import launch, runtime

__all__ = ["runtime", "launch"]
__version__ = "0.1.0"

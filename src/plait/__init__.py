"""plait: distributed training for PyTorch on one device mesh."""

from plait.mesh import AXES, Mesh, MeshLayout, init_mesh

__version__ = "0.1.0"

__all__ = ["AXES", "Mesh", "MeshLayout", "__version__", "init_mesh"]

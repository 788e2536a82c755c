"""Old name of :mod:`tvmkv.tir.foreign_layouts`, kept only until ``tvmkv/runtime`` imports
``from ..tir import LAYOUTS, foreign_shape``; delete it then."""

from .foreign_layouts import LAYOUTS, foreign_shape  # noqa: F401

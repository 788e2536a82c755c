"""Old name of :mod:`tvmkv.tir.decode_layout`, kept only until ``tvmkv/runtime`` imports
``from ..tir import split_granule``; delete it then."""

from .decode_layout import split_granule  # noqa: F401

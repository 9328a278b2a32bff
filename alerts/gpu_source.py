"""The GPU sources' recording rules: the generator lives in the installed package,
`sidecar/mixin/gpu_source.py` (docs/dcgm.md); these are its names, for the checkout's tools."""

from __future__ import annotations

from sidecar.mixin.gpu_source import (  # noqa: F401 (re-exported)
    DCGM,
    DEFAULT_COUNTERS,
    NOT_MAPPED,
    SIDECAR_ONLY,
    Mapping,
    dcgm_source,
    markdown_table,
    recorded,
    sidecar_source,
)

"""What `ragkv calibrate` stored for the model, loaded once at start (app.runtime): its
A2ATS codebook and the fusion settings calibrated per strategy. The Runtime owns it and
hands it to what reads it (the query path, pasted passages, ingestion), so the engine
carries only what it builds itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from ragkv.fusion import CalibratedFusion
from ragkv.sparse.codebook import A2ATSCodebook


@dataclass
class Calibrated:
    codebook: A2ATSCodebook | None = None
    """With a codebook, every chunk stored gets its A2ATS codes; the a2ats selector needs one."""
    fusion: dict[str, CalibratedFusion] = field(default_factory=dict)
    """Settings per fusion strategy, used by requests that name no ratio."""

"""What the routes share: the runtime, the worker, sessions, ingestion records, metrics."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from fastapi import Request

from ragkv.api.config import ServeConfig
from ragkv.api.errors import ApiError
from ragkv.api.metrics import Metrics
from ragkv.api.model_work import ModelWork
from ragkv.api.worker import ModelWorker
from ragkv.app.chat.contexts import ContextStore
from ragkv.app.ingest_records import IngestRecords
from ragkv.app.runtime import Runtime

log = logging.getLogger("ragkv.api")


@dataclass
class AppState:
    config: ServeConfig
    runtime: Runtime
    worker: ModelWorker
    sessions: ContextStore
    ingest_records: IngestRecords
    metrics: Metrics
    work: ModelWork
    model_id: str
    started: float = field(default_factory=time.time)

    def check_model(self, model: str) -> None:
        """A generation request names the served model (or the alias "ragkv"), else 404."""
        if model not in (self.model_id, "ragkv"):
            raise ApiError(
                404,
                "model_not_found",
                f"the model {model!r} does not exist; this server serves {self.model_id!r}",
                param="model",
            )


def app_state(request: Request) -> AppState:
    return request.app.state.ragkv

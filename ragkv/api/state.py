"""What the routes share: the engine client, the config and the metrics."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from fastapi import Request

from ragkv.api.config import ServeConfig
from ragkv.api.errors import ApiError
from ragkv.api.metrics import Metrics
from ragkv.app.server import EngineClient

log = logging.getLogger("ragkv.api")


@dataclass
class AppState:
    config: ServeConfig
    client: EngineClient
    metrics: Metrics
    started: float = field(default_factory=time.time)

    @property
    def model_id(self) -> str:
        return self.client.model_id

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

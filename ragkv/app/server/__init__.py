"""The engine client and what it owns: the model worker's loop, its tasks and request
streams, and what the worker runs for the front ends (the HTTP API, the CLI)."""

from ragkv.app.errors import QueueFull
from ragkv.app.server.client import EngineClient
from ragkv.app.server.config import ServerConfig
from ragkv.app.server.documents import IngestedDocument, Ingestion, JobReport
from ragkv.app.server.model_work import Embeddings
from ragkv.app.server.observer import ServerObserver
from ragkv.app.server.request_stream import RequestStream, StreamEvent
from ragkv.app.server.status import Backends, SchedulerLoad, ServerHealth, ServerStats, WorkerLoad
from ragkv.app.server.task import Task
from ragkv.app.server.worker import ModelWorker

__all__ = [
    "Backends",
    "Embeddings",
    "EngineClient",
    "IngestedDocument",
    "Ingestion",
    "JobReport",
    "ModelWorker",
    "QueueFull",
    "RequestStream",
    "SchedulerLoad",
    "ServerConfig",
    "ServerHealth",
    "ServerObserver",
    "ServerStats",
    "StreamEvent",
    "Task",
    "WorkerLoad",
]

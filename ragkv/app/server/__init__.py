"""The engine client and what it owns: the model worker's loop, its tasks and request
streams, and what the worker runs for the front ends (the HTTP API, the CLI)."""

from ragkv.app.scheduler import QueueFull
from ragkv.app.server.client import EngineClient
from ragkv.app.server.config import ServerConfig
from ragkv.app.server.observer import ServerObserver
from ragkv.app.server.request_stream import RequestStream, StreamEvent
from ragkv.app.server.task import Task
from ragkv.app.server.worker import ModelWorker

__all__ = [
    "EngineClient",
    "ModelWorker",
    "QueueFull",
    "RequestStream",
    "ServerConfig",
    "ServerObserver",
    "StreamEvent",
    "Task",
]

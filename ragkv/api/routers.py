"""Every endpoint's router, in the order the app includes them: one folder per endpoint
under ragkv/api/ (`router.py` the routes, `protocol.py` the request, response and stream
models, `serving.py` the answer and its stream), and no endpoint imports another's."""

from __future__ import annotations

from ragkv.api.chat.router import router as chat
from ragkv.api.completions.router import router as completions
from ragkv.api.documents.router import router as documents
from ragkv.api.embeddings.router import router as embeddings
from ragkv.api.query.router import router as query
from ragkv.api.responses.router import router as responses
from ragkv.api.system.router import router as system

ROUTERS = (system, documents, query, chat, completions, embeddings, responses)

"""JSON responses that render any stored value.

A lone UTF-16 surrogate cannot be encoded as UTF-8. Requests carrying one are refused,
but a value stored before that check (document metadata, a name) must still list: such a
body is rendered with ASCII escapes (`\\udfff`), which is valid JSON text.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse


class SafeJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")
